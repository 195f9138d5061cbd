"""Time a multi-process job spends on each shape of program, without
compilecast and with it.

A jax.distributed CPU job (gloo) of --n processes (tests/job_shapes_proc.py)
runs, in order: a global program, per-process programs (a jit and eager ops
on the process's own device), a stage on processes 1..N-1, a program under
JAX's min compile time and one with a host callback. For each shape the
figure is the slowest process's seconds (the job waits for it). Rounds
alternate: the job without compilecast, then with it against a fresh
`compilecast up` (cold: nothing stored), then again (warm: a restart).

Usage: python bench/job_shapes.py [--n 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from compilecast.launch import SHARE_ANY_COMPILE, Up, collect, free_port

PROC = Path(__file__).resolve().parent.parent / "tests" / "job_shapes_proc.py"
SHAPES = ["global", "local", "stage", "small", "callback"]


def job(target: str, n: int, *flags: str) -> dict[str, float]:
    """Seconds of the slowest process, by shape (stage: its members only)."""
    env = dict(os.environ, COMPILECAST_WORKER=target, JAX_PLATFORMS="cpu", **SHARE_ANY_COMPILE)
    env.pop("COMPILECAST_ENABLE", None)
    dist = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(PROC), dist, str(n), str(i), ",".join(SHAPES),
                               *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(n)]
    reports = collect(procs, timeout_s=600)
    return {s: max(r["shapes"][s]["seconds"] for r in reports
                   if s != "stage" or r["process"] > 0) for s in SHAPES}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"without": [], "cold": [], "warm": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            up = Up(Path(tmp) / "home")
            up.start()
            try:
                runs["without"].append(job(up.target, args.n, "--baseline"))
                runs["cold"].append(job(up.target, args.n))
                runs["warm"].append(job(up.target, args.n))
            finally:
                up.stop()
    print(f"job of {args.n} processes, {args.rounds} rounds: median seconds of the slowest "
          "process per shape (stage: processes 1..N-1)")
    print(f"{'shape':10} {'without':>9} {'cold':>9} {'warm':>9} {'cold/without':>13}")
    for s in SHAPES:
        med = {k: statistics.median(r[s] for r in v) for k, v in runs.items()}
        print(f"{s:10} {med['without']:9.3f} {med['cold']:9.3f} {med['warm']:9.3f} "
              f"{med['cold'] / med['without']:13.2f}")


if __name__ == "__main__":
    main()
