"""The engine's structure, read from its imports: it never reaches up into the layers above it, its packages form
no cycle, and imports sit at the top of their modules (an import inside a function is kept only for an optional
dependency, or a heavy one a run may not need).

Read statically (``ast``): nothing is imported, so a cycle that Python would tolerate is still caught.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"

# Imports allowed inside functions: optional dependencies (absent on many installs) and heavy modules a run may
# never need (importing them at the top would cost every process its start-up time).
OPTIONAL_OR_HEAVY = (
    "flash_attn",
    "triton",
    "cryptography",
    "torch._dynamo",
    "torch.utils.flop_counter",
    "torch.distributed",
    "safetensors",
    "PIL",
    "transformers",
    "ftfy",
)


def modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The modules an import statement names, as dotted names under the repository root (``engine.plan``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not node.level:
        name = node.module or ""
        return [name.removeprefix("fewstep.")] if name.startswith("fewstep.") else [name]
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    target = ".".join(base + ([node.module] if node.module else []))
    if node.module is None:  # `from .. import kernels`: the names are modules
        return [f"{target}.{a.name}" if target else a.name for a in node.names]
    return [target]


def engine_unit(name: str) -> str | None:
    """The engine's top-level unit a module belongs to (``engine.causal.kv_cache`` -> ``engine.causal``)."""
    parts = name.split(".")
    if parts[0] != "engine" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def test_the_engine_imports_nothing_above_it():
    upward = []
    for path in modules(ENGINE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported(path, node):
                    if name.split(".")[0] in (
                        "nodes",
                        "cli",
                        "comfy",
                        "comfy_extras",
                        "folder_paths",
                        "server",
                    ):
                        upward.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert upward == []


def test_the_engine_packages_form_no_cycle():
    edges: dict[str, set[str]] = defaultdict(set)
    for path in modules(ENGINE):
        unit = engine_unit(module_name(path))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported(path, node):
                    target = engine_unit(name)
                    if unit and target and target != unit:
                        edges[unit].add(target)
    cycles = set()

    def visit(unit: str, stack: list[str]):
        for target in sorted(edges[unit]):
            if target in stack:
                cycles.add(" -> ".join([*stack[stack.index(target) :], target]))
            elif len(stack) < 12:
                visit(target, [*stack, target])

    for unit in sorted(edges):
        visit(unit, [unit])
    assert sorted(cycles) == []


def test_imports_inside_functions_are_only_optional_or_heavy_dependencies():
    found = []
    for path in modules(ENGINE):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        names = imported(path, node)
                        if not all(n.startswith(OPTIONAL_OR_HEAVY) for n in names):
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_the_tests_mirror_the_engine_and_pytest_finds_every_folder():
    """Each engine package has its tests in tests/engine/<package>/, and every folder holding tests is on pytest's
    path (pyproject's ``pythonpath``: test modules import shared helpers from each other by name)."""
    import tomllib

    tests = ROOT / "tests"
    packages = {p.parent.name for p in ENGINE.glob("*/__init__.py")}
    assert sorted(p for p in packages if not (tests / "engine" / p).is_dir()) == []
    folders = {str(p.parent.relative_to(ROOT)) for p in tests.rglob("test_*.py") if "e2e" not in p.parts}
    pythonpath = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["pythonpath"]
    )
    assert sorted(folders - pythonpath) == []
