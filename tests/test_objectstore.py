"""Artifacts in a real S3-compatible bucket (SeaweedFS on loopback): replicas
that share no volume, and what the bucket's faults look like to a user."""

from __future__ import annotations

import hashlib
import os
import uuid

import grpc
import pytest

from compilecast.config import ConfigError, CoordinatorConfig, load
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

from .conftest import CALL_ERRORS, status_code
from .s3server import S3Server, restore, use_credentials

pytestmark = pytest.mark.slow

MB = 1 << 20


@pytest.fixture
def bucket(s3) -> str:
    return s3.bucket(f"cc-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def replica(start_coordinator, s3, bucket, tmp_path):
    """start(name): a coordinator replica over the bucket, with a local
    cache of its own (tmp_path/name)."""
    def start(name: str, **kw):
        settings = dict(store_type="s3", s3_bucket=bucket, s3_endpoint=s3.endpoint,
                        max_artifact_bytes=64 * MB, store_max_bytes=128 * MB)
        return start_coordinator(tmp_path / name, **{**settings, **kw})
    return start


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except CALL_ERRORS as exc:
        return status_code(exc)
    return grpc.StatusCode.OK


def test_replicas_with_disks_of_their_own_serve_what_either_published(replica, s3, bucket):
    a, b = replica("a"), replica("b")
    ca, cb = CacheClient(a.cfg.listen), CacheClient(b.cfg.listen)
    data = os.urandom(70 * MB // 10)  # past a part, the multipart upload streams it
    digest = hashlib.sha256(data).hexdigest()
    ca.publish("k", ca.acquire("k").lease, data, 2.0)
    head = s3.client().head_object(Bucket=bucket, Key=f"compilecast/blobs/{digest[:2]}/{digest}")
    assert head["ContentLength"] == len(data)  # complete in the bucket before it was indexed
    assert not b.store.local.has(digest)
    assert cb.acquire("k").decision == pb.HIT
    assert cb.fetch("k")[1] == data  # from the bucket into b's own cache, verified
    assert b.store.local.has(digest)
    local = b.registry.get_sample_value
    assert local("compilecast_coordinator_bucket_local_reads_total", {"result": "miss"}) == 1
    assert local("compilecast_coordinator_bucket_bytes_total", {"op": "get_bytes"}) == len(data)
    assert a.registry.get_sample_value("compilecast_coordinator_bucket_bytes_total",
                                       {"op": "upload"}) == len(data)
    status = cb.status()
    assert status.store == f"s3://{bucket}/compilecast at {s3.endpoint} (cache {b.cfg.store_dir})"
    assert (status.bucket_local_hits, status.bucket_local_misses, status.bucket_errors) == \
        (0, 1, 0)
    # A replica that starts on an empty disk loses nothing: the bucket is the truth.
    c = replica("c")
    cc = CacheClient(c.cfg.listen)
    assert cc.acquire("k").decision == pb.HIT and cc.fetch("k")[1] == data
    for client in (ca, cb, cc):
        client.close()


def test_a_publish_the_bucket_refuses_is_never_indexed(replica, monkeypatch):
    from compilecast.objectstore import BucketError

    a = replica("a")
    c = CacheClient(a.cfg.listen)

    def down(*args, **kwargs):
        raise BucketError("bucket: upload failed: the endpoint went away")

    monkeypatch.setattr(a.store.bucket, "upload", down)
    lease = c.acquire("k").lease
    c.keep_lease("k", lease)  # as a holder does: the lease outlives the publish's retries
    assert _code(lambda: c.publish("k", lease, os.urandom(MB), 1.0)) == \
        grpc.StatusCode.UNAVAILABLE
    monkeypatch.undo()
    other = CacheClient(a.cfg.listen)
    assert other.acquire("k").decision == pb.WAIT  # still the holder's to publish, not a HIT
    data = os.urandom(MB)
    assert c.publish("k", lease, data, 1.0).digest == hashlib.sha256(data).hexdigest()
    assert other.acquire("k").decision == pb.HIT
    c.stop_lease("k", lease)
    c.close()
    other.close()


def _published_on_a(replica):
    """Replicas a and b, their clients, and an artifact published through a
    (in the bucket, not in b's cache): (a, b, ca, cb, digest, object key)."""
    a, b = replica("a"), replica("b")
    ca, cb = CacheClient(a.cfg.listen), CacheClient(b.cfg.listen)
    data = os.urandom(MB)
    digest = hashlib.sha256(data).hexdigest()
    ca.publish("k", ca.acquire("k").lease, data, 1.0)
    return a, b, ca, cb, digest, f"compilecast/blobs/{digest[:2]}/{digest}"


def test_an_object_deleted_behind_our_back_is_a_miss(replica, s3, bucket):
    _, _, ca, cb, _, key = _published_on_a(replica)
    s3.client().delete_object(Bucket=bucket, Key=key)
    assert _code(lambda: cb.fetch("k")) == grpc.StatusCode.NOT_FOUND
    assert cb.acquire("k").decision == pb.COMPILE  # the entry went: the key compiles again
    ca.close()
    cb.close()


def test_an_object_corrupted_behind_our_back_is_never_served(replica, s3, bucket):
    _, b, ca, cb, digest, key = _published_on_a(replica)
    s3.client().put_object(Bucket=bucket, Key=key, Body=os.urandom(MB))
    assert _code(lambda: cb.fetch("k")) == grpc.StatusCode.DATA_LOSS
    assert not b.store.local.has(digest)  # nothing half-written or wrong kept
    assert b.registry.get_sample_value("compilecast_coordinator_corrupt_blobs_total") == 1
    assert cb.acquire("k").decision == pb.COMPILE
    assert "Contents" not in s3.client().list_objects_v2(Bucket=bucket, Prefix=key)
    ca.close()
    cb.close()


def test_a_missing_bucket_or_wrong_credentials_stop_a_replica_at_start(replica, s3,
                                                                        monkeypatch):
    from compilecast.objectstore import BucketError

    with pytest.raises(BucketError, match="nope-nothing-here"):
        replica("x", s3_bucket="nope-nothing-here")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(BucketError, match="refused"):
        replica("y")


@pytest.mark.parametrize(("env", "message"), [
    ({"COMPILECAST_STORE_TYPE": "gcs"}, "store_type must be disk or s3"),
    ({"COMPILECAST_STORE_TYPE": "s3"}, "store_type s3 needs s3_bucket"),
    ({"COMPILECAST_STORE_TYPE": "s3", "COMPILECAST_S3_BUCKET": "b"}, "needs store_max_bytes"),
    ({"COMPILECAST_STORE_TYPE": "s3", "COMPILECAST_S3_BUCKET": "b",
      "COMPILECAST_STORE_MAX_BYTES": "8Gi", "COMPILECAST_S3_ENDPOINT": "localhost:9000"},
     "is not an http(s) URL"),
])
def test_incomplete_bucket_settings_are_refused(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1", **env})


def test_four_jax_processes_on_two_replicas_compile_once_and_rerun_hits(replica):
    """A step compiled by whichever process asks first: the others, two on
    each replica, load it (each replica serving its own from the bucket);
    a second wave compiles nothing on either replica."""
    from .e2e import collect, start_procs

    a, b = replica("a"), replica("b")

    def wave() -> list[dict]:
        procs = start_procs(2, a.cfg.listen) + start_procs(2, b.cfg.listen)
        return collect(procs, timeout_s=300)

    first = wave()
    assert sum(r["xla_compiles"] for r in first) == 1, first
    assert len({r["digest"] for r in first}) == 1
    again = wave()
    assert sum(r["xla_compiles"] for r in again) == 0, again
    assert {r["digest"] for r in again} == {r["digest"] for r in first}


def test_a_replica_killed_mid_upload_leaves_nothing_half_written(etcd, prefix, s3, bucket,
                                                                  replica, tmp_path):
    """The holder's replica dies while it uploads to the bucket: no index
    entry, no object; the waiter on the other replica is promoted when the
    holder's lease lapses, and its publish is what everyone then reads."""
    import subprocess
    import sys
    import threading

    from compilecast.launch import free_port

    from .conftest import eventually

    port = free_port()
    killed = subprocess.Popen(
        [sys.executable, "-m", "compilecast.cli", "coordinator", f"--listen=127.0.0.1:{port}",
         f"--etcd-endpoints={etcd.endpoint}", f"--etcd-prefix={prefix}", "--metrics-port=0",
         f"--store-dir={tmp_path / 'killed'}", "--allow-unauthenticated=true",
         "--store-type=s3", f"--s3-bucket={bucket}", f"--s3-endpoint={s3.endpoint}",
         "--max-artifact-bytes=512Mi", "--store-max-bytes=1Gi", "--lease-ttl-s=2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        holder = CacheClient(f"127.0.0.1:{port}", timeout_s=30)
        eventually(lambda: _code(lambda: holder.status()) == grpc.StatusCode.OK,
                   "the replica answers", 30.0)
        b = replica("b", lease_ttl_s=2)
        waiter = CacheClient(b.cfg.listen)
        lease = holder.acquire("k").lease
        assert waiter.acquire("k").decision == pb.WAIT
        waited: list = []
        threading.Thread(target=lambda: waited.append(waiter.wait("k", 120)), daemon=True).start()
        big = os.urandom(256 * MB)
        published: list = []
        publishing = threading.Thread(target=lambda: published.append(
            _code(lambda: holder.publish("k", lease, big, 1.0))), daemon=True)
        publishing.start()
        s3c = s3.client()
        # Its local copy committed, the replica uploads it (seconds for 256 MiB): kill it.
        digest = hashlib.sha256(big).hexdigest()
        committed = tmp_path / "killed" / "blobs" / digest[:2] / f"{digest}.zst"
        eventually(committed.exists, "the replica's local copy is committed", 60.0)
        killed.kill()
        killed.wait(10)
        eventually(lambda: waited, "the waiter hears", 60.0)
        assert waited[0].decision == pb.COMPILE, waited  # promoted once the lease lapsed
        waiter.keep_lease("k", waited[0].lease)
        assert "Contents" not in s3c.list_objects_v2(Bucket=bucket)  # nothing half-written
        data = os.urandom(MB)
        waiter.publish("k", waited[0].lease, data, 1.0)
        fresh = CacheClient(replica("c").cfg.listen)
        assert fresh.fetch("k")[1] == data
        publishing.join(120)  # its tries against the dead replica end before its channel does
        assert published and published[0] != grpc.StatusCode.OK, published
        for c in (holder, waiter, fresh):
            c.close()
    finally:
        killed.kill()
        killed.wait(10)


def test_a_worker_reads_from_the_bucket_by_presigned_url(replica, start_worker, s3, bucket):
    """The coordinator checks the worker's token and hands it a presigned
    GET: the bytes come from the bucket, not through the replica (which
    never downloads them); with URLs off, the same bytes come through it."""
    a, b = replica("a"), replica("b")
    ca = CacheClient(a.cfg.listen)
    data = os.urandom(3 * MB)
    ca.publish("k", ca.acquire("k").lease, data, 1.0)
    worker = start_worker(b.cfg.listen)
    assert CacheClient(worker.target).fetch("k")[1] == data
    assert b.registry.get_sample_value("compilecast_coordinator_bucket_urls_total") == 1
    assert not b.store.local.has(hashlib.sha256(data).hexdigest())  # not through b
    plain = start_worker(b.cfg.listen, name="plain", bucket_urls=False)
    assert CacheClient(plain.target).fetch("k")[1] == data
    assert b.registry.get_sample_value("compilecast_coordinator_bucket_urls_total") == 1
    assert b.store.local.has(hashlib.sha256(data).hexdigest())
    ca.close()


def test_a_presigned_get_that_fails_falls_back_to_the_replica(replica, start_worker, s3,
                                                              bucket):
    """An object the bucket no longer has: the worker's GET is refused, it
    asks the replica for the bytes, and hears what the replica knows (gone:
    NOT_FOUND, and the key compiles again)."""
    a = replica("a")
    ca = CacheClient(a.cfg.listen)
    data = os.urandom(MB)
    digest = hashlib.sha256(data).hexdigest()
    ca.publish("k", ca.acquire("k").lease, data, 1.0)
    s3.client().delete_object(Bucket=bucket, Key=f"compilecast/blobs/{digest[:2]}/{digest}")
    a.store.local.delete(digest)
    worker = start_worker(a.cfg.listen)
    assert _code(lambda: CacheClient(worker.target).fetch("k")) == grpc.StatusCode.NOT_FOUND
    assert worker.registry.get_sample_value("compilecast_worker_data_plane_downloads_total",
                                            {"result": "fallback"}) == 1
    assert ca.acquire("k").decision == pb.COMPILE
    ca.close()


# botocore's connection to the server that stops mid-request is left for the
# garbage collector, which may close it during this test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_the_endpoint_down_mid_upload_fails_the_publish_and_indexes_nothing(
        start_coordinator, tmp_path_factory, tmp_path):
    """The bucket's server stops while a replica uploads to it: the holder
    hears UNAVAILABLE (not an error of ours), and the key is not a HIT."""
    import threading

    from .conftest import eventually

    server = S3Server(tmp_path_factory.mktemp("s3-down"))
    before = use_credentials(server)
    try:
        server.bucket("going-away")
        a = start_coordinator(tmp_path / "a", store_type="s3", s3_bucket="going-away",
                              s3_endpoint=server.endpoint, max_artifact_bytes=512 * MB,
                              store_max_bytes=1024 * MB)
        c = CacheClient(a.cfg.listen, timeout_s=60)
        lease = c.acquire("k").lease
        c.keep_lease("k", lease)  # as a holder does while it publishes, and tries again
        big = os.urandom(256 * MB)
        digest = hashlib.sha256(big).hexdigest()
        published: list = []
        publishing = threading.Thread(target=lambda: published.append(
            _code(lambda: c.publish("k", lease, big, 1.0))), daemon=True)
        publishing.start()
        eventually(lambda: a.store.local.has(digest), "the local copy is committed", 60.0)
        server.stop()
        publishing.join(180)
        assert published == [grpc.StatusCode.UNAVAILABLE], published
        assert CacheClient(a.cfg.listen).acquire("k").decision != pb.HIT
        c.close()
    finally:
        restore(before)
        if server.proc.poll() is None:
            server.stop()


def test_a_stopped_bucket_slows_only_what_needs_its_objects(replica):
    """The S3 server stopped (SIGSTOP): a decision on another key is answered
    and a lease renewed while one that needs the bucket's word waits for it
    (the check's deadline set far away); the waiting check shows in the
    metrics; once the bucket answers again, so does the decision."""
    import signal
    import threading

    from .conftest import eventually

    _, b, ca, cb, _, _ = _published_on_a(replica)
    b.state.presence.deadline_s = 3600.0
    cb.close()
    cb = CacheClient(b.cfg.listen, timeout_s=3600)
    holder = CacheClient(b.cfg.listen)
    lease = holder.acquire("held").lease
    weed = _weed_process(b.store.bucket.endpoint)  # (the same SeaweedFS as a's)
    waiting = "compilecast_coordinator_bucket_checks_waiting"
    answered: list = []
    needs_bucket = threading.Thread(target=lambda: answered.append(cb.acquire("k")))
    os.kill(weed, signal.SIGSTOP)
    try:
        needs_bucket.start()
        eventually(lambda: b.registry.get_sample_value(waiting) == 1, "the bucket asked",
                   seconds=30)
        other = CacheClient(b.cfg.listen).acquire("unrelated")  # the bucket says nothing
        assert other.decision == pb.COMPILE
        assert holder.keepalive("held", lease) > 0  # the lease is renewed meanwhile
        assert answered == [] and b.registry.get_sample_value(waiting) == 1
    finally:
        os.kill(weed, signal.SIGCONT)
    needs_bucket.join(120)
    [got] = answered  # the bucket's word came: the published key is a HIT
    assert got.decision == pb.HIT and b.registry.get_sample_value(waiting) == 0
    assert cb.fetch("k")[1]
    for client in (ca, cb, holder):
        client.close()


def test_a_check_the_store_does_not_answer_in_time_lets_the_decision_go_on():
    """Presence: a store that never answers within the deadline is "cannot
    tell" (None), counted as a stall; the store's own answer, later, is
    still taken for the next check."""
    import asyncio
    import threading

    from prometheus_client import CollectorRegistry, Counter

    from compilecast.coordinator.presence import Presence

    answer = threading.Event()

    class Hung:
        def known(self, digest):
            return None

        def has(self, digest):
            answer.wait(60)
            return True

    stalls = Counter("stalls", "", registry=CollectorRegistry())

    async def run():
        presence = Presence(Hung(), stalls, deadline_s=0.05)
        first = await presence.check("d" * 64)
        answer.set()
        second = await presence.check("d" * 64)
        presence.close()
        return first, second

    assert asyncio.run(run()) == (None, True)
    assert stalls._value.get() == 1


def _weed_process(endpoint: str) -> int:
    """The pid of the SeaweedFS server listening on `endpoint`'s port."""
    port = endpoint.rsplit(":", 1)[1]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"weed") and f"-s3.port={port}".encode() in cmd:
            return int(pid)
    raise AssertionError(f"no SeaweedFS process serves {endpoint}")
