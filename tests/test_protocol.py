"""The decision protocol against a real etcd and real gRPC on loopback."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import grpc
import pytest

from compilecast.negotiate import Route
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.clientpublish import publish_messages

from .conftest import CALL_ERRORS, client, code_of, eventually, key_recorded, sample, status_code

DATA = b"executable-bytes" * 50_000


def in_thread(fn):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    return t, out


# -- first come, first served ------------------------------------------------

def test_first_compiles_second_waits_and_is_woken_by_publish(coordinator):
    a, b = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    first = a.acquire("k")
    assert first.decision == pb.COMPILE and first.lease.id > 0
    assert b.acquire("k").decision == pb.WAIT
    t, out = in_thread(lambda: b.wait("k", 30))
    eventually(lambda: sample(coordinator, "compilecast_coordinator_waiters") == 1, "b waiting")
    info = a.publish("k", first.lease, DATA, 2.5)
    t.join(10)
    assert out["v"].decision == pb.HIT
    assert out["v"].artifact.digest == hashlib.sha256(DATA).hexdigest()
    got_info, got = b.fetch("k")
    assert got == DATA and got_info.digest == info.digest
    assert a.acquire("k").decision == pb.HIT
    reg = coordinator.registry
    assert reg.get_sample_value("compilecast_coordinator_lookups_total", {"result": "hit"}) == 1
    assert reg.get_sample_value("compilecast_coordinator_saved_compile_seconds_total") == 5.0


def test_publish_is_write_once(coordinator):
    a = client(coordinator.cfg.listen)
    lease = a.acquire("k").lease
    a.publish("k", lease, DATA, 1.0)
    code, _ = code_of(lambda: a.publish("k", lease, b"other", 1.0))
    assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS)
    assert a.fetch("k")[1] == DATA


# -- release and expiry --------------------------------------------------------

def test_failed_compile_releases_waiters_at_once(coordinator):
    a, b = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    lease = a.acquire("k").lease
    t, out = in_thread(lambda: b.wait("k", 60))
    eventually(lambda: coordinator.registry.get_sample_value(
        "compilecast_coordinator_waiters") == 1, "the waiter is registered")
    a.release("k", lease, pb.COMPILE_FAILED, "boom")
    t.join(30)
    assert out["v"].decision == pb.COMPILE_LOCALLY
    assert "failed" in out["v"].reason  # the release's answer, not the wait's 60 s timeout
    assert out["v"].local_cause == pb.LOCAL_CAUSE_UNSPECIFIED  # a fault: worth a warning


@pytest.mark.parametrize("reason,cause", [(pb.BELOW_THRESHOLD, pb.LOCAL_CAUSE_BELOW_THRESHOLD),
                                          (pb.COMPILE_FAILED, pb.LOCAL_CAUSE_UNSPECIFIED),
                                          (pb.PUBLISH_REFUSED, pb.LOCAL_CAUSE_UNSPECIFIED)])
def test_a_compile_locally_says_whether_it_is_expected(coordinator, reason, cause):
    """Waiters and later askers are told an entry under the thresholds is not
    a fault (the JAX integration then logs it without a warning)."""
    a, b = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    lease = a.acquire("k").lease
    t, out = in_thread(lambda: b.wait("k", 60))
    eventually(lambda: sample(coordinator, "compilecast_coordinator_waiters") == 1, "b waiting")
    a.release("k", lease, reason, "detail")
    t.join(10)
    assert (out["v"].decision, out["v"].local_cause) == (pb.COMPILE_LOCALLY, cause)
    if reason == pb.PUBLISH_REFUSED:  # the waiters are told what was refused
        assert "refused the holder's executable (detail)" in out["v"].reason
    later = client(coordinator.cfg.listen).acquire("k")
    assert (later.decision, later.local_cause) == (pb.COMPILE_LOCALLY, cause)


def test_expired_holder_is_replaced_by_a_waiter(start_coordinator):
    coordinator = start_coordinator(lease_ttl_s=2)
    a, b = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    dead = a.acquire("k").lease  # never kept alive: the holder "died"
    t, out = in_thread(lambda: b.wait("k", 60))
    t.join(20)
    assert out["v"].decision == pb.COMPILE
    promoted = out["v"].lease
    assert code_of(lambda: a.publish("k", dead, DATA, 1.0))[0] == \
        grpc.StatusCode.FAILED_PRECONDITION
    b.publish("k", promoted, DATA, 1.0)
    assert a.fetch("k")[1] == DATA


def test_keepalive_holds_the_lease_past_its_ttl(start_coordinator):
    coordinator = start_coordinator(lease_ttl_s=2)
    a = client(coordinator.cfg.listen)
    lease = a.acquire("k").lease
    for _ in range(4):
        time.sleep(1)
        assert a.keepalive("k", lease) > 0
    a.publish("k", lease, DATA, 1.0)
    assert a.keepalive("k", lease) == 0


def test_wait_times_out_into_compile_locally(coordinator):
    a, b = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    a.keep_lease("k", a.acquire("k").lease)
    event = b.wait("k", 1.0)
    assert event.decision == pb.COMPILE_LOCALLY and "timeout" in event.reason


def test_a_bounded_store_evicts_the_least_recently_read_and_it_compiles_again(
        start_coordinator):
    coordinator = start_coordinator(store_max_bytes=3_100_000, max_artifact_bytes=1_000_000)
    a = client(coordinator.cfg.listen)
    blobs = {k: os.urandom(900_000) for k in ("k1", "k2", "k3", "k4")}
    for k in ("k1", "k2", "k3"):
        a.publish(k, a.acquire(k).lease, blobs[k], 1.0)
        time.sleep(0.05)  # distinct read times
    assert a.fetch("k1")[1] == blobs["k1"]  # read lately: k2 is now the least recent
    time.sleep(0.05)
    a.publish("k4", a.acquire("k4").lease, blobs["k4"], 1.0)  # 3.6 MB: over the bound
    reg = coordinator.registry
    assert reg.get_sample_value("compilecast_coordinator_store_evictions_total") == 1
    assert reg.get_sample_value("compilecast_coordinator_store_bytes") <= 2_700_100
    status = a.status()  # what `compilecast status` prints
    assert status.store_bytes == reg.get_sample_value("compilecast_coordinator_store_bytes")
    assert status.store_max_bytes == 3_100_000
    again = a.acquire("k2")  # its index entry is dropped: compiled and published again
    assert again.decision == pb.COMPILE
    a.publish("k2", again.lease, blobs["k2"], 1.0)
    for k in ("k1", "k2", "k3", "k4"):
        if k != "k3":
            assert a.fetch(k)[1] == blobs[k]
    assert a.acquire("k3").decision == pb.COMPILE  # evicted in turn, as the least recent


def test_replicas_sharing_a_store_hold_it_to_the_bound_together(start_coordinator, tmp_path):
    """Each replica counts only its own writes between scans: neither is
    over the bound, the directory is, and a scan evicts once, not once per
    replica."""
    shared = tmp_path / "shared-store"
    bound = dict(store_max_bytes=3_100_000, max_artifact_bytes=1_000_000, store_scan_s=0.2)
    one, two = (start_coordinator(store_dir=shared, **bound) for _ in range(2))
    for coordinator, keys in ((one, ("k1", "k2")), (two, ("k3", "k4"))):
        c = client(coordinator.cfg.listen)
        for k in keys:
            c.publish(k, c.acquire(k).lease, os.urandom(900_000), 1.0)
            time.sleep(0.05)

    def evictions() -> float:
        return sum(r.registry.get_sample_value("compilecast_coordinator_store_evictions_total")
                   for r in (one, two))

    eventually(lambda: evictions() >= 1, "a scan evicts")
    time.sleep(0.6)  # both replicas scan again meanwhile
    assert evictions() == 1
    assert sum(p.stat().st_size for p in (shared / "blobs").glob("*/*.zst")) <= 2_790_000
    c = client(one.cfg.listen)
    assert c.acquire("k1").decision == pb.COMPILE  # the least recently read went
    assert [c.acquire(k).decision for k in ("k2", "k3", "k4")] == [pb.HIT] * 3


# -- jobs ----------------------------------------------------------------------

def test_designated_process_compiles_others_wait(coordinator):
    target = coordinator.cfg.listen
    p1 = client(target, job="j1", process_id=1, designated_process=0)
    p0 = client(target, job="j1", process_id=0, designated_process=0)
    assert p1.acquire("k").decision == pb.WAIT  # arrived first, still waits
    resp = p0.acquire("k")
    assert resp.decision == pb.COMPILE
    t, out = in_thread(lambda: p1.wait("k", 30))
    p0.publish("k", resp.lease, DATA, 1.0)
    t.join(10)
    assert out["v"].decision == pb.HIT


# -- replicas and the worker ---------------------------------------------------

def test_publish_on_one_replica_wakes_a_waiter_on_another(start_coordinator, tmp_path):
    shared = tmp_path / "shared-store"
    r1, r2 = start_coordinator(store_dir=shared), start_coordinator(store_dir=shared)
    a, b = client(r1.cfg.listen), client(r2.cfg.listen)
    lease = a.acquire("k").lease
    assert b.acquire("k").decision == pb.WAIT
    t, out = in_thread(lambda: b.wait("k", 30))
    eventually(lambda: sample(r2, "compilecast_coordinator_waiters") == 1, "b waiting on r2")
    a.publish("k", lease, DATA, 1.0)
    t.join(10)
    assert out["v"].decision == pb.HIT
    assert b.fetch("k")[1] == DATA


def test_worker_serves_host_hits_after_the_coordinator_is_gone(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    c = client(worker.target)
    lease = c.acquire("k").lease
    c.publish("k", lease, DATA, 3.0)
    # Stop the coordinator: the host cache still answers.
    coordinator.stop()
    resp = c.acquire("k")
    assert resp.decision == pb.HIT
    assert c.fetch("k")[1] == DATA
    assert worker.registry.get_sample_value("compilecast_worker_lookups_total",
                                            {"result": "host_hit"}) == 1
    # A miss with the coordinator gone: compile locally, answered by the worker
    # within the client's own deadline.
    miss = c.acquire("other")
    assert miss.decision == pb.COMPILE_LOCALLY and "unreachable" in miss.reason


def test_worker_fills_its_cache_once_for_many_readers(coordinator, start_worker):
    direct = client(coordinator.cfg.listen)
    direct.publish("k", direct.acquire("k").lease, DATA, 1.0)
    worker = start_worker(coordinator.cfg.listen)
    readers = [in_thread(lambda: client(worker.target).fetch("k")[1]) for _ in range(6)]
    for t, out in readers:
        t.join(20)
        assert out["v"] == DATA
    # One copy left the coordinator, as it stores it: the worker takes zstd.
    stored = coordinator.store.path_of(hashlib.sha256(DATA).hexdigest()).stat().st_size
    assert stored < len(DATA) / 10
    reg = coordinator.registry
    assert reg.get_sample_value("compilecast_coordinator_artifact_bytes_total",
                                {"direction": "out"}) == stored


def test_artifacts_travel_as_stored_zstd_to_clients_that_decode_it(coordinator, start_worker):
    """A blob stored as zstd goes out as it is stored (executables compress
    ~10x, and so do the bytes on the wire): from the coordinator to a
    process, into a worker's host cache, and from there to its processes (as
    the download arrives, and later from the host cache). Each arrives whole
    and verified; a client that does not ask for zstd
    (the plain generated stubs) gets plain data."""
    data = b"".join(os.urandom(64) + b"\x00" * 448 for _ in range(4096))  # 2 MiB, ~8x
    digest = hashlib.sha256(data).hexdigest()
    direct = client(coordinator.cfg.listen)
    direct.publish("k", direct.acquire("k").lease, data, 1.0)
    stored = coordinator.store.path_of(digest).stat().st_size
    assert stored < len(data) / 4

    def out() -> float:
        return coordinator.registry.get_sample_value(
            "compilecast_coordinator_artifact_bytes_total", {"direction": "out"}) or 0.0

    assert direct.fetch("k")[1] == data
    assert out() == stored
    worker = start_worker(coordinator.cfg.listen)
    process = client(worker.target)
    assert process.fetch("k")[1] == data  # the worker's download, passed on as it came
    assert out() == 2 * stored
    # Kept as it came: the coordinator's stream, not compressed again.
    assert (worker.cache.store.path_of(digest).read_bytes()
            == coordinator.store.path_of(digest).read_bytes())
    def served() -> float:
        return worker.registry.get_sample_value("compilecast_worker_artifact_bytes_total",
                                                {"direction": "served"})

    assert process.fetch("k")[1] == data  # a host-cache hit, read from the file (as stored)
    assert served() == stored
    process.routes.off(Route.LOCAL_FILE, "the test reads over the socket")
    assert process.fetch("k")[1] == data  # a host-cache hit over the socket, sent as stored
    assert out() == 2 * stored
    assert served() == 2 * stored
    for target in (coordinator.cfg.listen, worker.target):
        with grpc.insecure_channel(target) as channel:
            chunks = list(rpc.CompileCacheStub(channel).Fetch(pb.FetchRequest(key="k")))
        assert b"".join(c.data for c in chunks) == data
        assert not any(c.zstd_data for c in chunks)


def test_a_worker_publishes_compressed_to_a_coordinator_that_takes_zstd(
        coordinator, start_worker):
    """Through a worker, a compressible publish goes up as a zstd stream made
    once, on the holder's host: the coordinator stores it as it came, and so
    does the host cache. An incompressible one goes up as data."""
    worker = start_worker(coordinator.cfg.listen)
    process = client(worker.target)

    def received() -> float:
        return coordinator.registry.get_sample_value(
            "compilecast_coordinator_artifact_bytes_total", {"direction": "in"}) or 0.0

    data = b"".join(os.urandom(64) + b"\x00" * 448 for _ in range(8192))  # 4 MiB, ~8x
    digest = hashlib.sha256(data).hexdigest()
    claim = process.acquire("k")
    process.publish("k", claim.lease, data, 1.0)
    stream = coordinator.store.path_of(digest).read_bytes()
    assert len(stream) < len(data) / 4
    assert received() == len(stream)
    assert worker.cache.store.path_of(digest).read_bytes() == stream
    assert client(coordinator.cfg.listen).fetch("k")[1] == data
    noise = os.urandom(3 << 20)
    process.publish("n", process.acquire("n").lease, noise, 1.0)
    assert received() == len(stream) + len(noise)
    assert client(coordinator.cfg.listen).fetch("n")[1] == noise


def test_a_worker_forwards_a_digest_sent_last(coordinator, start_worker):
    """The lease a process gets through its worker says the digest may come
    last; the worker sends it on last, compressed or not, and keeps the
    verified blob. A wrong one is refused by the coordinator and kept by
    neither store."""
    worker = start_worker(coordinator.cfg.listen)
    process = client(worker.target)
    for key, data in (("z", b"".join(os.urandom(64) + b"\x00" * 448 for _ in range(8192))),
                      ("r", os.urandom(3 << 20))):
        lease = process.acquire(key).lease
        assert lease.takes_digest_last
        digest = hashlib.sha256(data).hexdigest()
        assert process.publish(key, lease, data, 1.0).digest == digest
        assert worker.cache.store.has(digest) and coordinator.store.has(digest)
        assert client(coordinator.cfg.listen).fetch(key)[1] == data
    data = os.urandom(2 << 20)
    lease = process.acquire("bad").lease
    msgs = list(publish_messages(pb.PublishHeader(key="bad", lease=lease, size=len(data)), data))
    msgs[-1] = pb.PublishChunk(digest="0" * 64)
    code, details = code_of(lambda: process.stub.Publish(iter(msgs), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "digest mismatch" in details, details
    digest = hashlib.sha256(data).hexdigest()
    assert not worker.cache.store.has(digest) and not coordinator.store.has(digest)


def test_a_publish_whose_zstd_is_not_the_artifact_is_refused(coordinator):
    """The coordinator decodes what it stores: a stream that does not decode,
    or decodes to other bytes than the header says, is refused and nothing
    is stored or indexed."""
    import zstandard

    direct = client(coordinator.cfg.listen)
    stub = rpc.CompileCacheStub(grpc.insecure_channel(coordinator.cfg.listen))
    data = b"x" * 100_000
    cases = {"garbage": b"not a zstd stream" * 100,
             "longer": zstandard.ZstdCompressor().compress(data + b"more"),
             "other": zstandard.ZstdCompressor().compress(b"y" * 100_000)}
    for name, stream in cases.items():
        lease = direct.acquire(f"bad-{name}").lease
        header = pb.PublishHeader(key=f"bad-{name}", lease=lease, size=len(data),
                                  digest=hashlib.sha256(data).hexdigest())
        with pytest.raises(CALL_ERRORS) as err:
            stub.Publish(iter([pb.PublishChunk(header=header),
                               pb.PublishChunk(zstd_data=stream)]), timeout=10)
        assert status_code(err.value) == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value)
        assert not coordinator.store.has(hashlib.sha256(data).hexdigest())
        assert direct.acquire(f"bad-{name}").decision != pb.HIT


# -- explaining misses -----------------------------------------------------------

def test_misses_are_counted_by_the_component_that_differed(coordinator):
    c = client(coordinator.cfg.listen)
    base = {"program": "p1", "compile_options": "o1", "platform": "cpu"}
    assert c.acquire("k1", components=base, program_name="jit_step").decision == pb.COMPILE
    changed = dict(base, compile_options="o2")
    assert c.acquire("k2", components=changed, program_name="jit_step").decision == pb.COMPILE
    reg = coordinator.registry

    def count(component):
        return reg.get_sample_value("compilecast_coordinator_misses_by_component_total",
                                    {"component": component})

    deadline = time.monotonic() + 10
    while count("compile_options") is None and time.monotonic() < deadline:
        time.sleep(0.05)  # recorded in the background
    assert count("new_program") == 1
    assert count("compile_options") == 1
    assert count("program") is None
    d = c.describe("k2")
    assert d.program_name == "jit_step" and dict(d.key_components) == changed


def test_malformed_key_components_are_invalid_argument(coordinator):
    c = client(coordinator.cfg.listen)
    for comps, name in (({"Bad Name": "x"}, ""), ({f"c{i}": "x" for i in range(40)}, ""),
                        ({"program": "x" * 200}, ""), ({}, "name with spaces")):
        code, _ = code_of(lambda comps=comps, name=name:
                          c.acquire("k", components=comps, program_name=name))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: c.describe("never-seen"))[0] == grpc.StatusCode.NOT_FOUND


def test_a_holder_far_past_the_expected_compile_time_is_hedged(start_coordinator):
    coordinator = start_coordinator(hedge_factor=2.0, hedge_min_s=1.0)
    holder, waiter = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    # History: an earlier version of the same program compiled in 0.2 s.
    first = holder.acquire("v1", components={"program": "p1"}, program_name="jit_step")
    eventually(lambda: key_recorded(holder, "v1"), "v1 recorded")  # its program name's history
    holder.publish("v1", first.lease, DATA, 0.2)
    slow = holder.acquire("v2", components={"program": "p2"}, program_name="jit_step").lease
    holder.keep_lease("v2", slow)  # alive, but stuck compiling
    event = waiter.wait("v2", 60)
    assert event.decision == pb.COMPILE and "first publish wins" in event.reason
    mine = b"hedged" * 1000
    waiter.publish("v2", event.lease, mine, 0.3)
    code, _ = code_of(lambda: holder.publish("v2", slow, DATA, 9.0))
    assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS)
    assert holder.fetch("v2")[1] == mine
    assert coordinator.registry.get_sample_value("compilecast_coordinator_compiles_total",
                                                 {"how": "hedge"}) == 1


def test_no_hedge_without_a_known_compile_time(start_coordinator):
    coordinator = start_coordinator(hedge_factor=2.0, hedge_min_s=0.5)
    holder, waiter = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    lease = holder.acquire("new", components={"program": "p"}, program_name="jit_new").lease
    holder.keep_lease("new", lease)
    event = waiter.wait("new", 2.0)
    assert event.decision == pb.COMPILE_LOCALLY and "timeout" in event.reason


def test_acquire_many_decides_each_key_like_acquire(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    c = client(worker.target)
    c.publish("done", c.acquire("done").lease, DATA, 1.0)
    other = client(coordinator.cfg.listen)
    other.acquire("busy")
    got = c.acquire_many(["done", "busy", "fresh"])
    assert [r.decision for r in got] == [pb.HIT, pb.WAIT, pb.COMPILE]
    assert worker.registry.get_sample_value("compilecast_worker_lookups_total",
                                            {"result": "host_hit"}) == 1
    code, details = code_of(lambda: c.acquire_many(["ok", "bad/key"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "key" in details
    code, _ = code_of(lambda: client(coordinator.cfg.listen).acquire_many(["k"] * 1001))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_worker_records_the_key_time_processes_report(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    client(worker.target).acquire("k", key_seconds=0.042)
    reg = worker.registry
    assert reg.get_sample_value("compilecast_worker_key_seconds_count") == 1
    assert reg.get_sample_value("compilecast_worker_key_seconds_sum") == pytest.approx(0.042)

