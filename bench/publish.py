"""A process publishing to the coordinator: over its data plane (OpenUpload)
against a Publish stream over gRPC, side by side.

    python bench/publish.py [--sizes-mb 187 1024] [--pairs 5] [--through-worker]

Per size: one coordinator (durable store) over a fresh etcd, and a process
(this one) holding a lease per publish, as a holder that has just compiled.
Each pair publishes the same incompressible bytes (rotated by a byte, so
that each is a new blob) both ways, alternating which goes first; the blob
is removed from the store (and a worker's copy from its host cache) after
each publish, so that the page cache does not grow through the run. Prints
each publish's wall time until the coordinator answered, the client's CPU
and the coordinator's CPU, the medians of each way, and the coordinator's
peak RSS (it streams every publish to its store, never holding it whole).

With --through-worker the process publishes through a worker on its host, as
a pod's holders do, and the worker sends the bytes on: through one worker
that takes the data plane, and one started with `--data-plane false`. The
worker's CPU is printed too.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, cpu_seconds, peak_rss_mb

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker import client as client_mod
from compilecast.worker.client import CacheClient, Identity

# Both ways at every size: the client's own threshold (DATA_PLANE_UPLOAD_FROM)
# was set from this bench's small sizes.
client_mod.DATA_PLANE_UPLOAD_FROM = 0

WAYS = ("data plane", "gRPC")


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(mb: float, pairs: int, through_worker: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="cc-publish-"))
    stack = Stack(root)
    try:
        target, proc = stack.coordinator()
        client = CacheClient(target, timeout_s=30, identity=Identity(job="bench-publish"))
        # Through a worker: each way has a worker of its own.
        workers = {way: stack.worker(target, f"w{i}", () if way == "data plane" else
                                     ("--data-plane", "false"))
                   for i, way in enumerate(WAYS)} if through_worker else {}
        clients = {way: CacheClient(w, timeout_s=30, identity=Identity(job="bench-publish"))
                   for way, (w, _) in workers.items()}
        data = os.urandom(int(mb * 1e6))
        got: dict[str, list[tuple[float, ...]]] = {w: [] for w in WAYS}
        n = 0
        for pair in range(pairs):
            for way in (WAYS if pair % 2 == 0 else WAYS[::-1]):
                data = data[1:] + data[:1]
                key = f"publish-{n}"
                n += 1
                c = clients.get(way, client)
                resp = c.acquire(key)
                assert resp.decision == pb.COMPILE, resp
                c.data_plane = way == "data plane"
                wpid = workers[way][1].pid if workers else None
                cpu, coord, start = own_cpu(), cpu_seconds(proc.pid), time.monotonic()
                wcpu = cpu_seconds(wpid) if wpid else 0.0
                info = c.publish(key, resp.lease, data, 1.0)
                row = (time.monotonic() - start, own_cpu() - cpu, cpu_seconds(proc.pid) - coord,
                       cpu_seconds(wpid) - wcpu if wpid else 0.0)
                got[way].append(row)
                print(f"  {mb:g} MB {way:10s} wall {row[0]:.3f}s  client CPU {row[1]:.3f}s  "
                      f"coordinator CPU {row[2]:.3f}s"
                      + (f"  worker CPU {row[3]:.3f}s" if workers else ""), flush=True)
                stack.blob_path(info.digest).unlink()
                for copy in root.glob(f"cache-*/**/{info.digest}*"):  # the worker's
                    copy.unlink()
        if not client.data_plane_uploads:
            print("  (the coordinator offered no upload ticket: both ways went over gRPC)")
        medians = {w: [median(r[i] for r in rows) for i in range(4)] for w, rows in got.items()}
        plane, grpc_ = medians["data plane"], medians["gRPC"]
        print(f"{mb:g} MB, {pairs} pairs{', through a worker' if workers else ''}, medians: "
              f"data plane wall {plane[0]:.3f}s / client {plane[1]:.3f}s / coordinator "
              f"{plane[2]:.3f}s{f' / worker {plane[3]:.3f}s' if workers else ''}; gRPC "
              f"{grpc_[0]:.3f}s / {grpc_[1]:.3f}s / {grpc_[2]:.3f}s"
              f"{f' / {grpc_[3]:.3f}s' if workers else ''}; wall {plane[0] / grpc_[0]:.2f}x, "
              f"coordinator CPU {plane[2] / grpc_[2]:.2f}x ({mb / plane[0]:.0f} against "
              f"{mb / grpc_[0]:.0f} MB/s); the coordinator's peak RSS {peak_rss_mb(proc.pid):.0f} MB",
              flush=True)
    finally:
        stack.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[187, 1024])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--through-worker", action="store_true",
                    help="publish through a worker, which sends the bytes on each way")
    args = ap.parse_args()
    print("# a process publishing to the coordinator"
          f"{' through a worker' if args.through_worker else ''}: data plane against gRPC, "
          f"{os.cpu_count()} cores", flush=True)
    for mb in args.sizes_mb:
        run(mb, args.pairs, args.through_worker)


if __name__ == "__main__":
    main()
