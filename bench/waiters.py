"""What a pod's waiting processes cost, and how fast they hold the bytes
after the publish: N processes wait (`CacheClient.wait_and_fetch`, as the
JAX integration's waiters do) for a key one holder compiles, then the holder
publishes. Waits over the coordinator's data plane (the default) against
waits on gRPC streams (`COMPILECAST_DATA_WAITS=0`), alternating, on one
coordinator and etcd.

Printed for each round:
- the host's CPU while the N processes wait (/proc/stat, in cores' percent),
- a waiter's CPU from the publish to holding the verified bytes (median),
- the coordinator's CPU over the same span,
- when the last waiter held the bytes, after the publish began.

    python bench/waiters.py --n 63 --mb 1.4 --rounds 2

No JAX here: the processes are plain clients, so that the figures are the
wait's and the fetch's alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _servers import Stack, line_of, say

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity

WAITER = r"""
import json, sys, threading, time
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity
target, key, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = CacheClient(target, timeout_s=60,
                     identity=Identity(job="bench", process_id=pid, designated_process=0))
assert client.acquire(key).decision == pb.WAIT, "not a WAIT"
print("waiting", flush=True)
published = []
threading.Thread(target=lambda: (sys.stdin.readline(), published.append(time.process_time())),
                 daemon=True).start()
event, data = client.wait_and_fetch(key, 120)
cpu = time.process_time()
print(json.dumps({"done": time.time(), "bytes": len(data or b""),
                  "wake_ms": (cpu - (published or [cpu])[0]) * 1e3}), flush=True)
sys.stdin.readline()  # kept alive until all are done: an exit costs CPU too
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_cores(seconds: float) -> float:
    def sample() -> list[int]:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]

    a = sample()
    time.sleep(seconds)
    d = [y - x for x, y in zip(a, sample(), strict=True)]
    return (1 - (d[3] + d[4]) / sum(d)) * (os.cpu_count() or 1)


def one_round(target: str, coordinator_pid: int, n: int, size: int, data_waits: bool,
              idle_s: float) -> dict:
    key = hashlib.sha256(os.urandom(16)).hexdigest()
    holder = CacheClient(target, timeout_s=60,
                         identity=Identity(job="bench", process_id=0, designated_process=0))
    resp = holder.acquire(key)
    assert resp.decision == pb.COMPILE, resp
    env = {**os.environ, "COMPILECAST_DATA_WAITS": "1" if data_waits else "0"}
    procs = [subprocess.Popen([sys.executable, "-c", WAITER, target, key, str(i + 1)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    try:
        for p in procs:
            assert line_of(p).startswith("waiting")
        time.sleep(0.5)  # all in their waits
        holder.keepalive(key, resp.lease)
        busy = busy_cores(idle_s)
        holder.keepalive(key, resp.lease)
        data = os.urandom(size)
        for p in procs:
            say(p, "\n")
        c0, t0 = cpu_s(coordinator_pid), time.time()
        holder.publish(key, resp.lease, data, 1.0)
        outs = [json.loads(line_of(p)) for p in procs]
        c1 = cpu_s(coordinator_pid)
        assert all(o["bytes"] == size for o in outs), "a waiter did not get the bytes"
        return {"busy_cores_waiting": busy, "waiter_wake_ms": statistics.median(
            o["wake_ms"] for o in outs), "coordinator_ms": (c1 - c0) * 1e3,
            "last_holds_s": max(o["done"] for o in outs) - t0}
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        holder.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--n", type=int, default=63, help="waiting processes")
    ap.add_argument("--mb", type=float, default=1.4, help="artifact size (random bytes)")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of rounds, alternating")
    ap.add_argument("--idle-s", type=float, default=2.0,
                    help="how long the host's CPU is sampled while they wait")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cc-waiters-") as tmp:
        stack = Stack(Path(tmp))
        try:
            target, proc = stack.coordinator()
            for r in range(args.rounds):
                for data_waits in ((True, False) if r % 2 == 0 else (False, True)):
                    got = one_round(target, proc.pid, args.n, int(args.mb * 1e6), data_waits,
                                    args.idle_s)
                    how = "data plane waits" if data_waits else "gRPC stream waits"
                    print(f"{args.n} waiters, {args.mb:g} MB, {how}: host busy "
                          f"{got['busy_cores_waiting'] * 100:.0f}% of a core while they wait; "
                          f"a waiter's CPU at the wake {got['waiter_wake_ms']:.1f} ms (median); "
                          f"coordinator {got['coordinator_ms']:.0f} ms; the last holds the "
                          f"bytes {got['last_holds_s']:.3f} s after the publish began",
                          flush=True)
                    print(json.dumps({"data_waits": data_waits, "n": args.n, **got}), flush=True)
        finally:
            stack.close()


if __name__ == "__main__":
    main()
