"""What an index sweep costs: etcd's index of N artifacts, a tenth of them
evicted from the store, swept by one replica (coordinator/sweep.py).

    python bench/sweep.py [--entries 10000 100000] [--records]

Writes N index entries (and with --records as many key records, a tenth of
them old and without an artifact) under a fresh prefix of a real etcd, puts a
file in the store for nine in ten entries, and times one sweep: the pages
read, a stat per entry, the guarded deletes. Prints the time, the records
dropped, and etcd's CPU during the sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _servers import Stack, cpu_seconds
from prometheus_client import CollectorRegistry

from compilecast.blobstore import DiskBlobStore
from compilecast.coordinator.etcd import Etcd, op_put
from compilecast.coordinator.metrics import CoordinatorMetrics
from compilecast.coordinator.presence import Presence
from compilecast.coordinator.records import KeyRecords
from compilecast.coordinator.sweep import IndexSweeper


async def run(endpoint: str, root: Path, n: int, records: bool, etcd_pid: int) -> dict:
    prefix = f"/bench-sweep-{n}".encode()
    store = DiskBlobStore(root / f"store-{n}")
    etcd = Etcd([endpoint])
    metrics = CoordinatorMetrics(CollectorRegistry())
    key_records = KeyRecords(etcd, prefix, metrics)
    old = time.time() - 60 * 86400
    ops = []
    for i in range(n):
        digest = f"{i:064x}"
        key = f"default/cc1-{i:060x}"
        ops.append(op_put(prefix + b"/a/" + key.encode(), json.dumps(
            {"digest": digest, "size": 80 << 20, "compile_time_seconds": 42.0,
             "created_unix": old}).encode()))
        if i % 10:  # nine in ten are still in the store
            path = store.path_of(digest)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        if records:
            ops.append(op_put(prefix + b"/k/" + key.encode(), json.dumps(
                {"program_name": f"jit_step_{i % 100}", "first_seen": old,
                 "components": {c: f"{i:064x}" for c in (
                     "program", "compile_options", "platform", "versions", "xla_flags",
                     "topology", "compression")}}).encode()))
        if len(ops) >= 100:
            await etcd.txn([], ops)
            ops = []
    if ops:
        await etcd.txn([], ops)
    sweeper = IndexSweeper(etcd, prefix, Presence(store, metrics.bucket_stalls), key_records, metrics,
                           record_max_age_s=30 * 86400 if records else 0,
                           forget=lambda sk, rev: None)
    cpu0 = cpu_seconds(etcd_pid)
    t0 = time.perf_counter()
    entries, dropped_records = await sweeper.sweep()
    elapsed = time.perf_counter() - t0
    etcd_cpu = cpu_seconds(etcd_pid) - cpu0
    await etcd.close()
    return {"entries": n, "records": n if records else 0, "seconds": elapsed,
            "entries_dropped": entries, "records_dropped": dropped_records,
            "etcd_cpu_s": etcd_cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--records", action="store_true",
                    help="also key records for every key (all old; the evicted tenth goes)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cc-bench-sweep-"))
    stack = Stack(root)
    try:
        for n in args.entries:
            r = asyncio.run(run(stack.etcd, root, n, args.records, stack.procs[0].pid))
            print(f"{n:7d} index entries{' + key records' if args.records else ''}: sweep "
                  f"{r['seconds']:.2f}s, dropped {r['entries_dropped']} entries and "
                  f"{r['records_dropped']} records, etcd {r['etcd_cpu_s']:.2f} CPU-s",
                  flush=True)
            print(json.dumps(r), flush=True)
    finally:
        stack.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
