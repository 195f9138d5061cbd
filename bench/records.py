"""The CPU a miss's key record and a request's component check cost the
coordinator, in one process, against a real etcd.

    python bench/records.py [--rate 500] [--seconds 10] [--clients 1000]
                            [--names 10] [--components 11]

Records: `rate` new keys a second for `seconds` go to a KeyRecords on a
fresh etcd (as a coordinator's misses would), in the decisions bench's
pattern: `clients` clients, each key of one of `names` program names, its
first component ("program") its own, the others its client's. Prints the
process's CPU (this thread and gRPC's) per key recorded, from the first key
until the recorder is idle, and how many keys each etcd round recorded.

Check: the CPU of `validate.acquire_request` per request, for a Decide
message of 10 requests with no components and with `components`, parsed
from bytes as the coordinator gets them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack

from compilecast import validate
from compilecast.coordinator.etcd import Etcd
from compilecast.coordinator.metrics import CoordinatorMetrics
from compilecast.coordinator.records import KeyRecords, scope
from compilecast.v1 import cache_pb2 as pb


def components(client: int, key: int, n: int) -> dict[str, str]:
    """A key's components: "program" its own, the rest its client's."""
    comps = {"program": hashlib.sha256(f"{key}/program".encode()).hexdigest()}
    for i in range(1, n):
        comps[f"component_{i}"] = hashlib.sha256(f"{client}/{i}".encode()).hexdigest()
    return comps


async def record_keys(endpoint: str, rate: float, seconds: float, clients: int, names: int,
                      ncomp: int) -> dict:
    client = Etcd([endpoint])
    registry = CollectorRegistry()
    records = KeyRecords(client, b"/bench", CoordinatorMetrics(registry))
    rounds = 0
    batch = records._record_batch

    async def counted(items):
        nonlocal rounds
        rounds += 1
        return await batch(items)

    records._record_batch = counted  # type: ignore[method-assign]  # (the bench counts its rounds)
    rng = random.Random(1)
    total = int(rate * seconds)
    keys = [(scope("default", f"k{n:012d}"), f"jit_step_{n % names}",
             components(rng.randrange(clients), n, ncomp)) for n in range(total)]
    try:
        cpu0, t0 = time.process_time(), time.monotonic()
        for n, (sk, name, comps) in enumerate(keys):
            ahead = t0 + n / rate - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
            records.record(sk, name, comps)
        if records._recorder is not None:  # the last keys' rounds
            await records._recorder
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    finally:
        await records.close()
        await client.close()
    skipped = registry.get_sample_value("compilecast_coordinator_key_records_skipped_total") or 0
    return {"keys": total, "cpu_us_per_key": cpu / total * 1e6, "wall_s": wall,
            "keys_per_round": (total - skipped) / max(rounds, 1), "skipped": skipped}


def check_cost(ncomp: int, repeat: int = 20000) -> float:
    """CPU us per request of validate.acquire_request on a parsed Decide message."""
    msg = pb.DecideRequest(id=1)
    for n in range(10):
        r = msg.requests.add(key=f"k{n:040d}", program_name="jit_step_1" if ncomp else "")
        r.requester.client = f"client-{n}"
        r.key_components.update(components(n, n, ncomp) if ncomp else {})
    parsed = pb.DecideRequest.FromString(msg.SerializeToString())
    cpu0 = time.process_time()
    for _ in range(repeat):
        for r in parsed.requests:
            validate.acquire_request(r)
    return (time.process_time() - cpu0) / (repeat * 10) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=500, help="new keys a second")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--names", type=int, default=10, help="program names")
    ap.add_argument("--components", type=int, default=11)
    args = ap.parse_args()
    if args.rate <= 0 or args.seconds <= 0 or args.components < 1:
        ap.error("--rate and --seconds must be > 0, --components at least 1")
    stack = Stack(Path(tempfile.mkdtemp(prefix="cc-records-")))
    try:
        got = asyncio.run(record_keys(stack.etcd, args.rate, args.seconds, args.clients,
                                      args.names, args.components))
    finally:
        stack.close()
    got["check_us_per_request"] = {n: check_cost(n) for n in (0, args.components)}
    print(f"{got['keys']} keys at {args.rate:.0f}/s with {args.components} components: "
          f"{got['cpu_us_per_key']:.0f} us CPU a key recorded, "
          f"{got['keys_per_round']:.1f} keys an etcd round, {got['skipped']:.0f} unrecorded; "
          f"component check {got['check_us_per_request'][0]:.1f} us a request without, "
          f"{got['check_us_per_request'][args.components]:.1f} us with")
    print(json.dumps(got))


if __name__ == "__main__":
    main()
