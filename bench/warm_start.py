"""Warm start: first-call time of a training step that is already cached.

    python bench/warm_start.py [--layers 160] [--width 512] [--repeat 3]

Side by side, one process at a time, best of --repeat:
  jax-lru         JAX's own persistent cache (a local directory) hit
  cc-host         compilecast, hit in the worker's host cache
  cc-coordinator  compilecast, host cache empty: fetched from the coordinator
The first call includes tracing, lowering, the cache lookup and loading the
executable; on CPU loading dominates all three.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from compilecast.launch import SHARE_ANY_COMPILE, Up, collect, start_wave


def first_call(target: str, layers: int, width: int, *, env: dict | None = None,
               baseline: bool = False) -> dict:
    (r,) = collect(start_wave(1, target, layers, width, baseline=baseline, env=env,
                              delay_s=2.0))
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cc-warm-"))
    jax_cache = root / "jax-cache"
    cc_env = SHARE_ANY_COMPILE  # both caches keep the step whatever its compile time
    jax_env = {"JAX_COMPILATION_CACHE_DIR": str(jax_cache), **cc_env}
    home = root / "up"
    home.mkdir()
    up = Up(home)
    up.start()
    try:
        # Fill both caches once.
        first_call(up.target, args.layers, args.width, env=jax_env, baseline=True)
        first_call(up.target, args.layers, args.width, env=cc_env)
        times: dict[str, list[float]] = {"jax-lru": [], "cc-host": [], "cc-coordinator": []}
        def jax_lru() -> None:
            r = first_call(up.target, args.layers, args.width, env=jax_env, baseline=True)
            times["jax-lru"].append(r["seconds"])

        def cc(mode: str) -> None:
            if mode == "cc-coordinator":
                up.stop()
                shutil.rmtree(home / "worker")  # cold host cache: fetch from the coordinator
                up.start()
            r = first_call(up.target, args.layers, args.width, env=cc_env)
            assert r["compilecast"]["hits"] == 1 and r["xla_compiles"] == 0
            times[mode].append(r["seconds"])

        for i in range(args.repeat):
            # Alternate the order, so that no way always runs first or after a restart.
            steps = [jax_lru, lambda: cc("cc-coordinator"), lambda: cc("cc-host")]
            for step in (steps if i % 2 == 0 else steps[::-1]):
                step()
        best = {k: min(v) for k, v in times.items()}
        for k, v in best.items():
            print(f"{k:15s} first call {v:6.3f} s  ({v / best['jax-lru']:.2f}x JAX's local hit)")
        print(json.dumps({"layers": args.layers, "width": args.width, "best_s": best,
                          "all_s": times}))
    finally:
        if up.proc is not None:
            up.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
