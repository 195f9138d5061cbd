"""A worker's cold download of an artifact stored in an object-store bucket:
by a presigned URL straight from the bucket, against through the coordinator
replica (the replica's local cache cold: it fetches from the bucket and
streams on; warm: it already holds the blob), and against a replica on the
disk store. SeaweedFS on loopback is the bucket (`make install` builds
bin/weed). Each download is a fresh worker's (an empty host cache); the
three bucket ways alternate, --pairs rounds.

Usage: python bench/bucket_fetch.py [--mb 256] [--pairs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _servers import Stack, bucket_stack

from compilecast.worker.inprocess.client import CacheClient


def timed_fetch(stack: Stack, coordinator: str, name: str, urls: bool, data: bytes) -> float:
    target, proc = stack.worker(coordinator, name, ("--bucket-urls", str(urls).lower()))
    client = CacheClient(target, timeout_s=120)
    start = time.perf_counter()
    got = client.fetch("k")[1]
    seconds = time.perf_counter() - start
    assert got == data
    client.close()
    proc.terminate()
    proc.wait(15)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    data = os.urandom(args.mb << 20)
    digest = hashlib.sha256(data).hexdigest()
    runs: dict[str, list[float]] = {"presigned URL": [], "through the replica, cold": [],
                                    "through the replica, warm": [], "disk store replica": []}
    with tempfile.TemporaryDirectory() as tmp, bucket_stack(Path(tmp)) as (stack, _, s3_flags):
        # The disk-store coordinator keeps its keys apart in etcd: sharing
        # the bucket coordinators' keys, the bucket's acquire of "k" raced
        # the disk's publish of it (an answer without a lease, under load).
        disk, _ = stack.coordinator("disk", extra=("--etcd-prefix", "/compilecast/disk"))
        for target in (disk, stack.coordinator("pub", extra=s3_flags)[0]):
            c = CacheClient(target, timeout_s=120)
            c.publish("k", c.acquire("k").lease, data, 1.0)
            c.close()
        for i in range(args.pairs):
            fresh, proc = stack.coordinator(f"r{i}", extra=s3_flags)  # an empty local cache
            runs["presigned URL"].append(timed_fetch(stack, fresh, f"u{i}", True, data))
            runs["through the replica, cold"].append(
                timed_fetch(stack, fresh, f"c{i}", False, data))
            runs["through the replica, warm"].append(
                timed_fetch(stack, fresh, f"w{i}", False, data))
            runs["disk store replica"].append(timed_fetch(stack, disk, f"d{i}", False, data))
            proc.terminate()
            proc.wait(15)
    print(f"a worker's cold download of {args.mb} MiB ({digest[:12]}), {args.pairs} rounds")
    print(f"{'how':28} {'median s':>9} {'MB/s':>7}  runs")
    for how, secs in runs.items():
        med = statistics.median(secs)
        print(f"{how:28} {med:9.2f} {args.mb / med:7.0f}  "
              + ", ".join(f"{s:.2f}" for s in secs))


if __name__ == "__main__":
    sys.exit(main())
