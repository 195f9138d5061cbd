"""Lease renewals through the coordinator's etcd client: what one costs.

    python bench/renewals.py [--count 3000]

Every compile holder renews its claim every third of the lease TTL, through
a coordinator, and an owner's stale lease is renewed before a claim reuses
it. Renews 50 leases of a real etcd `--count` times, one at a time and 50 at
once, twice each, and prints renewals per second and the CPU each cost this
client and etcd.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _servers import Stack, cpu_seconds, own_cpu_seconds

from compilecast.coordinator.etcd import Etcd


async def run(endpoint: str, etcd_pid: int, count: int) -> None:
    client = Etcd([endpoint])
    leases = [await client.grant(60) for _ in range(50)]
    for _ in range(2):
        for together in (1, 50):
            cpu, etcd_cpu, t0 = own_cpu_seconds(), cpu_seconds(etcd_pid), time.perf_counter()
            for i in range(0, count, together):
                await asyncio.gather(*(client.keepalive_once(leases[(i + j) % 50])
                                       for j in range(together)))
            elapsed = time.perf_counter() - t0
            print(f"{together:3d} at once: {count / elapsed:6.0f} renewals/s, this client "
                  f"{1e6 * (own_cpu_seconds() - cpu) / count:5.0f} us CPU each, etcd "
                  f"{1e6 * (cpu_seconds(etcd_pid) - etcd_cpu) / count:5.0f} us", flush=True)
    await client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=3000)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cc-bench-renewals-"))
    stack = Stack(root)
    try:
        asyncio.run(run(stack.etcd, stack.procs[0].pid, args.count))
    finally:
        stack.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
