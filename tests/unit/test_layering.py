"""The house's floors: each package imports only the floors below it, and no module imports
itself back through others.

    iterserve (the command line)
    simulator (`iterserve simulate`: the cluster simulator and its validation)
    loadtest (`iterserve bench`, the load generator, benchmark scripts, the fault suite)
    deployments (the Ray Serve application)
    model_worker, router, autoscaler (the library layers)
    contracts (what passes between the parts: imports none of them)

Every import statement of every module is read (top level or inside a function, which is where
an upward arrow hides), so this fails the moment one runs upward.

Cycles are found in the module import graph of every module of these packages. A node is a
module, a package being its `__init__`. An edge M -> N means M's source names N in an import:
`import a.b` and `from a.b import name` give a.b, `from a.b import c` gives a.b.c when c is a
module, and relative imports resolve against M's package. Imports at top level and inside
functions count alike: an import moved into a function hides a cycle from the interpreter at load
time, but the two modules still need each other. Imports under `if TYPE_CHECKING:` never run and
do not count, nor does a module naming itself.

Importing a.b.c also runs a's and a.b's `__init__`, but that is no edge to them: when a's
`__init__` imports a.b.c, which imports a sibling a.x, Python finds `a` already in sys.modules
and loads a.x as a submodule, so an `__init__` re-exporting from submodules that import the
package's siblings is no cycle. What does break is a.b.c taking a name from the half-run
`__init__` (`from a import name`), and that is an edge a.b.c -> a, so a cycle through the
`__init__` is still found.
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
PACKAGES = sorted(FORBIDDEN.keys() | {"iterserve"})


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


# ---- the module import graph -------------------------------------------------------------------

def module_files(root: Path, packages: list[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every module under the given packages."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import and ImportFrom in the tree, except those under `if TYPE_CHECKING:` (its else
    branch runs, so it is walked)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted name that is one of our modules: `import a.b.attr` is
    an import of a.b."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that module `name` (source at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        found |= {known for target in targets if (known := _known(target, modules))}
    found.discard(name)
    return found


def import_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module, as a chain that
    starts and ends at the component's first module by name: [a, b, c, a]."""
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        start = min(component)
        cycles.append(_shortest_cycle(graph, start, component))
    return sorted(cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (a deep import chain must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _shortest_cycle(graph: dict[str, set[str]], start: str, component: set[str]) -> list[str]:
    """Breadth-first from start back to start, inside the component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(previous[chain[-1]])
                    return [start, *chain[::-1][1:], start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a component but on no cycle")


def test_no_module_imports_itself_back():
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 100, "the walk found too few modules"
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_finds_a_cycle_and_ignores_type_checking_imports(tmp_path):
    files = {
        # A re-exporting __init__ whose submodules import their siblings: no cycle.
        "pkg/__init__.py": "from pkg.api import Thing\n",
        "pkg/api.py": "from pkg import impl\n\nclass Thing: ...\n",
        # The factory's import inside a function closes pkg.api -> pkg.impl -> pkg.factory -> pkg.api.
        "pkg/impl.py": "import pkg.factory\n",
        "pkg/factory.py": "def make():\n    from pkg.api import Thing\n    return Thing()\n",
        # pkg.hints and pkg.user name each other, pkg.hints only for type checkers: no cycle.
        "pkg/hints.py": ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.user import User\n"
                         "else:\n    from . import leaf\n"),
        "pkg/user.py": "import typing\n\nfrom pkg.hints import leaf\n\nif typing.TYPE_CHECKING:\n    import pkg.hints\n",
        "pkg/leaf.py": "",
        # A submodule that takes a name from its package's half-run __init__: a cycle.
        "other/__init__.py": "from other.core import run\n\nNAME = 1\n",
        "other/core.py": "from other import NAME\n\ndef run(): ...\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["other", "pkg"])
    assert graph["pkg"] == {"pkg.api"} and graph["pkg.api"] == {"pkg.impl"}
    assert graph["pkg.hints"] == {"pkg.leaf"}, "the TYPE_CHECKING import is ignored, its else branch is not"
    assert graph["pkg.user"] == {"pkg.hints"}
    assert import_cycles(graph) == [["other", "other.core", "other"],
                                    ["pkg.api", "pkg.impl", "pkg.factory", "pkg.api"]]
