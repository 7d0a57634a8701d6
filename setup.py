"""Maps the source folders onto one import root: compiler/ -> kiln.compiler,
runtime/ -> kiln.runtime, cli/ -> kiln.cli, bench/ -> kiln.bench, so installing Kiln never drops bare
``compiler`` / ``runtime`` packages into site-packages. Metadata lives in pyproject.toml."""

from pathlib import Path

from setuptools import setup

ROOTS = {"kiln": "kiln", "compiler": "kiln.compiler", "runtime": "kiln.runtime", "cli": "kiln.cli",
         "bench": "kiln.bench"}

packages, package_dir = [], {}
for folder, root in ROOTS.items():
    for init in sorted(Path(folder).rglob("__init__.py")):
        package = ".".join((root, *init.parent.relative_to(folder).parts))
        packages.append(package)
        package_dir[package] = init.parent.as_posix()

setup(packages=packages, package_dir=package_dir)
