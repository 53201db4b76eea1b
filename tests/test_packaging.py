"""The wheel is the package: built from a copy of the checkout, installed into a fresh virtual environment outside
it, every module of ``fewstep`` imports from there and the ``fewstep`` command runs.

An editable install (what CI and developers use) resolves every module from the checkout, so a folder the wheel
leaves out goes unnoticed until a user runs ``pip install .``; this test is the one place that sees the wheel.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what setup.py ships besides the root's own modules (__init__, __main__)
SHIPPED = ("cli", "engine", "kernels", "nodes")
NOT_SOURCE = (
    ".git",
    ".venv",
    "__pycache__",
    "build",
    "dist",
    "*.egg-info",
    "out",
    ".pytest_cache",
    ".ruff_cache",
)

pytestmark = pytest.mark.slow


def source_modules() -> set[str]:
    """Every .py file of the package in the checkout, as its path inside the wheel."""
    files = {f"fewstep/{p.name}" for p in ROOT.glob("*.py") if p.name != "setup.py"}
    for folder in SHIPPED:
        files |= {f"fewstep/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts}  # fmt: skip
    return files


def run(*cmd, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)})  # fmt: skip
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel path, python of a fresh venv with the wheel installed, its folder)."""
    # built without network (no build isolation), so with this environment's setuptools; pyproject.toml needs 77
    major = int(importlib.metadata.version("setuptools").split(".")[0])
    if major < 77:
        pytest.skip(
            f"setuptools {major} here; building the wheel offline needs setuptools >= 77 (pyproject.toml)"
        )
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
        str(src), cwd=tmp)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("*.whl")
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", str(venv), cwd=tmp)
    python = venv / "bin" / "python"
    run(str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel), cwd=tmp)
    # the dependencies (torch...) come from this interpreter's environment, as plain path entries: its .pth files
    # (among them the editable install of the checkout) are not processed, so `fewstep` can only be the wheel's
    purelib = run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp)
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib.stdout.strip()) / "outer_dependencies.pth").write_text("\n".join(sorted(paths)) + "\n")
    return wheel, python, tmp


def test_wheel_holds_every_module(installed):
    wheel, _, _ = installed
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    assert in_wheel == source_modules()


IMPORT_ALL = """
import importlib, pathlib, pkgutil, sys
import fewstep
where = pathlib.Path(fewstep.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.prefix).resolve()), where
names = [m.name for m in pkgutil.walk_packages(fewstep.__path__, "fewstep.")]
for name in names:
    if name != "fewstep.__main__":  # runs the CLI; the command below covers it
        importlib.import_module(name)
print(fewstep.__version__, len(names))
"""


def test_every_module_imports_from_the_wheel(installed):
    wheel, python, tmp = installed
    imported = run(str(python), "-c", IMPORT_ALL, cwd=tmp)
    modules = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    version, count = imported.stdout.split()[-2:]
    assert int(count) == len(modules) - 1  # every module but the package's own __init__
    # a wheel ships no pyproject.toml: the version comes from the wheel's metadata, still pyproject's
    assert version == re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_cli_runs_from_the_wheel(installed):
    _, python, tmp = installed
    done = run(str(python.parent / "fewstep"), "plan", "--model", "wan-tiny", "--json", cwd=tmp)
    assert '"model": "wan-tiny"' in done.stdout
