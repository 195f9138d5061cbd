"""A process's cold fetch through its worker: the worker downloads the
artifact into its host cache while the process reads it, either following
the host cache's file as the worker writes it (after the first MiB; the
default) or taking every byte over the worker's socket (as before the
"Artifact fetch throughput and memory"). Side by side, alternating, each fetch on a fresh
worker (its host cache empty) of one coordinator.

    python bench/cold_fetch.py [--mb 512] [--pairs 3] [--processes P]
                               [--ways follow socket grpc]

Prints per fetch the wall time until the process holds the verified bytes,
and the CPU-seconds of the process, the worker and the coordinator. With
--processes P, P processes of the host (a GPU host's 8) fetch at once, and
the time is until the last holds the bytes (CPU: all of theirs). The way
`grpc` follows a worker whose downloads go over gRPC only (no data plane).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, cpu_seconds, random_file
from fetch import publish_file

PROCESS = """
import resource, sys, time
from compilecast.negotiate import Route
from compilecast.worker.inprocess.client import CacheClient
c = CacheClient(sys.argv[1], timeout_s=120)
if sys.argv[3] == "socket":
    c.routes.off(Route.GROWING_FILE, "the benchmark reads over the socket")
t0 = time.perf_counter()
info, data = c.fetch(sys.argv[2])
r = resource.getrusage(resource.RUSAGE_SELF)
print(time.perf_counter() - t0, r.ru_utime + r.ru_stime)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--ways", nargs="+", choices=("follow", "socket", "grpc"),
                    default=["follow", "socket"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cc-cold-") as tmp:
        root = Path(tmp)
        stack = Stack(root)
        try:
            coord, cproc = stack.coordinator()
            path = root / "artifact.bin"
            random_file(path, args.mb << 20)  # stored raw, as JAX's (compressed) entries are
            publish_file(coord, "art", path)
            path.unlink()
            rows = []
            for k in range(args.pairs):
                for how in (args.ways if k % 2 == 0 else args.ways[::-1]):
                    extra = ("--data-plane", "false") if how == "grpc" else ()
                    worker, wproc = stack.worker(coord, f"w{k}-{how}", extra)
                    before = cpu_seconds(wproc.pid), cpu_seconds(cproc.pid)
                    ps = [subprocess.Popen([sys.executable, "-c", PROCESS, worker, "art", how],
                                           stdout=subprocess.PIPE, text=True)
                          for _ in range(args.processes)]
                    outs = [p.communicate()[0].split()[-2:] for p in ps]
                    if any(p.returncode for p in ps):
                        raise RuntimeError("a fetching process failed")
                    wall = max(float(o[0]) for o in outs)
                    process_cpu = sum(float(o[1]) for o in outs)
                    time.sleep(0.2)  # the worker's commit after the process is done
                    row = {"how": how, "pair": k + 1, "wall_s": wall, "process_cpu_s": process_cpu,
                           "worker_cpu_s": cpu_seconds(wproc.pid) - before[0],
                           "coordinator_cpu_s": cpu_seconds(cproc.pid) - before[1]}
                    rows.append(row)
                    print(f"pair {k + 1} {how:6s}: {args.mb / wall:5.0f} MB/s ({wall:.2f} s); CPU "
                          f"process {process_cpu:.2f} s (with its start-up), worker "
                          f"{row['worker_cpu_s']:.2f} s, coordinator "
                          f"{row['coordinator_cpu_s']:.2f} s", flush=True)
                    wproc.terminate()
                    wproc.wait(30)
                    # Its host cache goes too: left in the page cache, each GB made the
                    # next fills' writes slower on this VM (worker system time 0.7 ->
                    # 3-3.7 s a GB after three fills), which the pairs would measure.
                    shutil.rmtree(root / f"cache-w{k}-{how}")
            for how in args.ways:
                mine = [r for r in rows if r["how"] == how]
                print(f"{how:6s}: median {statistics.median(r['wall_s'] for r in mine):.2f} s, "
                      f"process CPU {statistics.median(r['process_cpu_s'] for r in mine):.2f} s, "
                      f"worker CPU {statistics.median(r['worker_cpu_s'] for r in mine):.2f} s",
                      flush=True)
            print(json.dumps(rows))
        finally:
            stack.close()


if __name__ == "__main__":
    main()
