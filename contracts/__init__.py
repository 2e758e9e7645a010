"""The bottom floor: what passes between the parts, as types. Imports nothing of iterserve's.

Every package may import it; it imports only the standard library (tests/unit/test_layering.py).
"""

from contracts.priority import PRIORITIES, Priority
from contracts.reports import LoadReport, RoutingReport

__all__ = ["PRIORITIES", "LoadReport", "Priority", "RoutingReport"]
