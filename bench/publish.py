"""A process publishing to the coordinator: over its data plane (OpenUpload)
against a Publish stream over gRPC, side by side.

    python bench/publish.py [--sizes-mb 187 1024] [--pairs 5]

Per size: one coordinator (durable store) over a fresh etcd, and a process
(this one) holding a lease per publish, as a holder that has just compiled.
Each pair publishes the same incompressible bytes (rotated by a byte, so
that each is a new blob) both ways, alternating which goes first; the blob
is removed from the store after each publish, so that the page cache does
not grow through the run. Prints each publish's wall time until the
coordinator answered, the client's CPU and the coordinator's CPU, the
medians of each way, and the coordinator's peak RSS (it streams every
publish to its store, never holding it whole).
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


def run(mb: float, pairs: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="cc-publish-"))
    stack = Stack(root)
    try:
        target, proc = stack.coordinator()
        client = CacheClient(target, timeout_s=30, identity=Identity(job="bench-publish"))
        data = os.urandom(int(mb * 1e6))
        got: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
        n = 0
        for pair in range(pairs):
            for way in (WAYS if pair % 2 == 0 else WAYS[::-1]):
                data = data[1:] + data[:1]
                key = f"publish-{n}"
                n += 1
                resp = client.acquire(key)
                assert resp.decision == pb.COMPILE, resp
                client.data_plane = way == "data plane"
                cpu, coord, start = own_cpu(), cpu_seconds(proc.pid), time.monotonic()
                info = client.publish(key, resp.lease, data, 1.0)
                row = (time.monotonic() - start, own_cpu() - cpu, cpu_seconds(proc.pid) - coord)
                got[way].append(row)
                print(f"  {mb:g} MB {way:10s} wall {row[0]:.3f}s  client CPU {row[1]:.3f}s  "
                      f"coordinator CPU {row[2]:.3f}s", flush=True)
                stack.blob_path(info.digest).unlink()
        if not client.data_plane_uploads:
            print("  (the coordinator offered no upload ticket: both ways went over gRPC)")
        medians = {w: [median(r[i] for r in rows) for i in range(3)] for w, rows in got.items()}
        plane, grpc_ = medians["data plane"], medians["gRPC"]
        print(f"{mb:g} MB, {pairs} pairs, medians: data plane wall {plane[0]:.3f}s / client "
              f"{plane[1]:.3f}s / coordinator {plane[2]:.3f}s; gRPC {grpc_[0]:.3f}s / "
              f"{grpc_[1]:.3f}s / {grpc_[2]:.3f}s; wall {plane[0] / grpc_[0]:.2f}x, "
              f"coordinator CPU {plane[2] / grpc_[2]:.2f}x ({mb / plane[0]:.0f} against "
              f"{mb / grpc_[0]:.0f} MB/s); the coordinator's peak RSS {peak_rss_mb(proc.pid):.0f} MB",
              flush=True)
    finally:
        stack.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[187, 1024])
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    print("# a process publishing to the coordinator: data plane against gRPC, "
          f"{os.cpu_count()} cores", flush=True)
    for mb in args.sizes_mb:
        run(mb, args.pairs)


if __name__ == "__main__":
    main()
