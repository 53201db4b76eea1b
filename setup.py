"""Package discovery for the wheel (everything else is in pyproject.toml).

The repository root *is* the package ``fewstep`` (ComfyUI loads the same folder as a custom node, under whatever
name the folder has), so ``[tool.setuptools.packages.find]`` cannot name its packages: it would find ``engine``,
not ``fewstep.engine``. ``find_packages`` walks the shipped folders here instead, so a new folder (a sub-package
with its ``__init__.py``) is in the wheel without anyone listing it; tests/test_packaging.py builds the wheel,
installs it into a fresh virtual environment and checks that every ``.py`` file of those folders is in it.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# The folders that make up the package; tests/, bench/ and workflows/ are the checkout's tools, not the package.
SHIPPED = ("cli", "engine", "kernels", "nodes")


class BuildPy(build_py):
    """The root's own modules are the package's (``__init__``, ``__main__``), but not this file: installed as
    ``fewstep.setup``, importing it would run a build."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "fewstep" and m[1] == "setup")]


setup(
    package_dir={"fewstep": "."},
    packages=[
        "fewstep",
        *(f"fewstep.{name}" for name in find_packages(".", include=[f"{s}*" for s in SHIPPED])),
    ],
    cmdclass={"build_py": BuildPy},
)
