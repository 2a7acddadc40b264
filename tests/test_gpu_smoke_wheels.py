"""launch/gpu_smoke_wheels.sh without a network: its arguments, the requirements it would download
and whether they cover every third-party import the GPU smoke suite can reach.

The script fetches pyproject.toml's core dependencies and `test` extra (megatron-core with
--no-deps) for a GPU machine that has only torch. An import of another package anywhere in the
project must be lazy and belong to an extra the smoke suite never needs (`NOT_IN_SMOKE`), or the
offline install would miss it on the GPU machine.
"""

import ast
import functools
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from megatron_gspo import optional

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "gpu_smoke_wheels.sh"
# What the smoke suite may import without the wheels: the GPU machine's own packages, or code
# paths it does not take.
NOT_IN_SMOKE = {
    "torch": "the GPU machine's CUDA build",
    "transformer_engine": "optional on the GPU machine (the TE tier skips without it)",
    "transformer_engine_torch": "optional on the GPU machine (the TE tier skips without it)",
    "tensorboard": "extra; the smoke's training run sets logging.tensorboard=false",
    "math_verify": "extra; the smoke trains the addition task",
    "datasets": "extra; the smoke's data are generated, not Parquet / save_to_disk",
    "matplotlib": "extra; figures of the analysis tools",
    "wandb": "extra; logging.wandb is off by default",
    "sglang_router": "extra; the smoke uses the embedded server",
}
SCANNED = [REPO / "megatron_gspo", REPO / "patches", REPO / "tests" / "gpu", REPO / "tests" / "conftest.py"]


def run(*args):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


@functools.cache
def listed() -> tuple[list[Requirement], list[Requirement]]:
    """(--no-deps requirements, requirements downloaded with their dependencies) from --list."""
    done = run("--list")
    assert done.returncode == 0, done.stderr
    nodeps, deps = [], []
    for line in done.stdout.splitlines():
        text, no_deps = re.subn(r"\s+\(--no-deps\)$", "", line)
        (nodeps if no_deps else deps).append(Requirement(text))
    return nodeps, deps


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names: set[str]) -> set[str]:
    """`names` and every installed distribution they require (markers for this Python, no extras)."""
    seen, todo = set(), list(names)
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


@functools.cache
def third_party_imports(top_level_only: bool = False) -> dict[str, set[str]]:
    """Top-level import name -> files importing it; `torch.utils.tensorboard` counts as tensorboard."""
    found: dict[str, set[str]] = {}
    local = {"megatron_gspo", "gpu_checks", "warm_python"}  # warm_python: tests/, standard library only

    def visit(node, path):
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            for name in names:
                top = "tensorboard" if name.startswith("torch.utils.tensorboard") else name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
            visit(child, path)

    for root in SCANNED:
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            visit(ast.parse(path.read_text()), path)
    return found


def test_arguments_and_help():
    assert run("a", "b").returncode == 2
    bad = run("--nope")
    assert bad.returncode == 2 and "unknown option --nope" in bad.stderr
    shown = run("--help")
    assert shown.returncode == 0 and 'pip install --no-index --find-links wheels -e ".[test]"' in shown.stdout


def test_list_is_megatron_core_for_312_without_deps_and_no_torch():
    nodeps, deps = listed()
    assert [norm(r.name) for r in nodeps] == ["megatron-core"]
    assert nodeps[0].specifier.contains("0.19.2") and not nodeps[0].specifier.contains("0.20.0")
    names = {norm(r.name) for r in deps}
    assert "torch" not in names and "megatron-core" not in names
    assert {"setuptools", "wheel", "pytest", "pytest-timeout", "transformers", "aiohttp"} <= names
    # megatron-core comes without its dependencies: the list names them (except torch).
    mcore = [Requirement(r) for r in md.distribution("megatron-core").requires or []]
    needed = {norm(r.name) for r in mcore if r.marker is None} - {"torch"}
    assert needed <= names, needed - names


def test_list_covers_every_import_the_smoke_suite_can_reach():
    nodeps, deps = listed()
    have = closure({r.name for r in deps}) | {norm(r.name) for r in nodeps}
    providers = md.packages_distributions()
    missing = {}
    for module, files in third_party_imports().items():
        if module in NOT_IN_SMOKE:
            continue
        dists = {norm(d) for d in providers.get(module, [])}
        if not dists & have:
            missing[module] = (sorted(dists) or "not installed here", sorted(files)[:3])
    assert not missing, f"imported, not among the smoke wheels (add to pyproject or NOT_IN_SMOKE): {missing}"
    source = (REPO / "tests" / "gpu" / "gpu_checks.py").read_text()
    assert '"logging.tensorboard=false"' in source  # the smoke's run needs no tensorboard


def test_extras_are_imported_lazily_and_not_core_dependencies():
    top_level = third_party_imports(top_level_only=True)
    eager = {m: sorted(top_level[m]) for m in optional.EXTRAS if m in top_level}
    assert not eager, f"imported at module level, so the core install would not import: {eager}"
    _, deps = listed()
    names = {norm(r.name) for r in deps}
    extras = {norm(dist) for dist, _ in optional.EXTRAS.values()}
    assert not extras & names
