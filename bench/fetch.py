"""Artifact fetch throughput and server memory.

    python bench/fetch.py [--sizes-mb 100 1024 2048] [--compressible]

Per size: publish an incompressible artifact (--compressible: one that
compresses ~10x, as executables do), then fetch it (client verifies
the sha256 on the fly, never holding it whole) from the coordinator, through
a worker cold (fills its host cache; its download over the data plane, and
through a second worker over gRPC only) and warm (host hit), and stream the same
bytes from a plain gRPC server, without verification and with the client
hashing like ours (the fair ceiling for a verifying client). Then a process on
the worker's host fetches the warm artifact through CacheClient, as a JAX
process does, reading the host cache's file and over the socket (twice each,
in turn, best of two), and a process fetches it from the coordinator, over
its data plane and over gRPC (the same way). Afterwards, the peak
RSS of the coordinator and worker processes. With --compressible, the
coordinator and warm-worker fetches are also run taking the stored zstd
(FetchRequest.accept_zstd, the client decoding it), as compilecast's own
clients do, and a process publishes the same bytes through the worker
(which compresses them for the coordinator).
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
from _servers import (
    Stack,
    compressible_file,
    cpu_seconds,
    free_port,
    peak_rss_mb,
    random_file,
    wait_port,
)

from compilecast import wire
from compilecast.grpcutil import CHANNEL_OPTIONS
from compilecast.streams import Inflate, Sha256
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk, as_chunks
from compilecast.worker.inprocess.client import CacheClient


def publish_file(target: str, key: str, path: Path) -> str:
    """Publish the file as CacheClient.publish sends bytes: the digest last,
    hashed as they go (the file read in 1 MiB pieces, never whole)."""
    digest = Sha256()
    size = path.stat().st_size
    ch = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    stub = wire.stub(ch)
    lease = stub.Acquire(pb.AcquireRequest(key=key), timeout=10).lease

    def msgs():
        yield pb.PublishChunk(header=pb.PublishHeader(key=key, lease=lease, size=size,
                                                      compile_time_seconds=1.0))
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                yield DataChunk(chunk)
        yield pb.PublishChunk(digest=digest.hexdigest())

    keeper = CacheClient(target)
    keeper.keep_lease(key, lease)  # a long upload outlives the lease TTL
    try:
        stub.Publish(as_chunks(msgs()), timeout=600)
    finally:
        keeper.close()
        ch.close()
    return digest.hexdigest()


def publish_through(worker: str, key: str, path: Path) -> float:
    """Seconds for a process to publish the file's bytes through its worker
    (which sends them to the coordinator compressed when they compress)."""
    data = path.read_bytes()
    c = CacheClient(worker, timeout_s=60)
    lease = c.acquire(key).lease
    c.keep_lease(key, lease)
    t0 = time.perf_counter()
    try:
        c.publish(key, lease, data, 1.0)
        return time.perf_counter() - t0
    finally:
        c.close()


def fetch(target: str, key: str, expect: str, zstd: bool = False) -> float:
    """Seconds to fetch and verify `key`; with zstd, taking the stored zstd
    and decoding it (in bounded pieces) as it arrives."""
    ch = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    stub = wire.stub(ch)
    h = Sha256()  # as compilecast's clients hash (on a thread for a big artifact)
    inflate = None
    t0 = time.perf_counter()
    for chunk in stub.Fetch(pb.FetchRequest(key=key, accept_zstd=zstd), timeout=600):
        if chunk.HasField("artifact"):
            inflate = Inflate(h.update, chunk.artifact.size)
        if chunk.zstd_data:
            assert inflate is not None, "zstd data before the artifact's header"
            inflate.feed(chunk.zstd_data)
        else:
            h.update(chunk.data)
    digest = h.hexdigest()
    elapsed = time.perf_counter() - t0
    ch.close()
    assert digest == expect
    return elapsed


def fetch_data_plane(target: str, key: str, expect: str) -> float:
    """Seconds to fetch and verify `key` over the coordinator's data plane,
    as `fetch` does over gRPC (hashed as it arrives, never held whole): the
    ticket from Fetch, then the stored blob (raw) into one reused buffer."""
    import socket

    from compilecast.worker.inprocess.dataplane import data_plane_address

    h = Sha256()
    buf = bytearray(4 << 20)
    t0 = time.perf_counter()
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
        head = next(iter(wire.stub(ch).Fetch(pb.FetchRequest(key=key, accept_data_ticket=True),
                                             timeout=600)))
    assert head.HasField("data_ticket"), "the coordinator offered no data plane ticket"
    with socket.create_connection(data_plane_address(head.data_ticket, target)) as sock:
        sock.sendall(wire.DATA_PLANE_REQUEST + head.data_ticket.token)
        skip = 8  # RAW_MAGIC (the bench's artifacts are stored raw)
        while n := sock.recv_into(buf):
            view = memoryview(buf)[skip:n]
            skip = max(0, skip - n)
            h.update(bytes(view))  # a copy: the buffer is reused
    digest = h.hexdigest()
    elapsed = time.perf_counter() - t0
    assert digest == expect
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


PROCESS = """
import sys, time
from compilecast.negotiate import Route
from compilecast.worker.inprocess.client import CacheClient
c = CacheClient(sys.argv[1], timeout_s=60)
for route, way in ((Route.LOCAL_FILE, "file"), (Route.DATA_PLANE, "data")):
    if sys.argv[3] != way:
        c.routes.off(route, "the benchmark takes another way")
t0 = time.perf_counter()
info, data = c.fetch(sys.argv[2])
print(time.perf_counter() - t0)
"""


def process_fetch(worker: str, key: str, how: str) -> float:
    """Seconds for a process on the worker's host to hold the verified bytes
    through CacheClient, as a JAX process does: reading the host cache's file
    ("file") or over the worker's socket ("socket"); or, with the
    coordinator's address for `worker`, over its data plane ("data") or
    over gRPC ("grpc")."""
    out = subprocess.run([sys.executable, "-c", PROCESS, worker, key, how], check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def _measure(stack: Stack, servers: dict, mb: int, compressible: bool) -> dict:
    """One size's figures: publish, then every way of fetching it."""
    root, coord, cproc = stack.root, servers["coord"], servers["cproc"]
    worker, wproc, worker_grpc = servers["worker"], servers["wproc"], servers["worker_grpc"]
    path = root / f"art-{mb}.bin"
    (compressible_file if compressible else random_file)(path, mb << 20)
    key = f"art-{mb}"
    t0 = time.perf_counter()
    digest = publish_file(coord, key, path)
    pub = time.perf_counter() - t0
    port = free_port()
    ps = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_plain_server.py"),
                           str(port), str(path)])
    wait_port(port)
    base, base_verified = plain(port), plain(port, verify=True)
    ps.terminate()
    ps.wait()
    row = {"mb": mb, "publish_s": pub, "plain_s": base, "plain_verified_s": base_verified,
           "coordinator_s": fetch(coord, key, digest),
           "coordinator_data_plane_s": (None if compressible
                                        else fetch_data_plane(coord, key, digest)),
           "worker_cold_s": fetch(worker, key, digest),  # it takes zstd where stored so
           "worker_cold_grpc_s": fetch(worker_grpc, key, digest),
           "worker_warm_s": fetch(worker, key, digest)}
    # Twice each, in turn (file, socket, socket, file), best of two: the first
    # read after a while may find the file evicted from the page cache.
    times: dict[str, list[float]] = {}
    for how in ("file", "socket", "socket", "file"):
        times.setdefault(how, []).append(process_fetch(worker, key, how))
    # A process fetching from the coordinator itself (no worker: AOT checks, a pod's
    # processes in bench/time_to_executable.py), the same way: its data plane and gRPC.
    for how in ("data", "grpc", "grpc", "data"):
        before = cpu_seconds(cproc.pid)
        times.setdefault(how, []).append(process_fetch(coord, key, how))
        times.setdefault(f"{how}_cpu", []).append(cpu_seconds(cproc.pid) - before)
    row.update({"process_file_s": min(times["file"]), "process_socket_s": min(times["socket"]),
                "process_data_plane_s": min(times["data"]),
                "process_grpc_s": min(times["grpc"]),
                "coordinator_cpu_data_plane_s": min(times["data_cpu"]),
                "coordinator_cpu_grpc_s": min(times["grpc_cpu"]),
                "coordinator_peak_rss_mb": peak_rss_mb(cproc.pid),
                "worker_peak_rss_mb": peak_rss_mb(wproc.pid)})
    if compressible:
        before_cpu = cpu_seconds(cproc.pid), cpu_seconds(wproc.pid)
        row["worker_publish_s"] = publish_through(worker, f"{key}-w", path)
        row["publish_cpu_s"] = (cpu_seconds(cproc.pid) - before_cpu[0],
                                cpu_seconds(wproc.pid) - before_cpu[1])
        row["peak_rss_after_publish_mb"] = (peak_rss_mb(cproc.pid), peak_rss_mb(wproc.pid))
        row["coordinator_zstd_s"] = fetch(coord, key, digest, zstd=True)
        row["worker_warm_zstd_s"] = fetch(worker, key, digest, zstd=True)
        row["stored_mb"] = stack.stored_bytes(digest) / (1 << 20)
    path.unlink()
    return row


def _print(row: dict) -> None:
    mb, base, base_verified = row["mb"], row["plain_s"], row["plain_verified_s"]
    direct, cold, warm = row["coordinator_s"], row["worker_cold_s"], row["worker_warm_s"]
    print(f"{mb:5d} MB  plain {mb / base:7.0f} MB/s | coordinator {mb / direct:7.0f} MB/s "
          f"({base / direct * 100:3.0f}% of plain, {base_verified / direct * 100:3.0f}% of "
          f"plain verifying at {mb / base_verified:.0f} MB/s) | worker cold {mb / cold:6.0f} MB/s "
          f"(over gRPC only {mb / row['worker_cold_grpc_s']:6.0f} MB/s) | "
          f"worker warm {mb / warm:6.0f} MB/s ({base / warm * 100:3.0f}%) | publish "
          f"{mb / row['publish_s']:5.0f} MB/s | peak RSS coordinator "
          f"{row['coordinator_peak_rss_mb']:.0f} MB, worker {row['worker_peak_rss_mb']:.0f} MB",
          flush=True)
    if (direct_dp := row["coordinator_data_plane_s"]) is not None:
        print(f"       coordinator over its data plane {mb / direct_dp:7.0f} MB/s "
              f"({base / direct_dp * 100:3.0f}% of plain, {base_verified / direct_dp * 100:3.0f}% "
              f"of plain verifying)", flush=True)
    by_file, by_socket = row["process_file_s"], row["process_socket_s"]
    by_data, by_grpc = row["process_data_plane_s"], row["process_grpc_s"]
    print(f"       a process on the worker's host (CacheClient, holding the bytes; best of 2): "
          f"reading the host cache file {mb / by_file:6.0f} MB/s | over the socket "
          f"{mb / by_socket:6.0f} MB/s ({by_socket / by_file:.2f}x the time)", flush=True)
    print(f"       a process fetching from the coordinator (CacheClient, holding the bytes; "
          f"best of 2): data plane {mb / by_data:6.0f} MB/s | over gRPC {mb / by_grpc:6.0f}"
          f" MB/s ({by_grpc / by_data:.2f}x the time); coordinator CPU per fetch "
          f"{row['coordinator_cpu_data_plane_s']:.2f} s against "
          f"{row['coordinator_cpu_grpc_s']:.2f} s", flush=True)
    if "stored_mb" in row:
        z, wz, wp = row["coordinator_zstd_s"], row["worker_warm_zstd_s"], row["worker_publish_s"]
        print(f"       publish through a worker {mb / wp:5.0f} MB/s "
              f"({row['publish_s'] / wp:.2f}x the direct plain publish); CPU "
              f"coordinator {row['publish_cpu_s'][0]:.2f} s, worker "
              f"{row['publish_cpu_s'][1]:.2f} s; peak RSS since start: coordinator "
              f"{row['peak_rss_after_publish_mb'][0]:.0f} MB, worker "
              f"{row['peak_rss_after_publish_mb'][1]:.0f} MB", flush=True)
        print(f"       stored as {row['stored_mb']:.0f} MB of zstd, fetched as stored: "
              f"coordinator {mb / z:7.0f} MB/s ({base / z * 100:3.0f}% of plain, "
              f"{direct / z:.2f}x the plain-data fetch) | worker warm {mb / wz:6.0f} "
              f"MB/s ({warm / wz:.2f}x)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1024, 2048])
    ap.add_argument("--compressible", action="store_true",
                    help="artifacts that compress ~10x (as executables do), not random bytes")
    args = ap.parse_args()
    stack = Stack(Path(tempfile.mkdtemp(prefix="cc-fetch-")))
    rows = []
    try:
        coord, cproc = stack.coordinator()
        worker, wproc = stack.worker(coord, "w")
        # The same, its downloads over gRPC only: what the data plane changes for a worker.
        worker_grpc, _ = stack.worker(coord, "g", extra=("--data-plane", "false"))
        servers = {"coord": coord, "cproc": cproc, "worker": worker, "wproc": wproc,
                   "worker_grpc": worker_grpc}
        for mb in args.sizes_mb:
            rows.append(_measure(stack, servers, mb, args.compressible))
            _print(rows[-1])
    finally:
        stack.close()
    print(json.dumps(rows))

if __name__ == "__main__":
    main()
