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
import shutil
import tempfile
from pathlib import Path

from compilecast.launch import Up, collect, start_wave


def wave(n: int, target: str, layers: int, width: int, *, baseline: bool,
         distributed: bool = False) -> dict:
    # Every process imports JAX before the common start (2 cores: ~1.5 s of import each).
    reports = collect(start_wave(n, target, layers, width, baseline=baseline,
                                 distributed=distributed, delay_s=max(8.0, 1.5 * n)),
                      timeout_s=1800)
    # Each process measured from the common start moment to its executable.
    return {
        "n": n,
        "mode": "baseline" if baseline else "compilecast",
        "xla_compiles": sum(r["xla_compiles"] for r in reports),
        "wall_s": max(r["seconds"] for r in reports),
        "median_s": sorted(r["seconds"] for r in reports)[n // 2],
        "latest_start_s": max(r.get("late_s", 0.0) for r in reports),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--distributed", type=int, default=4)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="cc-bench-")) / "up"
    home.mkdir()
    up = Up(home)
    up.start()
    target = up.target
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
                  f"vs one compile alone {cc['wall_s'] / one['wall_s']:.2f}x | last process "
                  f"late by {max(base['latest_start_s'], cc['latest_start_s']):.1f}s",
                  flush=True)
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
        up.stop()
        shutil.rmtree(home.parent, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
