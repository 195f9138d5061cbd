"""Install the PyTorch/XLA releases the tests run (CPU) with one copy of CUDA's libraries.

PyPI's torch for Linux links CUDA's libraries, which its loader opens even on a
CPU (about 4.3 GB a release). The tests never call them, so every release's
virtualenv shares one copy, that of the newest release (CUDA's libraries of one
major version load under a build of an older minor version):

    python3 scripts/torch_xla_venv.py cuda .venv/torch-cuda-libs 2.9
    python3 scripts/torch_xla_venv.py venv .venv/torch-xla-2.7 2.7 .venv/torch-cuda-libs

`cuda` installs the CUDA packages torch==RELEASE requires into DIR; `venv` makes
a virtualenv with torch and torch-xla of RELEASE and what they require but CUDA's
packages and triton (the GPU kernel compiler), links DIR's libraries where torch
looks for them, and checks that both import. No pip cache is kept.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PIP = ["-m", "pip", "install", "-q", "--no-cache-dir"]


def requirements(python: str, specs: list[str]) -> list[str]:
    """What `specs` require (their metadata only, nothing is installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([python, *PIP, "--dry-run", "--no-deps", "--ignore-installed",
                        "--report", str(report), *specs], check=True)
        items = json.loads(report.read_text())["install"]
    return [r for item in items for r in item["metadata"].get("requires_dist") or []
            if "extra ==" not in r]


def name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def is_cuda(requirement: str) -> bool:
    return name(requirement).startswith("nvidia-")


def cuda(target: Path, release: str) -> None:
    wanted = [r for r in requirements(sys.executable, [f"torch=={release}.0"]) if is_cuda(r)]
    subprocess.run([sys.executable, *PIP, "--root-user-action=ignore", "--target", str(target),
                    *wanted], check=True)
    (target / ".installed").write_text(f"torch {release}.0\n")


def venv(path: Path, release: str, libs: Path) -> None:
    python = str(path / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    specs = [f"torch=={release}.0", f"torch-xla=={release}.0"]
    subprocess.run([python, *PIP, "--no-deps", *specs], check=True)
    rest = sorted({r for r in requirements(python, specs)
                   if not is_cuda(r) and name(r) != "triton"})
    subprocess.run([python, *PIP, "--no-warn-conflicts", *rest], check=True)
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    # torch's loader looks in site-packages/nvidia/<library>/lib, and older
    # releases for cuSPARSELt in site-packages/cusparselt/lib.
    for link, to in (("nvidia", libs / "nvidia"), ("cusparselt", libs / "nvidia" / "cusparselt")):
        if to.is_dir():
            os.symlink(os.path.relpath(to.resolve(), site), site / link)
    subprocess.run([python, "-c", "import torch, torch_xla"], check=True,
                   env={**os.environ, "PJRT_DEVICE": "CPU"})


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "cuda":
        cuda(Path(argv[1]), argv[2])
    elif len(argv) == 4 and argv[0] == "venv":
        venv(Path(argv[1]), argv[2], Path(argv[3]))
    else:
        print("usage:\n" + (__doc__ or "").split("\n\n")[2], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
