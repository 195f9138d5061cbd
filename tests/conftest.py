"""Fixtures: a real etcd on loopback, real coordinator and worker servers.

etcd is one process per test session; every test gets its own key prefix, so
tests never see each other's state. Servers run on their own asyncio loop in
a background thread and speak real gRPC on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from compilecast.config import CoordinatorConfig, WorkerConfig
from compilecast.errors import CompilecastError
from compilecast.launch import free_port


def eventually(predicate, what: str = "condition", seconds: float = 10.0):
    """Poll `predicate` until it returns something true (returned); fail the
    test after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"not within {seconds} s: {what}")


async def until(predicate, what: str = "condition", seconds: float = 10.0) -> None:
    """Await a change of the event loop's own state: give the loop's other
    tasks their turn until `predicate()` holds (never a fixed pause)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def client(target: str, **ident):
    """A CacheClient, as the process `ident` (Identity's fields) where given."""
    from compilecast.worker.inprocess.client import CacheClient, Identity

    return CacheClient(target, identity=Identity(**ident) if ident else None)


# What a refused call raises: gRPC's error through a raw stub, compilecast's
# own through a CacheClient (its one gRPC edge, compilecast/rpcedge.py).
CALL_ERRORS = (grpc.RpcError, CompilecastError)


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status a refused call ended with, whichever of CALL_ERRORS it raised."""
    if isinstance(exc, CompilecastError):
        return grpc.StatusCode[exc.status.name]
    assert isinstance(exc, grpc.RpcError)
    return exc.code()


def details_of(exc: BaseException) -> str:
    if isinstance(exc, CompilecastError):
        return str(exc)
    return exc.details() or ""


def code_of(fn) -> tuple:
    """The gRPC status code and details `fn()` is refused with."""
    with pytest.raises(CALL_ERRORS) as info:
        fn()
    return status_code(info.value), details_of(info.value)


def cc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`compilecast ARGS...` in a child process, its output captured."""
    return subprocess.run([sys.executable, "-m", "compilecast.cli", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def key_recorded(client, key: str) -> bool:
    """Whether the coordinator has recorded `key`'s components (it does in
    the background, some tenths of a second after its COMPILE)."""
    from compilecast.errors import NotFound

    try:
        return bool(client.describe(key).key_components)
    except NotFound:  # not seen yet
        return False


def publish(client, key: str, data: bytes, **acquire_kw):
    """Claim `key` (it must be a miss: COMPILE) and publish `data` under it."""
    from compilecast.v1 import cache_pb2 as pb

    resp = client.acquire(key, **acquire_kw)
    assert resp.decision == pb.COMPILE, resp
    return client.publish(key, resp.lease, data, 3.0)


def recv_exactly(s, n: int) -> bytes:
    """`n` bytes from socket `s`; fails the test when it closes first."""
    out = b""
    while len(out) < n:
        piece = s.recv(n - len(out))
        assert piece, f"closed after {len(out)} of {n} bytes"
        out += piece
    return out


def sample(server, name: str, **labels) -> float:
    """A metric of a server started in this process (0 when never counted)."""
    return server.registry.get_sample_value(name, labels) or 0.0


def flip_middle_byte(path, mask: int = 0xFF) -> None:
    """Change one byte in the middle of a stored file, in place (same inode)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ mask]))


def all_at_once(calls, timeout_s: float = 60.0) -> list:
    """Run each of `calls` on a thread of its own, started together; their
    results, in order (None for one that did not finish in time)."""
    out: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def one(i: int) -> None:
        start.wait()
        out[i] = calls[i]()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out


@contextlib.contextmanager
def slow_counted_reads(state):
    """Within the block, the coordinator state's etcd reads (get_many) answer
    50 ms late (a slow etcd: concurrent callers arrive while a read is in
    flight) and record the first key of each read in the yielded list."""
    reads: list[bytes] = []
    real = state.etcd.get_many

    async def get_many(keys):
        reads.append(keys[0])
        await asyncio.sleep(0.05)
        return await real(keys)

    state.etcd.get_many = get_many
    try:
        yield reads
    finally:
        del state.etcd.get_many


class EtcdProcess:
    def __init__(self, data_dir: Path, *extra_args: str) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(binary):
            pytest.fail("etcd is not installed: run `make install` (installs etcd-server)")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.log = open(data_dir / "etcd.log", "wb")
        self.proc = subprocess.Popen(
            [binary, "--name", "test", "--data-dir", str(data_dir / "data"),
             "--listen-client-urls", f"http://{self.endpoint}",
             "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}", *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.client_port)) == 0:
                    return
            time.sleep(0.05)
        self.stop()
        pytest.fail("etcd did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(autouse=True)
def root_logging_restored() -> Iterator[None]:
    """A test that runs compilecast's CLI in this process (its main sets a
    handler and a level on the root logger) leaves the root logger as it
    found it: a handler on that test's captured stream, closed when it
    ends, would fail every later record. (pytest's own handlers come and go
    with each phase: left alone.)"""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def mlir_key_verdict() -> None:
    """The MLIR key self-test runs once, before any test: JAX processes the
    tests start find its verdict instead of each starting it in the background."""
    from compilecast.worker.keylib import mlircanon
    mlircanon.native_ready(wait=True)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path_factory.mktemp("etcd"))
    yield proc
    proc.stop()


class LoopThread:
    """An asyncio loop on a daemon thread; run coroutines on it from tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def settle() -> None:
            """What asyncio.run does before it closes its loop: cancel the
            tasks still pending (gRPC's readers of request iterators, say) and
            close the async generators, so that none is collected after the
            loop is closed (an unraisable error in whichever test runs then)."""
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)
            await self.loop.shutdown_asyncgens()

        with contextlib.suppress(Exception):
            self.run(settle(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS on loopback), its credentials
    in the environment while the module's tests run."""
    from .s3server import S3Server, restore, use_credentials

    server = S3Server(tmp_path_factory.mktemp("s3"))
    before = use_credentials(server)
    yield server
    restore(before)
    server.stop()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def prefix() -> str:
    return f"/compilecast-test/{uuid.uuid4().hex[:10]}"


def coordinator_config(etcd: EtcdProcess, tmp: Path, prefix: str, **kw) -> CoordinatorConfig:
    kw = {"allow_unauthenticated": True, "metrics_port": 0, **kw}
    return CoordinatorConfig(
        listen=kw.pop("listen", None) or f"127.0.0.1:{free_port()}",
        etcd_endpoints=etcd.endpoint, etcd_prefix=prefix, store_dir=str(tmp / "store"), **kw,
    )


class Running:
    """A Coordinator or Worker started on a LoopThread; attributes pass through."""

    def __init__(self, lt: LoopThread, server) -> None:
        self.lt = lt
        self.server = server
        lt.run(server.start())
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.lt.run(self.server.stop(2.0))

    def __getattr__(self, name: str):
        return getattr(self.server, name)


@pytest.fixture
def started(loop_thread):
    """start(server) runs a Coordinator or Worker until the test ends."""
    running: list[Running] = []

    def start(server):
        r = Running(loop_thread, server)
        running.append(r)
        return r

    yield start
    for r in running:
        r.stop()


@pytest.fixture
def start_coordinator(etcd, tmp_path, prefix, started):
    from compilecast.coordinator.server import Coordinator

    def start(store_dir: Path | None = None, **kw) -> Coordinator:
        # Port 0 unless asked: the port is the one the server bound, not one
        # free_port() saw free a moment before (another socket may take it
        # in between). cfg.listen names it once started, for clients and restarts.
        cfg = coordinator_config(etcd, tmp_path, prefix, **{"listen": "127.0.0.1:0", **kw})
        if store_dir is not None:
            cfg.store_dir = str(store_dir)
        running = started(Coordinator(cfg))
        if cfg.listen.endswith(":0"):
            cfg.listen = f"{cfg.listen.rpartition(':')[0]}:{running.port}"
        return running

    return start


@pytest.fixture
def coordinator(start_coordinator):
    return start_coordinator()


@pytest.fixture
def start_worker(tmp_path, started):
    from compilecast.worker.daemon.server import Worker

    def start(coordinator_addr: str, name: str = "w", **kw) -> Worker:
        sock = Path("/tmp") / f"cc-{uuid.uuid4().hex[:8]}.sock"
        cfg = WorkerConfig(**{"listen": f"unix://{sock}", "coordinator": coordinator_addr,
                              "cache_dir": str(tmp_path / f"hostcache-{name}"),
                              "metrics_port": 0, **kw})
        return started(Worker(cfg))

    return start


@pytest.fixture
def start_up(tmp_path):
    """Start `compilecast up` as a real subprocess (stopped at teardown)."""
    from .e2e import Up

    started: list = []

    def start(env: dict | None = None, name: str = "cc", *, no_tcp: bool = False):
        home = tmp_path / name
        home.mkdir()
        u = Up(home, env, no_tcp=no_tcp)
        started.append(u)  # stopped at teardown even when it never became healthy
        u.start()
        return u

    yield start
    for u in started:
        if u.proc is not None:
            u.stop()


@pytest.fixture
def up(start_up):
    return start_up()


# Bearer tokens of the security and relay tests: token -> (tenant, permissions).
TOKENS = {"a-pub": ("team-a", ["read", "publish"]), "a-read": ("team-a", ["read"]),
          "b-pub": ("team-b", ["read", "publish"]), "a-admin": ("team-a", ["read", "admin"]),
          "b-admin": ("team-b", ["read", "admin"]),
          "a-worker": ("team-a", ["read", "publish", "worker"])}


@pytest.fixture
def tokens_file(tmp_path) -> Path:
    import hashlib

    import yaml

    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": [
        {"name": tok, "sha256": hashlib.sha256(tok.encode()).hexdigest(), "tenant": tenant,
         "permissions": perms} for tok, (tenant, perms) in TOKENS.items()]}))
    return path
