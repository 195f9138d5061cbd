"""XLA's GPU autotune results shared across hosts: a changed program's compile
on a second host, with and without the first host's results.

    python bench/autotune_share.py [--layers 24] [--width 2048] [--pairs 2]

Two "hosts" (a worker each, each with its own synced directory) on one GPU,
one coordinator. Host A compiles a bf16 training step of --layers layers
through compilecast; its worker publishes the autotune results XLA wrote.
Then, in fresh processes, a *changed* step (one more layer) misses
compilecast's program cache and is compiled:
  shared   on host B, whose directory gets A's results installed first
  alone    on host C of another fleet (its own coordinator: an empty
           directory, the same code path)
alternating, --pairs times. Printed: each compile time, the entries A
published and B had before compiling. On a machine without a GPU the
program compiles, but XLA writes no autotune results: it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import Stack

STEP = r"""
import json, os, sys, time
import jax, jax.numpy as jnp
import compilecast.jax
layers, width = int(sys.argv[1]), int(sys.argv[2])
assert compilecast.jax.enable(os.environ["COMPILECAST_WORKER"]) is not None
def step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jax.nn.gelu(h @ w)
        return (h.astype(jnp.float32) ** 2).mean()
    g = jax.grad(loss)(ws)
    return [w - 1e-3 * d for w, d in zip(ws, g)]
key = jax.random.PRNGKey(0)
ws = [jax.random.normal(key, (width, width), jnp.bfloat16) * 0.02 for _ in range(layers)]
x = jax.random.normal(key, (256, width), jnp.bfloat16)
lowered = jax.jit(step).lower(ws, x)
t = time.perf_counter()
lowered.compile()
print(json.dumps({"compile_s": time.perf_counter() - t,
                  "platform": jax.devices()[0].platform}))
"""


def compile_once(worker: str, layers: int, width: int) -> dict:
    env = {**os.environ, "COMPILECAST_WORKER": worker,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    done = subprocess.run([sys.executable, "-c", STEP, str(layers), str(width)], env=env,
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def directory(worker: str) -> dict:
    from compilecast.worker.inprocess.client import CacheClient

    client = CacheClient(worker)
    out = {}
    for d in client.status().directories:
        got = client.sync_directory(d.kind, d.namespace_id).directory
        out = {"entries": got.entries, "published": got.published,
               "installed": got.installed, "namespace": got.namespace}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cc-autotune-"))
    stack = Stack(root)
    try:
        coordinator, _ = stack.coordinator()
        elsewhere, _ = stack.coordinator("other-fleet")
        quiet = ("--dir-sync-s", "3600", "--dir-settle-s", "0")
        a, _ = stack.worker(coordinator, "a", quiet)
        first = compile_once(a, args.layers, args.width)
        published = directory(a)
        print(f"host A: {args.layers} layers compiled in {first['compile_s']:.2f} s on "
              f"{first['platform']}; its directory: {published}")
        if not published.get("entries"):
            print("XLA wrote no autotune results (no GPU, or its cache is off): "
                  "nothing to share")
        results: dict[str, list[float]] = {"shared": [], "alone": []}
        for i in range(args.pairs):
            for mode in (("shared", "alone") if i % 2 == 0 else ("alone", "shared")):
                fleet = coordinator if mode == "shared" else elsewhere
                w, _ = stack.worker(fleet, f"{mode}{i}", quiet)
                got = compile_once(w, args.layers + 1, args.width)
                results[mode].append(got["compile_s"])
                print(f"{mode:6} pair {i}: {got['compile_s']:.2f} s; directory "
                      f"{directory(w)}")
        for mode, times in results.items():
            print(f"{mode:6} median {statistics.median(times):.2f} s over {len(times)}")
    finally:
        stack.close()


if __name__ == "__main__":
    main()
