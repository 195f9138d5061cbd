"""Ahead-of-time farm: time until every process of a simulated 4-host pod
holds every executable of a several-program job.

    python bench/aot_farm.py [--topology v5e:4x4] [--hosts 4] [--layers 16] [--width 1024]

Three ways, side by side, each on a fresh etcd + coordinator:
  every host compiles   each process compiles every program itself
  compile once at start compilecast without the farm: process 0 compiles each
                        program and publishes it, the others wait and fetch
  farm pre-warmed       `compilecast precompile --farm` ran before the job (its
                        time reported separately); the processes only fetch
The processes are a real jax.distributed job (CPU, gloo) whose TPU programs come
from libtpu's compile-only client, so "holds" means the digest-verified bytes
(a compile-only client cannot load an executable).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _servers import Stack, free_port

from compilecast.launch import collect

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
       "TPU_WORKER_HOSTNAMES": "localhost", "PYTHONPATH": str(HERE)}


def pod(mode: str, coordinator: str | list[str], topology: str, n: int, *,
        entry: str = "aot_job:programs", go_after_s: float | None = None,
        cgroups: list[Path] | None = None) -> dict:
    """Run the n processes of a pod; with go_after_s, they start compiling or
    fetching together that many seconds after launch (after their start-up
    and lowering), and `ready` counts from then. With cgroups (CPU quotas, one
    per process), each process joins its own at that moment."""
    dist, t0 = f"127.0.0.1:{free_port()}", time.time()
    extra = [entry] + ([str(t0 + go_after_s)] if go_after_s is not None else [])
    # A list: each process its own worker (a pod's hosts), in turn.
    targets = coordinator if isinstance(coordinator, list) else [coordinator]
    procs = [subprocess.Popen([sys.executable, str(HERE / "_pod_process.py"), mode,
                               targets[i % len(targets)], topology, str(i), str(n), dist,
                               str(t0), *extra],
                              env=dict(ENV, BENCH_HOST_CGROUP=str(cgroups[i])) if cgroups else ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    rows = collect(procs, timeout_s=3600)
    return {"ready": max(r["ready"] for r in rows), "compiles": sum(r["compiles"] for r in rows),
            "lowered": max(r["lowered"] for r in rows), "bytes": rows[0]["bytes"],
            "late": max(r.get("late", 0.0) for r in rows),
            "phases": [r.get("phases", {}) for r in rows]}


@contextlib.contextmanager
def fresh_coordinator(*flags: str, one_host: bool = False,
                      host_workers: int = 0) -> Iterator[str | list[str]]:
    """A coordinator (with these command-line flags) on its own etcd in a
    temporary folder, for one way. With one_host, the target is a worker in
    front of it: the processes are those of one host (a GPU host's 8). With
    host_workers, that many workers in front of it, their targets in a list:
    each process goes through its own, as on a pod's hosts."""
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        try:
            coordinator = stack.coordinator(extra=flags)[0]
            if host_workers:
                yield [stack.worker(coordinator, f"h{i}")[0] for i in range(host_workers)]
            else:
                yield stack.worker(coordinator, "w")[0] if one_host else coordinator
        finally:
            stack.close()


def farm_fill(coordinator: str, topology: str) -> float:
    start = time.monotonic()
    farm = subprocess.Popen([sys.executable, "-m", "compilecast.cli", "--log-level", "warning",
                             "farm", "--coordinator", coordinator], env=ENV)
    try:
        subprocess.run([sys.executable, "-m", "compilecast.cli", "--log-level", "warning",
                        "precompile", "--entry", "aot_job:programs", "--topology", topology,
                        "--farm", "--wait", "--coordinator", coordinator], env=ENV, check=True,
                       stdout=subprocess.DEVNULL)
        return time.monotonic() - start
    finally:
        farm.terminate()
        farm.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="v5e:4x4")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    args = ap.parse_args()
    ENV.update(BENCH_LAYERS=str(args.layers), BENCH_WIDTH=str(args.width))
    print(f"# {args.hosts}-host pod ({args.topology}), 4 programs of {args.layers} layers x "
          f"{args.width}, {os.cpu_count()} cores")
    results = {}
    for mode in ("local", "share", "prewarmed"):
        with fresh_coordinator() as coordinator:
            assert isinstance(coordinator, str)  # (one, with no workers in front)
            fill = farm_fill(coordinator, args.topology) if mode == "prewarmed" else None
            results[mode] = r = pod(mode, coordinator, args.topology, args.hosts)
        extra = f"  (farm filled the cache in {fill:.1f}s before the job)" if fill else ""
        print(f"{mode:10}  all {args.hosts} ready in {r['ready']:6.1f}s  compiles {r['compiles']:2}"
              f"  startup+lowering {r['lowered']:.1f}s  {r['bytes'] / 1e6:.0f} MB/process{extra}",
              flush=True)
    base = results["local"]["ready"]
    for mode in ("share", "prewarmed"):
        print(f"{mode:10}  {base / results[mode]['ready']:.2f}x faster than every host compiling")


if __name__ == "__main__":
    main()
