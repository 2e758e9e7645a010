"""The house's floors: each package imports only the floors below it.

    iterserve (the command line)
    simulator (`iterserve simulate`: the cluster simulator and its validation)
    loadtest (`iterserve bench`, the load generator, benchmark scripts, the fault suite)
    deployments (the Ray Serve application)
    model_worker, router, autoscaler (the library layers)
    contracts (what passes between the parts: imports none of them)

Every import statement of every module is read (top level or inside a function, which is where
an upward arrow hides), so this fails the moment one runs upward.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "contracts": {"model_worker", "router", "autoscaler", "deployments", "loadtest", "simulator", "iterserve"},
    "model_worker": {"deployments", "loadtest", "simulator", "iterserve"},
    "router": {"deployments", "loadtest", "simulator", "iterserve"},
    "autoscaler": {"deployments", "loadtest", "simulator", "iterserve"},
    "deployments": {"loadtest", "simulator", "iterserve"},
    "loadtest": {"simulator", "iterserve"},
    "simulator": {"iterserve"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add((node.module.split(".")[0], node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_a_floor_above_it(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, f"no modules under {package}/"
    upward = [f"{path.relative_to(ROOT)}:{line} imports {name}"
              for path in modules for name, line in imported_packages(path) if name in FORBIDDEN[package]]
    assert not upward, "\n".join(upward)


def test_the_walk_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from deployments import app\n")
    assert ("deployments", 4) in imported_packages(module)
