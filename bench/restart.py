"""A restart: time to the first step with JAX's own cache, and with
compilecast's preload (the job's executables loaded while the program starts).

    python bench/restart.py [--layers 160] [--width 512] [--startup-s 4] [--repeat 3]

One process at a time, alternated, each a fresh process of the same job
after a first run filled both caches:
  jax-cache    JAX's own persistent cache (a local directory): trace, lower,
               read and load the executable at the first call
  cc-preload   compilecast with the job named (COMPILECAST_JOB): the job's
               executable is fetched and loaded on a background thread from
               when the devices open, during the program's start-up
  cc-no-preload  compilecast, the preload off (COMPILECAST_PRELOAD=0)
The start-up phase (--startup-s, from the process's start to its first
step) stands for a checkpoint's restore. Reported: time to the first step
(from the process's start), the first call, and that nothing compiled.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from compilecast.launch import SHARE_ANY_COMPILE, Up, collect, start_wave

JOB = "bench-restart"


def run(target: str, layers: int, width: int, startup_s: float, *, env: dict,
        baseline: bool = False) -> dict:
    (r,) = collect(start_wave(1, target, layers, width, baseline=baseline, env=env,
                              delay_s=startup_s))
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--startup-s", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cc-restart-"))
    jax_env = {"JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"), **SHARE_ANY_COMPILE}
    cc_env = {"COMPILECAST_JOB": JOB, **SHARE_ANY_COMPILE}
    home = root / "up"
    home.mkdir()
    up = Up(home)
    up.start()
    ways = {
        "jax-cache": dict(env=jax_env, baseline=True),
        "cc-preload": dict(env=cc_env),
        "cc-no-preload": dict(env=dict(cc_env, COMPILECAST_PRELOAD="0")),
    }
    try:
        reference = None
        for way in ("jax-cache", "cc-preload"):  # fill both caches (and record the job)
            r = run(up.target, args.layers, args.width, args.startup_s, **ways[way])
            reference = reference or r["digest"]
        got: dict[str, list[dict]] = {way: [] for way in ways}
        for i in range(args.repeat):
            order = list(ways) if i % 2 == 0 else list(ways)[::-1]  # alternated
            for way in order:
                r = run(up.target, args.layers, args.width, args.startup_s, **ways[way])
                assert r["digest"] == reference, (way, "another result")
                assert r["xla_compiles"] == 0 or way == "jax-cache", (way, "compiled")
                if way == "cc-preload":
                    assert r["compilecast"]["preloads"]["used"] == 1, r["compilecast"]
                got[way].append(r)
        base = {k: statistics.median(r[k] for r in got["jax-cache"])
                for k in ("to_first_step_s", "seconds")}
        rows = {}
        for way, runs in got.items():
            first_step = statistics.median(r["to_first_step_s"] for r in runs)
            first_call = statistics.median(r["seconds"] for r in runs)
            rows[way] = {"to_first_step_s": first_step, "first_call_s": first_call,
                         "first_step_x": first_step / base["to_first_step_s"],
                         "first_call_x": first_call / base["seconds"],
                         "jax_compiles": sum(r["xla_compiles"] for r in runs)
                         if way != "jax-cache" else None}
            print(f"{way:14s} first step at {first_step:6.2f} s ({rows[way]['first_step_x']:.2f}x)"
                  f"  first call {first_call:6.3f} s ({rows[way]['first_call_x']:.2f}x)")
        print(json.dumps({"layers": args.layers, "width": args.width,
                          "startup_s": args.startup_s, "repeat": args.repeat, "median": rows,
                          "equal_results": True}))
    finally:
        up.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
