"""Faults: etcd members killed, quorum lost and regained, the coordinator
SIGKILLed during publishes, flipped bytes on disk."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, wait_until_healthy

from .conftest import CALL_ERRORS, LoopThread, Running, eventually, free_port, status_code

pytestmark = pytest.mark.slow


class EtcdCluster:
    """Three etcd members on loopback: a real cluster."""

    def __init__(self, root: Path, n: int = 3) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.members = [(f"m{i}", free_port(), free_port()) for i in range(n)]
        self.initial = ",".join(f"{name}=http://127.0.0.1:{peer}" for name, _, peer in self.members)
        self.procs: dict[str, subprocess.Popen] = {}
        for name, _, _ in self.members:
            self.start(name)
        self.wait_healthy()

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{client}" for _, client, _ in self.members)

    def start(self, name: str) -> None:
        _, client, peer = next(m for m in self.members if m[0] == name)
        log = open(self.root / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            ["etcd", "--name", name, "--data-dir", str(self.root / name),
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", self.initial, "--initial-cluster-state", "new",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = subprocess.run(["etcdctl", "--endpoints", self.endpoints, "endpoint", "health"],
                               capture_output=True, text=True, env=dict(os.environ,
                                                                        ETCDCTL_API="3"))
            if r.returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError("etcd cluster not healthy")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def cluster(tmp_path):
    c = EtcdCluster(tmp_path / "etcd")
    yield c
    c.stop()


@pytest.fixture
def cluster_coordinator(cluster, tmp_path):
    from compilecast.config import CoordinatorConfig
    from compilecast.coordinator.server import Coordinator

    lt = LoopThread()
    cfg = CoordinatorConfig(listen=f"127.0.0.1:{free_port()}", etcd_endpoints=cluster.endpoints,
                            store_dir=str(tmp_path / "store"), metrics_port=0, lease_ttl_s=5,
                            allow_unauthenticated=True)
    r = Running(lt, Coordinator(cfg))
    yield r
    r.stop()
    lt.close()


def _roundtrip(target: str, i: int) -> None:
    c = CacheClient(target, timeout_s=15)
    try:
        data = f"artifact-{i}".encode() * 1000
        resp = c.acquire(f"burst-{i}")
        assert resp.decision == pb.COMPILE, resp
        c.publish(f"burst-{i}", resp.lease, data, 1.0)
        assert c.acquire(f"burst-{i}").decision == pb.HIT
        assert c.fetch(f"burst-{i}")[1] == data
    finally:
        c.close()


def test_member_killed_during_a_burst_fails_no_operation(cluster, cluster_coordinator):
    target = cluster_coordinator.cfg.listen
    errors: list[BaseException] = []
    done: list[int] = []

    def worker(start: int) -> None:
        for i in range(start, start + 25):
            try:
                _roundtrip(target, i)
                done.append(i)
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    eventually(lambda: len(done) >= 4 or errors, "the burst under way")
    cluster.kill("m0")
    for t in threads:
        t.join(120)
    assert errors == []


def test_quorum_lost_falls_back_locally_then_recovers(cluster, cluster_coordinator):
    target = cluster_coordinator.cfg.listen
    c = CacheClient(target, timeout_s=30)
    _roundtrip(target, 1)
    cluster.kill("m1")
    cluster.kill("m2")
    resp = c.acquire("during-outage")  # answered, within the client's deadline
    assert resp.decision == pb.COMPILE_LOCALLY and "etcd" in resp.reason
    assert cluster_coordinator.registry.get_sample_value(  # what the alert watches
        "compilecast_coordinator_etcd_unavailable_total") == 1
    for name in ("m1", "m2"):
        cluster.start(name)
    cluster.wait_healthy()
    deadline = time.monotonic() + 30
    while True:  # no restart of the coordinator: it reconnects by itself
        resp = c.acquire("after-outage")
        if resp.decision == pb.COMPILE or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert resp.decision == pb.COMPILE
    c.close()


def test_coordinator_sigkill_during_publishes_loses_nothing_acknowledged(etcd, tmp_path):
    port = free_port()
    args = [sys.executable, "-m", "compilecast.cli", "coordinator", "--listen",
            f"127.0.0.1:{port}", "--etcd-endpoints", etcd.endpoint, "--etcd-prefix",
            f"/kill-{port}", "--store-dir", str(tmp_path / "store"), "--metrics-port", "0",
            "--allow-unauthenticated", "true",
            "--publish-stream-readers", "1"]  # a waiter is told when an upload begins
    target = f"127.0.0.1:{port}"
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until_healthy(target, 30)
    acked: dict[str, bytes] = {}
    stop = threading.Event()

    def publisher(k: int) -> None:
        c = CacheClient(target, timeout_s=5)
        i = 0
        while not stop.is_set():
            key = f"p{k}-{i}"
            data = os.urandom(3 << 20)  # 3 MiB: several chunks, in flight at the kill
            try:
                resp = c.acquire(key)
                if resp.decision == pb.COMPILE:
                    c.publish(key, resp.lease, data, 1.0)
                    acked[key] = data
            except CALL_ERRORS:
                pass
            i += 1
        c.close()

    threads = [threading.Thread(target=publisher, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    # One publish surely in flight at the kill: its header and first MiB sent,
    # the rest held back until after the kill.
    held = _held_publish(target, stop)
    eventually(lambda: len(acked) >= 3, "publishes acknowledged before the kill", 60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stop.set()
    for t in threads:
        t.join(30)
    assert held.exception(timeout=30) is not None  # cut off by the kill, never acknowledged

    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(target, 30)
        c = CacheClient(target, timeout_s=10)
        for key, data in acked.items():
            assert c.fetch(key)[1] == data
        assert c.acquire("held").decision != pb.HIT  # the cut publish left no artifact
        # Nothing half-written is visible: every blob in the store verifies.
        store = tmp_path / "store"
        assert list((store / "tmp").iterdir()) == []
        from compilecast.blobstore import DiskBlobStore

        blobs = DiskBlobStore(store)
        for path in (store / "blobs").glob("*/*.zst"):
            digest = path.name.removesuffix(".zst")
            assert hashlib.sha256(blobs.read_bytes(digest)).hexdigest() == digest
        c.close()
    finally:
        proc.terminate()
        proc.wait(10)


def _held_publish(target: str, stop: threading.Event) -> grpc.Future:
    """A Publish of "held" whose header and first MiB are sent and whose rest
    waits for `stop`; returned once the coordinator has begun the upload (a
    waiter of the key is told so)."""
    holder, waiter = CacheClient(target, timeout_s=10), CacheClient(target, timeout_s=10)
    lease = holder.acquire("held").lease
    data = os.urandom(8 << 20)
    header = pb.PublishHeader(key="held", lease=lease, size=len(data),
                              digest=hashlib.sha256(data).hexdigest(),
                              requester=holder.identity.requester())

    def chunks():
        yield pb.PublishChunk(header=header)
        yield pb.PublishChunk(data=data[:1 << 20])
        stop.wait(60)
        yield pb.PublishChunk(data=data[1 << 20:])

    call = holder.stub.Publish.future(chunks(), timeout=120)
    event = waiter.wait("held", 30, publishing=True)
    assert event.decision == pb.WAIT, event  # the upload began
    return call


def test_flipped_bytes_are_detected_never_served_and_counted(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    c = CacheClient(coordinator.cfg.listen)
    data = os.urandom(1 << 20)
    c.publish("k", c.acquire("k").lease, data, 1.0)
    path = coordinator.store.path_of(hashlib.sha256(data).hexdigest())
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    via_worker = CacheClient(worker.target)
    with pytest.raises(CALL_ERRORS) as info:
        via_worker.fetch("k")
    assert status_code(info.value) == grpc.StatusCode.DATA_LOSS
    assert coordinator.registry.get_sample_value(
        "compilecast_coordinator_corrupt_blobs_total") == 1
    assert worker.cache.lookup("host", "k") is None  # nothing unverified reached the host cache
    # The entry is gone, so the next process recompiles instead of failing again.
    assert via_worker.acquire("k").decision == pb.COMPILE


def test_the_run_that_finds_both_copies_corrupt_compiles_and_republishes(coordinator,
                                                                         start_worker):
    """The host's copy and the coordinator's are both bad: the process that
    finds them so is the one granted the compile, and its publish replaces
    them; the next process hits the new bytes."""
    import jax

    from compilecast.worker.jaxdoor.jax_integration import CompilecastCache

    from .conftest import flip_middle_byte

    worker = start_worker(coordinator.cfg.listen, store_reverify_s=0)
    c = CacheClient(coordinator.cfg.listen)
    data = os.urandom(1 << 20)
    c.publish("k", c.acquire("k").lease, data, 1.0)
    digest = hashlib.sha256(data).hexdigest()
    assert CacheClient(worker.target).fetch("k")[1] == data  # now in the host cache too
    flip_middle_byte(coordinator.store.path_of(digest))
    flip_middle_byte(worker.cache.store.path_of(digest))
    cache = CompilecastCache(worker.target)
    with cache.acquiring("k"):
        assert cache.get("k") is None  # a miss, under this process's lease
    assert cache.stats.compiles == 1 and cache.stats.fallbacks == 0, cache.stats
    fresh = os.urandom(1 << 20)
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        cache.compile("k", "jit_f", False, run=lambda: "executable",
                      serialize=lambda executable, seconds: fresh)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
    assert cache.stats.published == 1, cache.stats
    assert CacheClient(worker.target).fetch("k")[1] == fresh
    cache.client.close()


def test_the_scrub_finds_a_corrupt_blob_nobody_reads(start_coordinator):
    """A blob nobody asks for (a stored recipe, a cold artifact) is verified
    in the background: a corrupt one is quarantined and counted, and its key
    compiles again when next asked for."""
    from .conftest import flip_middle_byte

    coordinator = start_coordinator(scrub_bytes_per_s=1 << 30, store_scan_s=0.2)
    c = CacheClient(coordinator.cfg.listen)
    data = os.urandom(1 << 20)
    c.publish("k", c.acquire("k").lease, data, 1.0)
    flip_middle_byte(coordinator.store.path_of(hashlib.sha256(data).hexdigest()))
    # The pass counts the corrupt blob as it finds it, and the blobs it
    # checked when it ends: each is awaited, neither read beside the other.
    eventually(lambda: coordinator.registry.get_sample_value(
        "compilecast_coordinator_corrupt_blobs_total") == 1, "the scrub finds it", 30.0)
    eventually(lambda: (coordinator.registry.get_sample_value(
        "compilecast_coordinator_scrubbed_blobs_total") or 0) >= 1, "the pass ends", 30.0)
    assert c.acquire("k").decision == pb.COMPILE
    c.close()


def test_a_host_cache_removed_under_a_running_worker_is_made_again(coordinator, start_worker):
    """`rm -rf` of the host cache while the worker runs (an operator freeing a
    disk): the next fetch downloads into a cache made again, at once, and
    status still answers."""
    import shutil

    worker = start_worker(coordinator.cfg.listen)
    c = CacheClient(coordinator.cfg.listen)
    data = os.urandom(1 << 20)
    c.publish("k", c.acquire("k").lease, data, 1.0)
    via_worker = CacheClient(worker.target, timeout_s=10, stall_s=10)  # a stalled fill fails
    assert via_worker.fetch("k")[1] == data
    shutil.rmtree(worker.cache.root)

    assert via_worker.fetch("k")[1] == data
    assert worker.cache.lookup("host", "k") is not None  # kept again
    assert via_worker.status().host_disk_free_bytes > 0


def test_a_host_cache_that_cannot_keep_a_download_serves_it_without_a_copy(
        coordinator, start_worker):
    """A host cache that cannot take a download (here the directory of its
    partial files became a file): the fetch is served at once from the
    coordinator's stream, verified, without a copy, and counted; a fix of
    the directory is used by the next download."""
    worker = start_worker(coordinator.cfg.listen)
    c = CacheClient(coordinator.cfg.listen)
    data = os.urandom(1 << 20)
    c.publish("k", c.acquire("k").lease, data, 1.0)
    tmp = worker.cache.store.tmp_dir
    tmp.rmdir()
    tmp.write_bytes(b"not a directory")
    via_worker = CacheClient(worker.target, timeout_s=10, stall_s=10)  # a stalled fill fails
    for _ in range(2):
        assert via_worker.fetch("k")[1] == data
    assert worker.cache.lookup("host", "k") is None
    assert worker.metrics.registry.get_sample_value("compilecast_worker_uncached_total") == 2
    assert not worker.parts.fetches.fills
    tmp.unlink()
    assert via_worker.fetch("k")[1] == data
    assert worker.cache.lookup("host", "k") is not None


def _etcdctl_put(etcd, key: bytes, value: str) -> None:
    put = subprocess.run(["etcdctl", f"--endpoints={etcd.endpoint}", "put", key.decode(), value],
                         capture_output=True, text=True, timeout=30,
                         env={**os.environ, "ETCDCTL_API": "3"})
    assert put.returncode == 0, put.stderr


def test_an_unreadable_index_entry_is_dropped_and_the_key_compiles_again(coordinator, etcd):
    """An index entry that is not ours to read (an operator's `etcdctl put`,
    a damaged value): listing skips it, and the key is a miss that compiles
    and publishes again, instead of INTERNAL on every call for it."""
    from compilecast.coordinator.records import scope

    c = CacheClient(coordinator.cfg.listen)
    for k in ("k", "other"):
        c.publish(k, c.acquire(k, components={"program": k}, program_name=f"jit_{k}").lease,
                  k.encode() * 100, 1.0)
    _etcdctl_put(etcd, coordinator.state.view.k("a", scope("default", "k")), "not json{")
    _etcdctl_put(etcd, coordinator.state.view.k("k", scope("default", "other")), "[]")
    assert c.describe("other").artifact.size == 500  # its record unreadable, its entry not
    deadline = time.monotonic() + 10  # the watch forgets what it remembered of the entry
    while coordinator.state.view.cached_artifact(scope("default", "k")) is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)

    assert [a.artifact.key for a in c.list_artifacts()] == ["other"]
    with pytest.raises(CALL_ERRORS) as info:
        c.fetch("k")
    assert status_code(info.value) == grpc.StatusCode.NOT_FOUND
    again = c.acquire("k")
    assert again.decision == pb.COMPILE, again
    c.publish("k", again.lease, b"recompiled", 1.0)
    assert c.fetch("k")[1] == b"recompiled"



@pytest.mark.parametrize("kind", ["l", "x", "h"])
def test_an_unreadable_claim_record_is_dropped(coordinator, etcd, kind):
    """The same for a key's compile lease, compile-locally and hedge records:
    a decision on the key goes on (COMPILE) instead of failing."""
    from compilecast.coordinator.records import scope

    _etcdctl_put(etcd, coordinator.state.view.k(kind, scope("default", "k")), "[1, 2")
    c = CacheClient(coordinator.cfg.listen)
    assert c.status().upstream_healthy  # status reads every compile lease record too
    first = c.acquire("k")
    assert first.decision == pb.COMPILE, first
    c.publish("k", first.lease, b"bytes", 1.0)
    assert c.fetch("k")[1] == b"bytes"



def test_an_index_entry_with_fields_of_a_newer_replica_is_read_not_dropped(coordinator, etcd):
    """In a rolling upgrade a newer replica may write fields this one does not
    know: its entries are read (unknown fields ignored), never dropped as
    unreadable."""
    import json

    from compilecast.coordinator.records import scope

    c = CacheClient(coordinator.cfg.listen)
    c.publish("k", c.acquire("k").lease, b"bytes" * 100, 1.0)
    entry = coordinator.state.view.k("a", scope("default", "k"))
    raw = subprocess.run(["etcdctl", f"--endpoints={etcd.endpoint}", "get", entry.decode(),
                          "--print-value-only"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "ETCDCTL_API": "3"}).stdout.strip()
    _etcdctl_put(etcd, entry, json.dumps({**json.loads(raw), "from_the_future": [1]}))
    coordinator.state.view.index.clear()  # read from etcd, not from what the watch remembered
    hit = CacheClient(coordinator.cfg.listen).acquire("k")
    assert hit.decision == pb.HIT and hit.artifact.size == 500, hit
