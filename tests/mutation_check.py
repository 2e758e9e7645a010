"""Mutation check of the replica core that LLMServer and the simulator share
(deployments/replica_core.py and the replica admission policy it builds): each mutation is applied
alone, LLMServer's tests and the simulator's tests run against it, and the file is restored. Both
suites must fail under every mutation: one implementation, run two ways.

    python tests/mutation_check.py        (from the repository root; exit 1 if a suite missed one)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (file, text, its mutation, name)
MUTATIONS = [
    ("deployments/replica_core.py", "verdict, ticket = self.admission.admit(priority)",
     "verdict, ticket = self.admission.admit(Priority.INTERACTIVE)", "admission ignores priority"),
    ("autoscaler/admission.py", "def replica_policy(max_waiting_requests: int = 256,",
     "def replica_policy(max_waiting_requests: int = 255,", "replica limit 256 -> 255"),
    ("autoscaler/admission.py", "max_waiting_requests: int = 256, batch_shed_fraction: float = 0.5,",
     "max_waiting_requests: int = 256, batch_shed_fraction: float = 0.6,", "batch fraction 0.5 -> 0.6"),
]
TESTS = {"LLMServer": ["tests/unit/deployments/test_llm_server.py"],
         "simulator": ["tests/unit/simulator/test_cluster.py"]}


def main() -> int:
    missed = 0
    for path, old, new, name in MUTATIONS:
        source = ROOT / path
        text = source.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{path} no longer holds {old!r}: update the mutation")
        source.write_text(text.replace(old, new))
        try:
            for suite, files in TESTS.items():
                run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                                     capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
                failed = [line.split("::")[-1].split(" ")[0] for line in run.stdout.splitlines()
                          if line.startswith("FAILED")]
                missed += run.returncode == 0
                print(f"{name:28s} {suite:10s} {'caught' if failed else 'MISSED'}: {failed}")
        finally:
            source.write_text(text)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
