"""Artifact fetch throughput and server memory.

    python bench/fetch.py [--sizes-mb 100 1024 2048]

Per size: publish an incompressible artifact, then fetch it (client verifies
the sha256 on the fly, never holding it whole) from the coordinator, through
a worker cold (fills its host cache) and warm (host hit), and stream the same
bytes from a plain gRPC server, without verification and with the client
hashing like ours (the fair ceiling for a verifying client). Afterwards, the peak
RSS of the coordinator and worker processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, free_port, peak_rss_mb, random_file, wait_port

from compilecast import wire
from compilecast.grpcutil import CHANNEL_OPTIONS
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk
from compilecast.worker.client import CacheClient


def publish_file(target: str, key: str, path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    size = path.stat().st_size
    ch = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    stub = wire.stub(ch)
    lease = stub.Acquire(pb.AcquireRequest(key=key), timeout=10).lease

    def msgs():
        yield pb.PublishChunk(header=pb.PublishHeader(key=key, lease=lease,
                                                      digest=digest.hexdigest(), size=size,
                                                      compile_time_seconds=1.0))
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                yield DataChunk(chunk)

    keeper = CacheClient(target)
    keeper.keep_lease(key, lease)  # a long upload outlives the lease TTL
    try:
        stub.Publish(msgs(), timeout=600)
    finally:
        keeper.close()
        ch.close()
    return digest.hexdigest()


def fetch(target: str, key: str, expect: str) -> float:
    ch = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    stub = wire.stub(ch)
    h = hashlib.sha256()
    t0 = time.perf_counter()
    for chunk in stub.Fetch(pb.FetchRequest(key=key), timeout=600):
        h.update(chunk.data)
    elapsed = time.perf_counter() - t0
    ch.close()
    assert h.hexdigest() == expect
    return elapsed


PLAIN_OPTIONS = [("grpc.max_receive_message_length", 8 << 20)]  # gRPC's defaults otherwise


def plain(port: int, verify: bool = False) -> float:
    """The baseline: the same bytes from a plain gRPC server; with verify,
    the client hashes them as compilecast's clients must."""
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=PLAIN_OPTIONS)
    call = ch.unary_stream("/bench.Plain/Stream", request_serializer=None,
                           response_deserializer=None)
    h = hashlib.sha256()
    t0 = time.perf_counter()
    n = 0
    for chunk in call(b"", timeout=600):
        n += len(chunk)
        if verify:
            h.update(chunk)
    elapsed = time.perf_counter() - t0
    ch.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1024, 2048])
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cc-fetch-"))
    stack = Stack(root)
    rows = []
    try:
        coord, cproc = stack.coordinator()
        worker, wproc = stack.worker(coord, "w")
        for mb in args.sizes_mb:
            path = root / f"art-{mb}.bin"
            random_file(path, mb << 20)
            key = f"art-{mb}"
            t0 = time.perf_counter()
            digest = publish_file(coord, key, path)
            pub = time.perf_counter() - t0
            port = free_port()
            ps = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_plain_server.py"),
                                   str(port), str(path)])
            wait_port(port)
            base = plain(port)
            base_verified = plain(port, verify=True)
            ps.terminate()
            ps.wait()
            direct = fetch(coord, key, digest)
            cold = fetch(worker, key, digest)
            warm = fetch(worker, key, digest)
            row = {"mb": mb, "publish_s": pub, "plain_s": base,
                   "plain_verified_s": base_verified, "coordinator_s": direct,
                   "worker_cold_s": cold, "worker_warm_s": warm,
                   "coordinator_peak_rss_mb": peak_rss_mb(cproc.pid),
                   "worker_peak_rss_mb": peak_rss_mb(wproc.pid)}
            rows.append(row)
            print(f"{mb:5d} MB  plain {mb / base:7.0f} MB/s | coordinator {mb / direct:7.0f} MB/s "
                  f"({base / direct * 100:3.0f}% of plain, {base_verified / direct * 100:3.0f}% of "
                  f"plain verifying at {mb / base_verified:.0f} MB/s) | worker cold {mb / cold:6.0f} MB/s | "
                  f"worker warm {mb / warm:6.0f} MB/s ({base / warm * 100:3.0f}%) | publish "
                  f"{mb / pub:5.0f} MB/s | peak RSS coordinator {row['coordinator_peak_rss_mb']:.0f}"
                  f" MB, worker {row['worker_peak_rss_mb']:.0f} MB", flush=True)
            path.unlink()
    finally:
        stack.close()
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
