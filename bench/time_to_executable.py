"""Time to executable on N processes: compilecast (cold) against every
process compiling on its own, side by side in one run.

    python bench/time_to_executable.py [--n 4 16] [--layers 160] [--width 512]

For each N it starts N JAX processes that begin the same training step at the
same moment and reports XLA compiles per program and the wall time from the
common start until the last process holds its executable (its first step
done). Then the same for a real 4-process jax.distributed job.
On CPU, loading a serialized executable costs nearly as much as compiling it,
so these runs show the protocol's overhead and compile counts, not TPU savings.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compilecast.worker.client import wait_until_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_up(home: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "compilecast.cli", "up", "--home", str(home)]
    for flag in ("--etcd-port", "--etcd-peer-port", "--coordinator-port",
                 "--coordinator-metrics-port", "--worker-metrics-port"):
        cmd += [flag, str(free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = f"unix://{home / 'worker.sock'}"
    wait_until_healthy(target, 60)
    return proc, target


def wave(n: int, target: str, layers: int, width: int, *, baseline: bool,
         distributed: bool = False) -> dict:
    env = dict(os.environ, COMPILECAST_WORKER=target, JAX_PLATFORMS="cpu")
    env.pop("COMPILECAST_ENABLE", None)
    start_at = time.time() + 8.0
    cmd = [sys.executable, "-m", "compilecast.demo_proc", str(layers), str(width),
           "--start-at", str(start_at)]
    if baseline:
        cmd.append("--no-compilecast")
    addr = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(n):
        extra = ["--distributed", f"{addr},{n},{i}"] if distributed else []
        procs.append(subprocess.Popen(cmd + extra, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a JAX process failed (rc {p.returncode})")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    # Each process measured from the common start moment to its executable.
    return {
        "n": n,
        "mode": "baseline" if baseline else "compilecast",
        "xla_compiles": sum(r["xla_compiles"] for r in reports),
        "wall_s": max(r["seconds"] for r in reports),
        "median_s": sorted(r["seconds"] for r in reports)[n // 2],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--distributed", type=int, default=4)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="cc-bench-"))
    up, target = start_up(home)
    results = []
    try:
        (one,) = [wave(1, target, args.layers, args.width, baseline=True)]
        print(f"one compile alone: {one['wall_s']:.2f}s", flush=True)
        results.append(one)
        for i, n in enumerate(args.n):
            layers = args.layers + i + 1  # a fresh program per N: cold cache
            base = wave(n, target, layers, args.width, baseline=True)
            cc = wave(n, target, layers, args.width, baseline=False)
            results += [base, cc]
            print(f"N={n:3d}  baseline: {base['xla_compiles']} compiles, all ready "
                  f"{base['wall_s']:.2f}s | compilecast: {cc['xla_compiles']} compile(s), all "
                  f"ready {cc['wall_s']:.2f}s | ratio {cc['wall_s'] / base['wall_s']:.2f} | "
                  f"vs one compile alone {cc['wall_s'] / one['wall_s']:.2f}x", flush=True)
        if args.distributed:
            n, layers = args.distributed, args.layers + 50
            base = wave(n, target, layers, args.width, baseline=True, distributed=True)
            cc = wave(n, target, layers, args.width, baseline=False, distributed=True)
            results += [dict(base, mode="baseline-distributed"),
                        dict(cc, mode="compilecast-distributed")]
            print(f"jax.distributed N={n}: baseline {base['xla_compiles']} compiles "
                  f"{base['wall_s']:.2f}s | compilecast {cc['xla_compiles']} compile(s) "
                  f"{cc['wall_s']:.2f}s | ratio {cc['wall_s'] / base['wall_s']:.2f}", flush=True)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(30)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
