"""A bucket that stops answering: does its replica go on deciding?

Two coordinator replicas over one SeaweedFS bucket (`make install` builds
bin/weed), and beside them a replica on the disk store. Replica A publishes
N artifacts (in the bucket; replica B has never seen them). Then, for each
store, a client measures Acquire on keys nobody holds (unrelated to the
bucket) for `--seconds`, first with everything running, then with the S3
server stopped (SIGSTOP) for the same span, while other clients ask B for
the N published keys (each needs the bucket's word) and a lease holder
renews its lease every second. Printed per store and phase: the unrelated
decisions' p50 and p99 and how many were answered, the renewals that found
the lease lapsed, and how the published keys' decisions ended.

    python bench/bucket_stall.py --seconds 10
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from _servers import bucket_stack

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient


def unrelated(target: str, seconds: float) -> list[float]:
    """Latencies of Acquire on fresh keys for `seconds` (released at once)."""
    client = CacheClient(target, timeout_s=60)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        key = f"u-{uuid.uuid4().hex[:12]}"
        t = time.perf_counter()
        got = client.acquire(key)
        out.append(time.perf_counter() - t)
        if got.decision == pb.COMPILE:
            client.release(key, got.lease, pb.ABANDONED, "bench")
    client.close()
    return out


def renewals(target: str, seconds: float) -> tuple[int, int]:
    """(renewals, lapsed) of one held lease, renewed every second."""
    client = CacheClient(target, timeout_s=60)
    key = f"held-{uuid.uuid4().hex[:12]}"
    lease = client.acquire(key).lease
    done = lapsed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(1.0)
        lapsed += client.keepalive(key, lease) <= 0
        done += 1
    client.release(key, lease, pb.ABANDONED, "bench")
    client.close()
    return done, lapsed


def bucket_asks(target: str, keys: list[str]) -> dict[str, int]:
    client = CacheClient(target, timeout_s=60)
    ended: dict[str, int] = {}
    for key in keys:
        try:
            name = pb.Decision.Name(client.acquire(key).decision)
        except Exception as exc:  # the phase's outcome, whatever it is
            name = type(exc).__name__
        ended[name] = ended.get(name, 0) + 1
    client.close()
    return ended


def phase(target: str, seconds: float, published: list[str]) -> str:
    results: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: results.__setitem__("lat", unrelated(target, seconds))),
        threading.Thread(target=lambda: results.__setitem__("renew", renewals(target, seconds))),
        threading.Thread(target=lambda: results.__setitem__(
            "asks", bucket_asks(target, published) if published else {})),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = sorted(results["lat"])  # type: ignore[arg-type]
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    done, lapsed = results["renew"]  # type: ignore[misc]
    return (f"unrelated decisions {len(lat)}: p50 {statistics.median(lat) * 1e3:.1f} ms, "
            f"p99 {p99 * 1e3:.1f} ms; renewals {done}, lapsed {lapsed}; "
            f"published keys asked of this replica: {results['asks']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--published", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, bucket_stack(Path(tmp)) as (stack, s3, flags):
        a, _ = stack.coordinator("a", extra=flags)
        b, _ = stack.coordinator("b", extra=flags)
        disk, _ = stack.coordinator("disk", extra=("--etcd-prefix", "/compilecast/disk"))
        publisher = CacheClient(a, timeout_s=60)
        keys = []
        for i in range(args.published):
            key = f"p-{i}"
            publisher.publish(key, publisher.acquire(key).lease, os.urandom(4096), 1.0)
            keys.append(key)
        publisher.close()
        print(f"disk store, running:      {phase(disk, args.seconds, [])}")
        print(f"bucket (B), running:      {phase(b, args.seconds, [])}")
        os.kill(s3.proc.pid, signal.SIGSTOP)
        try:
            print(f"bucket (B), S3 stopped:   {phase(b, args.seconds, keys)}")
            print(f"disk store, S3 stopped:   {phase(disk, args.seconds, [])}")
        finally:
            os.kill(s3.proc.pid, signal.SIGCONT)

if __name__ == "__main__":
    main()
