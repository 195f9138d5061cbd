"""What it costs to list and purge a tenant of many artifacts, against a
real etcd (its default limit of 128 operations a transaction) and a
coordinator on loopback.

    python bench/listing.py [--artifacts 10000] [--clients 8]

Publishes --artifacts small artifacts (a claim and a publish each, --clients
at once), then times, each in its own pass:
- ListArtifacts page by page, at the coordinator's page (500) and its
  largest (5,000): seconds and the coordinator's CPU seconds;
- `compilecast ls` (a process: its own start included);
- a dry-run purge of every key, then the purge itself (the client's pages of
  1,000 keys): seconds and the coordinator's CPU seconds.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, cpu_seconds

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

T = TypeVar("T")


def publish_all(target: str, keys: list[str], clients: int) -> None:
    def part(i: int) -> None:
        c = CacheClient(target)
        try:
            for key in keys[i::clients]:
                got = c.acquire(key)
                assert got.decision == pb.COMPILE, got
                c.publish(key, got.lease, key.encode() * 3, 1.0)
        finally:
            c.close()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(part, range(clients)))


def timed(pid: int, fn: Callable[[], T]) -> tuple[float, float, T]:
    """(seconds, the coordinator's CPU seconds, fn's result)."""
    cpu, start = cpu_seconds(pid), time.perf_counter()
    out = fn()
    return time.perf_counter() - start, cpu_seconds(pid) - cpu, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    stack = Stack(Path(tempfile.mkdtemp(prefix="cc-listing-")))
    try:
        target, proc = stack.coordinator()
        keys = [f"prog-{i:06d}" for i in range(args.artifacts)]
        published_s, _, _ = timed(proc.pid, lambda: publish_all(target, keys, args.clients))
        c = CacheClient(target, timeout_s=60.0)
        out: dict = {"artifacts": args.artifacts, "publish_s": round(published_s, 1)}
        for page in (500, 5000):
            s, cpu, listed = timed(proc.pid, lambda page=page: list(c.list_artifacts(page=page)))
            assert len(listed) == args.artifacts, len(listed)
            out[f"list_page_{page}"] = {"s": round(s, 2), "coordinator_cpu_s": round(cpu, 2)}
        s, cpu, ls = timed(proc.pid, lambda: subprocess.run(
            [sys.executable, "-m", "compilecast.cli", "ls", "--coordinator", target],
            capture_output=True, text=True, timeout=600))
        assert ls.returncode == 0 and f"{args.artifacts} artifacts" in ls.stdout, ls.stderr
        out["compilecast_ls"] = {"s": round(s, 2), "coordinator_cpu_s": round(cpu, 2)}
        s, cpu, dry = timed(proc.pid, lambda: c.purge(keys, dry_run=True))
        assert len(dry.purged) == args.artifacts
        out["purge_dry_run"] = {"s": round(s, 2), "coordinator_cpu_s": round(cpu, 2)}
        s, cpu, done = timed(proc.pid, lambda: c.purge(keys, reason="bench"))
        assert len(done.purged) == args.artifacts and not list(c.list_artifacts())
        out["purge"] = {"s": round(s, 2), "coordinator_cpu_s": round(cpu, 2)}
        print(json.dumps(out))
    finally:
        stack.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
