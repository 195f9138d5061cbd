"""Downloads overlapping the upload: the distribution phase alone.

    python bench/publish_overlap.py [--mb 187] [--n 4 16] [--upload-mbps 0 50] [--repeat 2]

A holder publishes an incompressible artifact while N-1 waiter processes of
its job are already waiting on the key; reported is the time from the start
of the publish until every waiter holds the verified bytes, and how long the
upload itself took, for waiters that fetch as the publish starts (`streamed`,
CacheClient.wait_and_fetch) against waiters that fetch once it is done
(`after`), alternating, each on a fresh etcd and coordinator (streamed: with
`--publish-stream-readers 4`). `--upload-mbps`
paces the holder's upload (0: as fast as it goes), as a holder behind a
slower link or disk than the coordinator's would. The holder sends the
digest last (hashing as it sends) where the coordinator lets it (`after`),
as CacheClient.publish does; `--digest-first` hashes before the first byte,
as every holder did before the digest could come last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, line_of

from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import as_chunks
from compilecast.worker.inprocess.client import CacheClient, Identity
from compilecast.worker.inprocess.clientpublish import publish_messages

WAITER = r"""
import json, sys, time
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity
target, key, pid, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
c = CacheClient(target, timeout_s=60, identity=Identity(job="bench", process_id=pid))
assert c.acquire(key).decision == pb.WAIT
print("waiting", flush=True)
if mode == "streamed":
    event, data = c.wait_and_fetch(key, 300)
else:
    event = c.wait(key, 300)
    data = c.fetch(key, event.artifact.digest)[1]  # verified
print(json.dumps({"done": time.time(), "bytes": len(data)}), flush=True)
"""
MIB = 1 << 20


def publish(holder: CacheClient, key: str, lease: pb.Lease, data: bytes, mbps: float,
            digest_first: bool = False) -> None:
    """As CacheClient.publish sends it: the digest last (hashed as the bytes
    go) where the lease says the coordinator takes it so, unless `digest_first`."""
    first = not lease.takes_digest_last or digest_first
    header = pb.PublishHeader(key=key, lease=lease, size=len(data), compile_time_seconds=10.0,
                              digest=hashlib.sha256(data).hexdigest() if first else "",
                              requester=holder.identity.requester())
    start = time.monotonic()

    def messages():
        sent = 0
        for message in publish_messages(header, data):  # as the client frames and hashes them
            if mbps:  # pace: this many bytes may have left by now
                time.sleep(max(0.0, start + sent / (mbps * 1e6) - time.monotonic()))
            sent += len(message.data)
            yield message

    holder.stub.Publish(as_chunks(messages()), timeout=600)


def one(mode: str, n: int, data: bytes, mbps: float,
        digest_first: bool = False) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        try:
            # Uploads stream to waiters only when the coordinator is told to.
            target, _ = stack.coordinator(extra=("--publish-stream-readers", "4")
                                          if mode == "streamed" else ())
            key = f"overlap-{mode}-{n}"
            holder = CacheClient(target, timeout_s=60, identity=Identity(job="bench"))
            lease = holder.acquire(key).lease
            holder.keep_lease(key, lease)
            waiters = [subprocess.Popen([sys.executable, "-c", WAITER, target, key, str(i), mode],
                                        stdout=subprocess.PIPE, text=True) for i in range(1, n)]
            for w in waiters:
                assert line_of(w).strip() == "waiting"
            time.sleep(1.0)  # every waiter is inside its Wait
            t0 = time.time()
            publish(holder, key, lease, data, mbps, digest_first)
            upload = time.time() - t0
            holder.stop_lease(key, lease)
            rows = [json.loads(line_of(w)) for w in waiters]
            for w in waiters:
                w.wait(60)
            assert all(r["bytes"] == len(data) for r in rows)
            return upload, max(r["done"] for r in rows) - t0
        finally:
            stack.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=187)
    ap.add_argument("--n", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--upload-mbps", type=float, nargs="+", default=[0.0, 50.0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--digest-first", action="store_true",
                    help="the holder hashes before it sends (as before digests could come last)")
    args = ap.parse_args()
    data = os.urandom(args.mb * MIB)
    results = []
    print(f"# {args.mb} MiB artifact, {os.cpu_count()} cores; best of {args.repeat}", flush=True)
    for mbps in args.upload_mbps:
        for n in args.n:
            got: dict[str, list[tuple[float, float]]] = {"after": [], "streamed": []}
            for _ in range(args.repeat):
                for mode in got:  # alternating, side by side
                    got[mode].append(one(mode, n, data, mbps, args.digest_first))
            best = {m: min(v, key=lambda r: r[1]) for m, v in got.items()}
            pace = f"upload paced to {mbps:.0f} MB/s" if mbps else "upload unpaced"
            print(f"N={n:3d} {pace}: all waiters hold the bytes "
                  f"{best['after'][1]:.2f}s fetching after the publish (upload "
                  f"{best['after'][0]:.2f}s) | {best['streamed'][1]:.2f}s streamed "
                  f"(upload {best['streamed'][0]:.2f}s) | ratio "
                  f"{best['streamed'][1] / best['after'][1]:.2f}", flush=True)
            results.append({"n": n, "upload_mbps": mbps, **{m: got[m] for m in got}})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
