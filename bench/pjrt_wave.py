"""N interposed JAX processes on one worker: a training step on XLA's CPU
PJRT plugin through the interposer (tests/pjrt_proc.py, no compilecast
import), all started together against one etcd, coordinator and worker.

Printed:
- the programs (what one plain process compiles) and how many times XLA
  really compiled in the whole wave (XLA's own dump, a folder per process:
  one `*.cpu_after_optimizations.txt` per compile),
- the compiles without sharing (`LOCAL` answers, of which those for the
  gate's connection limit or memory budget),
- `compilecast status` against the worker during the wave: how many times it
  was asked, its slowest answer,
- the wave's wall time, and whether every process's loss equalled the
  plain plugin's.

    python bench/pjrt_wave.py --n 64
    python bench/pjrt_wave.py --n 2 --plugin cuda     (a GPU machine: jax-cuda*-pjrt)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _servers import Stack

from compilecast.cli.run import interposer_path
from compilecast.worker.inprocess.client import CacheClient

PROC = Path(__file__).resolve().parent.parent / "tests" / "pjrt_proc.py"


def cpu_plugin() -> str:
    import lammps_jax_pjrt_cpu

    return str(Path(lammps_jax_pjrt_cpu.__file__).with_name("pjrt_c_api_cpu_plugin.so"))


def cuda_plugin() -> str:
    """JAX's CUDA PJRT plugin (jax-cuda*-pjrt) of this interpreter."""
    import glob
    import importlib

    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            found = glob.glob(os.path.join(
                os.path.dirname(importlib.import_module(name).__file__ or ""), "*.so"))
        except ImportError:
            continue
        if found:
            return found[0]
    raise SystemExit("no jax-cuda*-pjrt plugin in this interpreter")


PLUGIN = [""]  # the real plugin the wave runs on (--plugin)


def real_plugin() -> str:
    return PLUGIN[0]


def env(worker: str | None, dump: Path) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILECAST_", "JAX_"))}
    e.update(PJRT_PLUGIN_PATH=interposer_path() if worker else real_plugin(),
             COMPILECAST_PJRT_PLUGIN=real_plugin(), COMPILECAST_PJRT_LOG="1",
             XLA_FLAGS=f"--xla_dump_to={dump}")
    if worker:
        e["COMPILECAST_WORKER"] = worker
    return e


def wave(n: int, environment: dict, tmp: Path) -> tuple[list[dict], list[str], float]:
    go = tmp / "go"
    dump = environment["XLA_FLAGS"].partition("=")[2]
    procs = [subprocess.Popen([sys.executable, str(PROC), "--ready", str(tmp / f"ready{i}"),
                               "--go", str(go)],
                              env={**environment, "XLA_FLAGS": f"--xla_dump_to={dump}/{i}"},
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(n)]
    while not all((tmp / f"ready{i}").exists() or p.poll() is not None
                  for i, p in enumerate(procs)):
        time.sleep(0.1)
    began = time.monotonic()
    go.touch()
    results, errs = [], []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        results.append(json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 else {})
        errs.append(err)
    return results, errs, time.monotonic() - began


def compiles(dump: Path) -> collections.Counter:
    """Real compiles per program, from XLA's dump (a folder per process):
    one `*_after_optimizations.txt` per compiled program (cpu_, gpu_...)."""
    names: collections.Counter = collections.Counter()
    for f in dump.glob("*/*_after_optimizations.txt"):
        m = re.match(r"module_\d+\.(.+?)\.", f.name)
        names[m.group(1) if m else f.name] += 1
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--plugin", default="cpu",
                    help="cpu (XLA's CPU plugin from PyPI), cuda (jax-cuda*-pjrt), or a path")
    args = ap.parse_args()
    PLUGIN[0] = {"cpu": cpu_plugin, "cuda": cuda_plugin}.get(args.plugin, lambda: args.plugin)()
    root = Path(tempfile.mkdtemp(prefix="cc-pjrt-wave-"))
    stack = Stack(root)
    try:
        coordinator, _ = stack.coordinator()
        worker, _ = stack.worker(coordinator, "w")
        plain_dump = root / "plain-dump"
        (root / "plain").mkdir()
        [plain], _, _ = wave(1, env(None, plain_dump), root / "plain")
        dump = root / "dump"
        (root / "wave").mkdir()
        asked, slowest, stop = [0], [0.0], threading.Event()

        def status_loop() -> None:
            client = CacheClient(worker, timeout_s=30)
            while not stop.is_set():
                t = time.monotonic()
                client.status()
                slowest[0] = max(slowest[0], time.monotonic() - t)
                asked[0] += 1
                stop.wait(0.5)

        poller = threading.Thread(target=status_loop, daemon=True)
        poller.start()
        results, errs, wall = wave(args.n, env(worker, dump), root / "wave")
        stop.set()
        poller.join()
        # The same status calls while the same processes run on the plain plugin
        # (the worker idle): what the machine's load alone costs an answer.
        plain_asked, plain_slowest = asked[0], slowest[0]
        asked[0], slowest[0] = 0, 0.0
        stop.clear()
        poller = threading.Thread(target=status_loop, daemon=True)
        poller.start()
        (root / "plain-wave").mkdir()
        wave(args.n, env(None, root / "plain-wave-dump"), root / "plain-wave")
        stop.set()
        poller.join()
        asked[0], slowest[0], idle_asked, idle_slowest = (plain_asked, plain_slowest,
                                                          asked[0], slowest[0])
        per_program = compiles(dump)
        local = [line for e in errs for line in re.findall(r"real compile \((LOCAL [^)]*)\)", e)]
        programs = sum(compiles(plain_dump).values())  # one plain process compiles each once
        print(f"pjrt_wave n={args.n}: {programs} programs; XLA compiled "
              f"{sum(per_program.values())} times in the whole wave")
        print(f"  compiled without sharing: {len(local)}"
              f" (connection limit or budget: "
              f"{sum('limit' in x or 'budget' in x for x in local)})")
        print(f"  compilecast status during the wave: asked {asked[0]} times, slowest "
              f"{slowest[0]:.3f}s (the same processes on the plain plugin, worker idle: "
              f"asked {idle_asked} times, slowest {idle_slowest:.3f}s)")
        print(f"  wave {wall:.1f}s; processes ok {sum(bool(r) for r in results)}/{args.n}; "
              f"losses equal to the plain plugin's: "
              f"{all(r.get('loss') == plain['loss'] for r in results)}")
    finally:
        stack.close()


if __name__ == "__main__":
    main()
