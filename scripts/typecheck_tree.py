"""Lay out the package as it installs, for mypy: build/typecheck/compilecast
holds a link to every module under its import name (compilecast.worker.keylib.keys
is worker/keylib/keys.py), as pyproject.toml's [tool.setuptools.package-dir] maps
the top-level folders. mypy reads the tree through mypy_path; its messages
name the links, whose paths are the import names.

    python scripts/typecheck_tree.py [ROOT]      (default: build/typecheck)
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def folder_of(package: str, mapping: dict[str, str]) -> str:
    """The folder `package` lives in: its own entry in package-dir, or its
    nearest mapped parent's folder and the rest of its name."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        if (head := ".".join(parts[:i])) in mapping:
            return "/".join([mapping[head], *parts[i:]])
    return "/".join(parts)


def build(root: Path) -> int:
    """(Re)make the tree under `root`; how many modules it links."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    shutil.rmtree(root, ignore_errors=True)
    linked = 0
    for package in setuptools["packages"]:
        folder = folder_of(package, mapping)
        target = root.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted((REPO / folder).iterdir()):
            if source.is_file() and source.suffix in (".py", ".pyi"):
                (target / source.name).symlink_to(source)
                linked += source.suffix == ".py"
    return linked


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "build" / "typecheck"
    print(f"{build(root)} modules linked under {root}")


if __name__ == "__main__":
    main()
