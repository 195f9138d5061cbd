"""Lay out the package as it installs, for mypy: build/typecheck/compilecast
holds a link to every module under its import name (compilecast.worker.keys
is worker/keys.py), as pyproject.toml's [tool.setuptools.package-dir] maps
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


def build(root: Path) -> int:
    """(Re)make the tree under `root`; how many modules it links."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    shutil.rmtree(root, ignore_errors=True)
    linked = 0
    for package, folder in mapping.items():
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
