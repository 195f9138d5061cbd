"""`make demo`: `compilecast up`, then JAX processes that start the same
training step at the same moment, twice; prints what compiled, what was
shared, and the metrics.

    python -m compilecast.demo [--processes 4] [--layers 160] [--width 512]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from compilecast.launch import SHARE_ANY_COMPILE, Up, collect, start_wave


def describe(r: dict) -> str:
    cc = r["compilecast"]
    if cc.get("published"):
        role = "compiled and published"
    elif cc.get("hits") and cc.get("waits"):
        role = "waited, loaded the shared executable"
    elif cc.get("hits"):
        role = "hit the cache"
    else:
        role = "compiled locally"
    return f"{role:40s} {r['seconds']:6.2f}s  XLA compiles: {r['xla_compiles']}"


def scrape(port: int, prefix: str) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [line for line in text.splitlines()
            if line.startswith(prefix) and "_bucket" not in line
            and "_created" not in line and not line.endswith(" 0.0")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--home", help="data directory for `compilecast up` (default: a temp dir)")
    args = ap.parse_args(argv)

    home = Path(args.home or tempfile.mkdtemp(prefix="compilecast-demo-"))
    home.mkdir(parents=True, exist_ok=True)
    print(f"$ compilecast up --home {home}")
    up = Up(home)
    ports, target = up.ports, up.target
    try:
        up.start()
        step = f"{args.layers}-layer width-{args.width} training step"
        print(f"\n[baseline] one JAX process without compilecast runs the {step}")
        (ref,) = collect(start_wave(1, target, args.layers, args.width, baseline=True))
        print(f"  compile + first step: {ref['seconds']:.2f}s")

        for wave in (1, 2):
            print(f"\n[wave {wave}] {args.processes} JAX processes start the {step} at once")
            reports = collect(start_wave(args.processes, target, args.layers, args.width,
                                         env=SHARE_ANY_COMPILE))
            for i, r in enumerate(reports):
                same = "identical" if r["digest"] == ref["digest"] else "DIFFERENT"
                print(f"  process {i}: {describe(r)}  result {same}")
            compiles = sum(r["xla_compiles"] for r in reports)
            shared = sum(r["compilecast"].get("hits", 0) for r in reports)
            print(f"  => {compiles} XLA compile(s), {shared} process(es) loaded a shared "
                  f"executable, results {'all identical' if all(r['digest'] == ref['digest'] for r in reports) else 'DIFFER'}")

        print("\n[status] compilecast status")
        subprocess.run([sys.executable, "-m", "compilecast.cli", "status", "--worker", target],
                       check=False)
        print("\n[metrics] coordinator")
        for line in scrape(ports["coordinator-metrics-port"], "compilecast_coordinator_"):
            print("  " + line)
        print("[metrics] worker")
        for line in scrape(ports["worker-metrics-port"], "compilecast_worker_"):
            print("  " + line)
        print("\nOn CPU, loading an executable costs nearly as much as compiling it; the "
              "demo proves the protocol. On TPU/GPU a hit saves the whole compile.")
    finally:
        if up.proc is not None:
            up.stop()
        print("compilecast up stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
