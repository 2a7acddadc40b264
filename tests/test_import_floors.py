"""The package's import floors: each package imports only from the floors below it, and no module
imports itself back through another (no cycle), counting imports inside functions too.

A newcomer reads the tree bottom-up; an upward import or a cycle is a design decision that
should be made here, on purpose, not by accident in a lazy import.
"""

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_gspo"
FLOORS = [  # lowest first; a module may import from its own floor and the floors below
    {
        "errors",
        "checksums",
        "deferred_compile",
        "lazy_exports",
        "optional",
        "patches",
        "python_command",
        "termination",
    },
    {"algorithms", "tasks"},
    {"model"},
    {"config"},
    {"checkpoint"},
    {"rollout", "weight_sync", "placement"},  # the embedded server receives with weight_sync's protocol
    {"training"},
    {"analysis", "plan"},
    {"cli"},
]
LARGEST_MODULE_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The megatron_gspo modules `path` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            base = node.module
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return {name for name in out if name.split(".")[0] == "megatron_gspo"}


def graph() -> nx.DiGraph:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        g.add_edges_from((name, target) for target in imports(path) if target in modules and target != name)
    return g


def floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(FLOORS) if top in names)


def test_every_package_has_a_floor():
    tops = {module_name(p).split(".")[1] for p in PACKAGE.rglob("*.py") if module_name(p) != "megatron_gspo"}
    assert tops <= set().union(*FLOORS), tops - set().union(*FLOORS)


def test_no_module_imports_from_a_floor_above_its_own():
    upward = [f"{a} -> {b}" for a, b in graph().edges if a != "megatron_gspo" and floor(b) > floor(a)]
    assert upward == [], "\n".join(upward)


def test_no_import_cycles():
    g = graph()
    # a package's __init__ importing its own modules is how a package exports, not a cycle
    g.remove_edges_from([(a, b) for a, b in g.edges if b.startswith(a + ".")])
    cycles = list(nx.simple_cycles(g))
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_is_at_most_600_lines():
    long = {
        module_name(p): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > LARGEST_MODULE_LINES
    }
    assert long == {}, long


def test_files_are_hashed_by_one_helper():
    """`megatron_gspo.checksums.file_checksum` alone reads files to hash them (checkpoints and exports)."""
    readers = sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "file_digest(" in p.read_text()
    )
    assert readers == ["checksums.py"]
