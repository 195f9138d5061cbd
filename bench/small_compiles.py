"""What compilecast adds to programs under JAX's caching thresholds.

Every JAX op run outside jit compiles a small program, and a job compiles
many. JAX does not cache them (`jax_persistent_cache_min_compile_time_secs`),
and neither does compilecast, but each still asks the coordinator first and
releases its lease after. A fresh process jits PROGRAMS distinct small
functions without compilecast and then, in another fresh process, with it
(against a coordinator on its own etcd, keys it has never seen: the cold
case), alternating for --pairs.

Usage: python bench/small_compiles.py [--programs 40] [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _servers import Stack

CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp
target, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "compilecast":
    from compilecast.worker.jaxdoor import jax_integration
    jax_integration.enable(target)
x = jnp.ones((8, 8))
x.block_until_ready()
salt = time.time_ns() % 1_000_003  # keys never seen before
functions = [jax.jit(lambda v, k=k: (v * (k + salt) + k).sum()) for k in range(n)]
start = time.perf_counter()
for f in functions:
    f(x).block_until_ready()
wall = time.perf_counter() - start
stats = jax_integration.stats() if mode == "compilecast" else {}
print(json.dumps({"ms_each": wall / n * 1e3, "released": stats.get("released", 0),
                  "published": stats.get("published", 0)}))
"""


def run(target: str, mode: str, n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, target, mode, str(n)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    added = []
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        try:
            target = stack.coordinator()[0]
            for k in range(args.pairs):
                order = ("plain", "compilecast") if k % 2 == 0 else ("compilecast", "plain")
                got = {mode: run(target, mode, args.programs) for mode in order}
                plain, cc = got["plain"], got["compilecast"]
                added.append(cc["ms_each"] - plain["ms_each"])
                print(f"pair {k + 1}: {args.programs} small programs, JAX alone "
                      f"{plain['ms_each']:.1f} ms each, with compilecast {cc['ms_each']:.1f} ms "
                      f"each (+{added[-1]:.1f} ms; {cc['released']} leases released, "
                      f"{cc['published']} published)", flush=True)
        finally:
            stack.close()
    print(f"compilecast adds {statistics.median(added):.1f} ms a small program "
          f"(median of {args.pairs} pairs, range {min(added):.1f}-{max(added):.1f})")


if __name__ == "__main__":
    main()
