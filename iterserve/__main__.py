import sys

from iterserve.cli import main

sys.exit(main())
