"""pyproject.toml against the Comfy Registry's documented rules (docs.comfy.org/registry/specifications) and the
way ComfyUI's own parser (comfy_config) reads it: a publish that the registry would refuse, or metadata it would
silently drop (a classifier list it voids, an icon that is not there), fails here rather than at release time.
"""

from __future__ import annotations

import re
import struct
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
COMFY = PYPROJECT["tool"]["comfy"]

# The registry keeps the "Operating System :: " classifiers whose value starts with one of these, and the
# "Environment :: " ones that are exactly one of these accelerators; one value outside either set empties that
# whole list (ComfyUI's comfy_config/config_parser.py, the registry's published parser).
REGISTRY_OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
REGISTRY_ACCELERATORS = {
    "GPU :: NVIDIA CUDA",
    "GPU :: AMD ROCm",
    "GPU :: Intel Arc",
    "NPU :: Huawei Ascend",
    "GPU :: Apple Metal",
}
ICON_TYPES = (".svg", ".png", ".jpg", ".jpeg", ".gif")
ICON_MAX_SIZE = (800, 400)  # the documented maximum resolution, width x height


def test_version_is_static_semver():
    assert "version" not in PROJECT.get("dynamic", []), "the registry tooling reads an empty dynamic version"
    assert re.fullmatch(r"\d+\.\d+\.\d+", PROJECT["version"]), PROJECT["version"]


def test_the_package_reads_its_version_from_pyproject(pack):
    # one version source: the pack as ComfyUI imports it (no installed distribution) reports pyproject's version
    assert pack.__version__ == PROJECT["version"]


def test_the_version_scan_reads_only_the_project_table(tmp_path):
    from fewstep import project_version

    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[build-system]\nversion = "9.9.9"\n\n[project]\nname = "x"\n# version = "8.8.8"\n'
        'version = "1.2.3"\n\n[tool.x]\nversion = "7.7.7"\n'
    )
    assert project_version(pyproject) == "1.2.3"
    pyproject.write_text('[project]\nname = "x"\n[tool.x]\nversion = "7.7.7"\n')
    assert project_version(pyproject) is None


def test_name_follows_the_registry_rules():
    name = PROJECT["name"]
    assert len(name) < 100
    # letters and digits, single hyphens / underscores / periods between them, starting with a letter
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(?:[-_.][A-Za-z0-9]+)*", name), name
    assert "comfyui" not in name.lower(), "the registry advises against 'ComfyUI' in a node id"


def test_required_fields_are_set():
    assert PROJECT["description"].strip()
    assert COMFY["PublisherId"].strip()
    assert COMFY["DisplayName"].strip()
    assert PROJECT["urls"]["Repository"].startswith("https://github.com/")
    assert PROJECT["requires-python"]
    # the registry's parser takes a string as the license text; PEP 639 wants an SPDX expression there
    assert PROJECT["license"] == "Apache-2.0"
    assert (ROOT / PROJECT["license-files"][0]).is_file()


def test_icon_is_a_file_of_this_repository_within_the_documented_limits():
    repository = PROJECT["urls"]["Repository"].removeprefix("https://github.com/")
    prefix = f"https://raw.githubusercontent.com/{repository}/main/"
    icon_url = COMFY["Icon"]
    assert icon_url.startswith(prefix), f"{icon_url} is not served from {prefix}"
    icon = ROOT / icon_url.removeprefix(prefix)
    assert icon.is_file(), f"{icon} is missing from the repository"
    assert icon.suffix.lower() in ICON_TYPES
    data = icon.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk, first after the signature
    assert width == height, "an icon is shown square"
    assert width <= ICON_MAX_SIZE[0] and height <= ICON_MAX_SIZE[1]


def test_classifiers_survive_the_registry_parser():
    classifiers = PROJECT["classifiers"]
    systems = [
        c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")
    ]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert systems and all(s.startswith(REGISTRY_OS_PREFIXES) for s in systems), systems
    assert accelerators and set(accelerators) <= REGISTRY_ACCELERATORS, accelerators
    # setuptools >= 77 refuses a license classifier beside a license expression
    assert not [c for c in classifiers if c.startswith("License ::")]


def test_requires_comfyui_is_a_version_range_from_the_oldest_tested():
    assert SpecifierSet(COMFY["requires-comfyui"]).contains("0.3.64")
    assert not SpecifierSet(COMFY["requires-comfyui"]).contains("0.3.63")


def test_requirements_txt_matches_the_runtime_dependencies():
    """ComfyUI-Manager and git-clone installs read requirements.txt, pip reads pyproject: the same runtime
    dependencies but torch (the ComfyUI host brings its own build)."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    requirements = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert requirements == {d for d in PROJECT["dependencies"] if not d.startswith("torch")}
