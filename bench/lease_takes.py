"""How often a miss waits for etcd to get its claim lease.

    python bench/lease_takes.py [--ttl 5] [--owners 50] [--interval 0.8] [--seconds 20]
                                [--fresh-fraction 0.5 0.2]

A miss claims its key on its process's lease (coordinator/leases.py). The
pool hands that lease out at once while it is fresh enough, renews it in
the background past half of that, and otherwise renews it (or grants one)
while the miss waits. Here `owners` processes, on a real etcd, each take
their lease at random intervals (exponential, `interval` seconds on average)
for `seconds`, with the pool's freshness limit at each `fresh-fraction` of
the TTL in turn (0.5: what the coordinator uses; 0.2: what it used before).
Prints the takes, the renewals, the share of takes that waited on etcd (a
take that returned within 0.2 ms did not), and the take latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack

from compilecast.coordinator.etcd import Etcd
from compilecast.coordinator.leases import LeasePool

WAITED_MS = 0.2  # a take that returned sooner made no round trip


async def takes(endpoint: str, ttl: int, fraction: float, owners: int, interval: float,
                seconds: float) -> dict:
    client = Etcd([endpoint])
    pool = LeasePool(client, ttl, size=8)
    pool.max_age_s = ttl * fraction
    latencies: list[float] = []

    async def owner(i: int) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(random.expovariate(1 / interval))
            started = time.perf_counter()
            await pool.take(("t", "job", i, f"host:{i}"))
            latencies.append((time.perf_counter() - started) * 1e3)

    try:
        await asyncio.gather(*(owner(i) for i in range(owners)))
    finally:
        await pool.close()
        await client.close()
    latencies.sort()
    waited = sum(1 for ms in latencies if ms > WAITED_MS)
    return {"fresh_fraction": fraction, "takes": len(latencies), "renewals": pool.renewals,
            "granted": pool.granted, "waited_share": waited / len(latencies),
            **{f"p{q}_ms": latencies[min(len(latencies) - 1, int(len(latencies) * q / 100))]
               for q in (50, 90, 99)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ttl", type=int, default=5)
    ap.add_argument("--owners", type=int, default=50)
    ap.add_argument("--interval", type=float, default=0.8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--fresh-fraction", type=float, nargs="+", default=[0.5, 0.2])
    args = ap.parse_args()
    stack = Stack(Path(tempfile.mkdtemp(prefix="cc-leases-")))
    try:
        # etcd's first grants and the first keepalive stream cost more: not measured
        asyncio.run(takes(stack.etcd, args.ttl, 0.5, args.owners, args.interval, 2.0))
        for fraction in args.fresh_fraction:
            r = asyncio.run(takes(stack.etcd, args.ttl, fraction, args.owners, args.interval,
                                  args.seconds))
            print(f"TTL {args.ttl} s, fresh for {fraction:g} of it, {args.owners} processes "
                  f"taking every {args.interval:g} s on average: {r['takes']} takes, "
                  f"{r['renewals']} renewals, {r['granted']} grants; "
                  f"{100 * r['waited_share']:.0f} % waited on etcd; take p50 "
                  f"{r['p50_ms']:.3f} / p90 {r['p90_ms']:.3f} / p99 {r['p99_ms']:.3f} ms")
            print(json.dumps(r))
    finally:
        stack.close()


if __name__ == "__main__":
    main()
