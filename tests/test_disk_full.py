"""A volume that runs out of space (real etcd, real gRPC): the coordinator's
store makes room by evicting its least recently read artifacts and refuses
what still does not fit with RESOURCE_EXHAUSTED; a worker whose disk is full
still serves its processes, without keeping a copy.

Each store sits on a small volume of its own, a tmpfs, where mounting one is
allowed (root); elsewhere on the test's directory, where etcd writes too.
The room a store has is set with its min_free (what it keeps free on its
volume); a publish that runs out of space midway needs the tmpfs."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import grpc
import pytest

from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient

from .conftest import CALL_ERRORS, details_of, eventually, publish, status_code

MiB = 1 << 20


@pytest.fixture
def volume(tmp_path):
    """volume(path): a 64 MiB tmpfs mounted at `path` if this machine allows
    it (whether it does), unmounted at the end."""
    mounted: list[Path] = []

    def mount(path: Path) -> bool:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            mounted.append(path)
        return done.returncode == 0

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def room(store, nbytes: int) -> None:
    """Leave the store `nbytes` of its volume's free space; it keeps the rest free."""
    store.min_free = shutil.disk_usage(store.root).free - nbytes


def decision(client: CacheClient, key: str) -> int:
    resp = client.acquire(key)
    if resp.decision == pb.COMPILE:  # hand the claim back: the test only looks
        client.release(key, resp.lease, pb.ABANDONED)
    return resp.decision


def test_a_publish_makes_room_by_evicting_the_least_recently_read(
        start_coordinator, tmp_path, volume):
    volume(tmp_path / "store")
    coordinator = start_coordinator()
    c = CacheClient(coordinator.cfg.listen)
    blobs = {k: os.urandom(MiB) for k in ("old", "new")}
    for k in ("old", "new"):
        publish(c, k, blobs[k])
    os.utime(coordinator.store.path_of(hashlib.sha256(blobs["old"]).hexdigest()),
             (1_000_000, 1_000_000))
    room(coordinator.store, 3 * MiB // 2)
    big = os.urandom(2 * MiB)
    publish(c, "big", big)  # half a MiB short: "old" makes way
    assert decision(c, "old") == pb.COMPILE
    assert c.fetch("new")[1] == blobs["new"]
    assert c.fetch("big")[1] == big
    assert coordinator.registry.get_sample_value(
        "compilecast_coordinator_store_evictions_total") == 1


def test_a_publish_that_cannot_fit_is_refused_and_evicts_nothing(
        start_coordinator, tmp_path, volume):
    volume(tmp_path / "store")
    coordinator = start_coordinator()
    c = CacheClient(coordinator.cfg.listen)
    kept = os.urandom(MiB)
    publish(c, "kept", kept)
    room(coordinator.store, 2 * MiB)
    claim = c.acquire("huge")
    with pytest.raises(CALL_ERRORS) as err:
        c.publish("huge", claim.lease, os.urandom(16 * MiB), 1.0)
    assert status_code(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no room for 16777216 bytes" in details_of(err.value)
    assert c.fetch("kept")[1] == kept  # nothing was evicted for a hopeless publish
    assert list(coordinator.store.tmp_dir.iterdir()) == []
    assert coordinator.registry.get_sample_value(
        "compilecast_coordinator_publishes_total", {"outcome": "StoreFull"}) == 1
    # The holder still holds its claim: with room again, the same lease publishes.
    coordinator.store.min_free = 0
    data = os.urandom(3 * MiB)
    c.publish("huge", claim.lease, data, 1.0)
    assert c.fetch("huge")[1] == data


def test_a_volume_that_fills_during_a_publish_refuses_it_and_keeps_nothing(
        start_coordinator, tmp_path, volume):
    small_volume = tmp_path / "store"
    if not volume(small_volume):
        pytest.skip("needs a volume of its own to fill (mounting a tmpfs is not allowed here)")
    coordinator = start_coordinator()
    c = CacheClient(coordinator.cfg.listen)
    claim = c.acquire("k")
    data = os.urandom(6 * MiB)
    header = pb.PublishHeader(key="k", lease=claim.lease, size=len(data),
                              digest=hashlib.sha256(data).hexdigest(), compile_time_seconds=1.0,
                              requester=c.identity.requester())
    ballast = small_volume / "someone-elses-file"
    tmp = coordinator.store.tmp_dir

    def messages():
        yield pb.PublishChunk(header=header)
        yield pb.PublishChunk(data=data[:MiB])
        # The first MiB is on disk: the store found room and started writing.
        eventually(lambda: any(p.stat().st_size > MiB for p in tmp.iterdir()),
                   "the upload's first MiB on disk")
        with open(ballast, "wb", buffering=0) as f:  # someone else fills the volume
            try:
                while f.write(b"\0" * (64 << 10)):
                    pass
            except OSError:
                pass
        for off in range(MiB, len(data), MiB):
            yield pb.PublishChunk(data=data[off:off + MiB])

    stub = rpc.CompileCacheStub(grpc.insecure_channel(coordinator.cfg.listen))
    with pytest.raises(CALL_ERRORS) as err:
        stub.Publish(messages(), timeout=30)
    assert status_code(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "full" in details_of(err.value)
    assert list(tmp.iterdir()) == []  # the partial upload gave its space back
    ballast.unlink()
    c.publish("k", claim.lease, data, 1.0)  # nothing was lost: the holder publishes
    assert c.fetch("k")[1] == data


def test_a_worker_whose_disk_is_full_serves_without_keeping_a_copy(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen, cache_min_free_bytes=1 << 60)
    w = CacheClient(worker.target)
    data = os.urandom(3 * MiB)
    publish(CacheClient(coordinator.cfg.listen), "k", data)
    for _ in range(2):  # each time from the coordinator: nothing stays on this host
        assert w.fetch("k")[1] == data
    reg = worker.registry
    assert reg.get_sample_value("compilecast_worker_fetches_total",
                                {"source": "coordinator"}) == 2
    assert reg.get_sample_value("compilecast_worker_uncached_total") == 2
    assert worker.cache.store.count() == 0
    assert list(worker.cache.store.tmp_dir.iterdir()) == []
    st = w.status()  # what `compilecast status` shows
    assert st.host_uncached == 2 and st.host_cache_bytes == 0
    assert st.host_cache_min_free_bytes == 1 << 60 and st.host_disk_free_bytes > 0
    mine = os.urandom(2 * MiB)  # a publish through it still reaches the coordinator
    publish(w, "mine", mine)
    assert CacheClient(coordinator.cfg.listen).fetch("mine")[1] == mine
    assert worker.cache.store.count() == 0


def test_a_worker_makes_room_in_its_host_cache_for_a_download(
        coordinator, start_worker, tmp_path, volume):
    volume(tmp_path / "hostcache-w")
    worker = start_worker(coordinator.cfg.listen, cache_min_free_bytes=0)
    w = CacheClient(worker.target)
    c = CacheClient(coordinator.cfg.listen)
    blobs = {k: os.urandom(MiB) for k in ("a", "b", "c")}
    for k in ("a", "b"):
        publish(c, k, blobs[k])
        assert w.fetch(k)[1] == blobs[k]
    os.utime(worker.cache.store.path_of(hashlib.sha256(blobs["a"]).hexdigest()),
             (1_000_000, 1_000_000))
    publish(c, "c", blobs["c"])  # (the coordinator's store is on the same disk)
    room(worker.cache.store, MiB // 2)
    assert w.fetch("c")[1] == blobs["c"]  # "a" made way for it
    store = worker.cache.store
    assert [store.has(hashlib.sha256(blobs[k]).hexdigest()) for k in "abc"] == \
        [False, True, True]
    assert worker.registry.get_sample_value("compilecast_worker_uncached_total") == 0


def test_a_late_reader_of_a_download_kept_nowhere_gets_it_downloaded_again(
        coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen, cache_min_free_bytes=1 << 60)
    data = os.urandom(40 * MiB)  # 20 chunks: more than a reader's queue holds
    publish(CacheClient(coordinator.cfg.listen), "k", data)
    stub = rpc.CompileCacheStub(grpc.insecure_channel(worker.target))
    first = stub.Fetch(pb.FetchRequest(key="k"), timeout=60)
    head = [next(first), next(first)]  # the header and a chunk: the download is under way
    assert head[0].artifact.size == len(data) and head[1].data
    late = CacheClient(worker.target, timeout_s=60)
    result = []
    t = threading.Thread(target=lambda: result.append(late.fetch("k")[1]))
    t.start()
    eventually(lambda: worker.registry.get_sample_value(
        "compilecast_worker_fetches_total", {"source": "coordinator"}) == 2, "the late fetch")
    rest = b"".join(m.data for m in first)
    assert b"".join(m.data for m in head) + rest == data
    t.join(60)
    assert result == [data]
    assert worker.registry.get_sample_value("compilecast_worker_uncached_total") == 2


def test_a_worker_gives_its_disk_back_to_the_hosts_jobs(
        coordinator, start_worker, tmp_path, volume):
    volume(tmp_path / "hostcache-w")
    worker = start_worker(coordinator.cfg.listen, cache_min_free_bytes=0, cache_free_check_s=0.1)
    w = CacheClient(worker.target)
    c = CacheClient(coordinator.cfg.listen)
    blobs = {k: os.urandom(MiB) for k in ("a", "b", "c")}
    for age, k in enumerate(blobs):
        publish(c, k, blobs[k])
        assert w.fetch(k)[1] == blobs[k]
        os.utime(worker.cache.store.path_of(hashlib.sha256(blobs[k]).hexdigest()),
                 (1_000_000 + age, 1_000_000 + age))
    store = worker.cache.store
    room(store, -3 * MiB // 2)  # a job's files took the disk: 1.5 MiB short of what is kept free
    held = eventually(lambda: [store.has(hashlib.sha256(blobs[k]).hexdigest()) for k in "abc"]
                      if not store.has(hashlib.sha256(blobs["b"]).hexdigest()) else None,
                      "the cache giving way")
    assert held == [False, False, True]  # the two read longest ago, and no more
    assert w.fetch("c")[1] == blobs["c"]
