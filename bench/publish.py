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
a pod's holders do, three ways, each with a worker of its own: handed over
as a sealed memory file and sent on over the data plane (the default);
through the worker's gRPC socket and sent on over the data plane; through
gRPC both hops (a worker started with `--data-plane false`, a client that
does not hand over). The worker's CPU is printed too.
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

from compilecast import negotiate
from compilecast.negotiate import Route
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity

# Both ways at every size: the client's own threshold (negotiate.UPLOAD_FROM)
# was set from this bench's small sizes.
negotiate.UPLOAD_FROM = 0

WAYS = ("data plane", "gRPC")
# Through a worker: how the process hands the bytes to its worker, and how the
# worker sends them on.
WORKER_WAYS = ("handoff, data plane", "gRPC, data plane", "gRPC, gRPC")


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(mb: float, pairs: int, through_worker: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="cc-publish-"))
    stack = Stack(root)
    ways = WORKER_WAYS if through_worker else WAYS
    try:
        target, proc = stack.coordinator()
        clients, workers = {}, {}
        for i, way in enumerate(ways):
            if through_worker:  # a worker of its own for each way
                workers[way] = stack.worker(target, f"w{i}", () if way.endswith("data plane")
                                            else ("--data-plane", "false"))
            c = clients[way] = CacheClient(workers[way][0] if through_worker else target,
                                           timeout_s=30, identity=Identity(job="bench-publish"))
            if way != "data plane":
                c.routes.off(Route.DATA_PLANE, "the benchmark takes another way")
            if not way.startswith("handoff"):
                c.routes.off(Route.HANDOFF, "the benchmark takes another way")
        data = os.urandom(int(mb * 1e6))
        got: dict[str, list[tuple[float, ...]]] = {w: [] for w in ways}
        n = 0
        for pair in range(pairs):
            for way in (ways if pair % 2 == 0 else ways[::-1]):
                data = data[1:] + data[:1]
                key = f"publish-{n}"
                n += 1
                c = clients[way]
                resp = c.acquire(key)
                assert resp.decision == pb.COMPILE, resp
                wpid = workers[way][1].pid if workers else None
                cpu, coord, start = own_cpu(), cpu_seconds(proc.pid), time.monotonic()
                wcpu = cpu_seconds(wpid) if wpid else 0.0
                info = c.publish(key, resp.lease, data, 1.0)
                row = (time.monotonic() - start, own_cpu() - cpu, cpu_seconds(proc.pid) - coord,
                       cpu_seconds(wpid) - wcpu if wpid else 0.0)
                got[way].append(row)
                print(f"  {mb:g} MB {way:19s} wall {row[0]:.3f}s  client CPU {row[1]:.3f}s  "
                      f"coordinator CPU {row[2]:.3f}s"
                      + (f"  worker CPU {row[3]:.3f}s" if workers else ""), flush=True)
                stack.blob_path(info.digest).unlink()
                for copy in root.glob(f"cache-*/**/{info.digest}*"):  # the worker's
                    copy.unlink()
        if not clients[ways[0]].routes.on(Route.UPLOAD_TICKET):
            print("  (no upload ticket was offered: every way went over gRPC)")
        medians = {w: [median(r[i] for r in rows) for i in range(4)] for w, rows in got.items()}
        last = medians[ways[-1]]
        print(f"{mb:g} MB, {pairs} rounds{', through a worker' if workers else ''}, medians "
              "(wall / client CPU / coordinator CPU" + (" / worker CPU" if workers else "")
              + "):", flush=True)
        for way in ways:
            m = medians[way]
            print(f"  {way:19s} {m[0]:.3f}s / {m[1]:.3f}s / {m[2]:.3f}s"
                  + (f" / {m[3]:.3f}s" if workers else "")
                  + (f"; wall {m[0] / last[0]:.2f}x, coordinator CPU {m[2] / last[2]:.2f}x"
                     + (f", worker CPU {m[3] / last[3]:.2f}x" if workers else "")
                     + f" the last way's ({mb / m[0]:.0f} against {mb / last[0]:.0f} MB/s)"
                     if way != ways[-1] else ""), flush=True)
        print(f"  the coordinator's peak RSS {peak_rss_mb(proc.pid):.0f} MB", flush=True)
    finally:
        stack.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
