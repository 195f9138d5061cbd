"""Each of a coordinator replica's components built alone, as its
constructor names what it needs: its settings as values, its collaborators,
and etcd as a fake at our own interface (tests/fake_etcd.py), as
bazel-remote's disk_test.go builds its cache over a proxyStub. Every other
test of the coordinator runs it whole, over real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Iterator

import pytest
from prometheus_client import CollectorRegistry

from compilecast.blobstore import DiskBlobStore
from compilecast.coordinator.artifacts import Artifacts, ArtifactSettings
from compilecast.coordinator.claims import Claims, ClaimSettings
from compilecast.coordinator.farm import Farm
from compilecast.coordinator.keyview import Keyspace, KeyView, ViewSettings
from compilecast.coordinator.leases import LeasePool, Session
from compilecast.coordinator.metrics import CoordinatorMetrics
from compilecast.coordinator.operations import Operations, OperationSettings
from compilecast.coordinator.presence import Presence
from compilecast.coordinator.records import KeyRecords
from compilecast.coordinator.uploads import Uploads
from compilecast.coordinator.waiting import Waiting, WaitSettings
from compilecast.coordinator.watch import WatchHub
from compilecast.errors import LeaseError
from compilecast.serving import Background
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk

from .fake_etcd import FakeEtcd

PREFIX = b"/cc"
KEY = "cc1-" + "a" * 64
ME = pb.Requester(client="host-a:1")
OTHER = pb.Requester(client="host-b:2")


class Parts:
    """The collaborators a component may name, each real but over the fake."""

    def __init__(self, tmp_path) -> None:
        self.etcd = FakeEtcd()
        self.metrics = CoordinatorMetrics(CollectorRegistry())
        self.store = DiskBlobStore(tmp_path / "store")
        self.presence = Presence(self.store, self.metrics.bucket_stalls)
        self.hub = WatchHub(self.etcd, PREFIX)
        self.records = KeyRecords(self.etcd, PREFIX, self.metrics)
        self.leases = LeasePool(self.etcd, 10)
        self.session = Session(self.etcd, 10)
        self.uploads = Uploads(self.hub.wake)
        self.farm = Farm(self.etcd, self.store, PREFIX, self.metrics, 10)
        self.background = Background(logging.getLogger("test"))

    def view(self, **settings) -> KeyView:
        return KeyView(ViewSettings(**settings), self.etcd, self.hub,
                       self.presence, self.metrics)

    def keys(self, view: KeyView) -> Keyspace:
        return Keyspace(self.etcd, view, self.records, self.leases, self.session)

    def claims(self, view: KeyView) -> Claims:
        return Claims(ClaimSettings(), view, self.etcd, self.leases,
                      self.records, self.metrics)

    def artifacts(self, view: KeyView, claims: Claims) -> Artifacts:
        return Artifacts(ArtifactSettings(max_artifact_bytes=1 << 20), self.keys(view), claims,
                         self.store, self.metrics, self.uploads, self.farm)

    @contextlib.contextmanager
    def publishing(self) -> Iterator[tuple[KeyView, Claims, Artifacts]]:
        """A key view, its claims and the artifacts' component, closed after."""
        view = self.view()
        claims = self.claims(view)
        artifacts = self.artifacts(view, claims)
        try:
            yield view, claims, artifacts
        finally:
            artifacts.close()
            self.presence.close()

    def waiting(self, view: KeyView, claims: Claims, **settings) -> Waiting:
        return Waiting(WaitSettings(**settings), self.keys(view), claims, self.metrics,
                       self.uploads, self.background)


async def chunks(data: bytes) -> AsyncIterator[DataChunk]:
    yield DataChunk(data)


async def published(claims: Claims, artifacts: Artifacts, data: bytes) -> pb.ArtifactInfo:
    """KEY claimed (it is a miss) and `data` published under its lease."""
    lease = (await claims.acquire(KEY, ME)).lease
    return await artifacts.publish(header(lease, data), chunks(data))


def header(lease: pb.Lease, data: bytes) -> pb.PublishHeader:
    return pb.PublishHeader(key=KEY, lease=lease, size=len(data), requester=ME,
                            digest=hashlib.sha256(data).hexdigest(), compile_time_seconds=2.0)


def run(coro):
    return asyncio.run(coro)


def test_the_key_view_alone_answers_a_published_entry_from_memory(tmp_path):
    async def main():
        parts = Parts(tmp_path)
        view = parts.view(designated_grace_s=1.0)
        sk = "default/" + KEY
        assert view.cached_artifact(sk) is None
        digest = parts.store.put_bytes(b"abc")
        entry = json.dumps({"digest": digest, "size": 3}).encode()
        view.published(sk, entry, 7)  # as the watch reports a put
        assert view.cached_artifact(sk).digest == digest
        view.published(sk, b"not an entry", 8)  # a damaged one is forgotten, never served
        assert view.cached_artifact(sk) is None
        # What it does not know it reads from etcd, once however many ask.
        await parts.etcd.put(view.k("a", sk), entry)
        reads = parts.etcd.round_trips
        states = await asyncio.gather(*[view.read_shared(sk) for _ in range(20)])
        assert all(s.artifact is not None and s.artifact.digest == digest for s in states)
        assert parts.etcd.round_trips - reads == 1
        # An entry whose blob is gone is never served from memory.
        parts.store.delete(digest)
        assert view.cached_artifact(sk) is None

    run(main())


def test_the_claims_alone_give_one_lease_and_tell_the_rest_to_wait(tmp_path):
    async def main():
        parts = Parts(tmp_path)
        claims = parts.claims(parts.view())
        first = await claims.acquire(KEY, ME, {"program": "p"}, "train")
        other = await claims.acquire(KEY, OTHER)
        assert first.decision == pb.COMPILE and first.lease.id
        assert other.decision == pb.WAIT
        assert await claims.check_holder("default/" + KEY, first.lease) is not None
        with pytest.raises(LeaseError):
            await claims.check_holder("default/" + KEY, pb.Lease(id=first.lease.id + 1,
                                                                  revision=1))
        # Its lease lapses in etcd (a dead holder): the next ask compiles.
        parts.etcd.expire(first.lease.id)
        assert (await claims.acquire(KEY, OTHER)).decision == pb.COMPILE

    run(main())


def test_the_artifacts_alone_take_a_holders_publish_and_serve_it_verified(tmp_path):
    async def main():
        parts = Parts(tmp_path)
        with parts.publishing() as (_, claims, artifacts):
            lease = (await claims.acquire(KEY, ME)).lease
            data = b"executable" * 1000
            with pytest.raises(LeaseError):  # only the lease holder publishes
                await artifacts.publish(header(pb.Lease(id=lease.id + 9, revision=1), data),
                                        chunks(data))
            info = await artifacts.publish(header(lease, data), chunks(data))
            assert info.digest == hashlib.sha256(data).hexdigest() and info.size == len(data)
            got, body = await artifacts.fetch(KEY, info.digest)
            assert got.digest == info.digest
            assert b"".join([bytes(c.data) async for c in body]) == data
            assert (await claims.acquire(KEY, OTHER)).decision == pb.HIT

    run(main())


def test_the_waits_alone_end_with_the_hit_of_a_publish(tmp_path):
    async def main():
        parts = Parts(tmp_path)
        with parts.publishing() as (view, claims, artifacts):
            waiting = parts.waiting(view, claims, share_binary_between_hosts_timeout_ms=30_000)
            watch = asyncio.create_task(parts.hub.run())
            try:
                await parts.hub.ready.wait()
                lease = (await claims.acquire(KEY, ME)).lease
                assert (await claims.acquire(KEY, OTHER)).decision == pb.WAIT
                events: list[pb.WaitEvent] = []

                async def wait() -> None:
                    async for event in waiting.wait(KEY, OTHER, 30_000):
                        events.append(event)
                        if event.decision != pb.WAIT:
                            return

                waiter = asyncio.create_task(wait())
                # (the waiter reads the key's state, then waits on the watch: a
                # publish before or after that ends it the same way)
                data = b"compiled" * 100
                await artifacts.publish(header(lease, data), chunks(data))
                await asyncio.wait_for(waiter, 30)
                assert events[-1].decision == pb.HIT
                assert events[-1].artifact.digest == hashlib.sha256(data).hexdigest()
            finally:
                watch.cancel()

    run(main())


def test_the_operations_alone_purge_a_key_and_revoke_its_bytes(tmp_path):
    async def main():
        parts = Parts(tmp_path)
        with parts.publishing() as (view, claims, artifacts):
            waiting = parts.waiting(view, claims)
            operations = Operations(OperationSettings(store_description="disk (test)"),
                                    parts.keys(view), waiting, parts.store, parts.metrics,
                                    parts.farm)
            info = await published(claims, artifacts, b"to purge" * 10)
            dry = await operations.purge([KEY], [], "test", dry_run=True)
            assert list(dry.purged) == [KEY] and (await claims.acquire(KEY, OTHER)).decision \
                == pb.HIT
            done = await operations.purge([KEY], [], "a bad executable")
            assert list(done.purged) == [KEY] and list(done.revoked) == [info.digest]
            revoked = await operations.revoked(0)
            assert [r.digest for r in revoked.revocations] == [info.digest]
            view.forget_artifact("default/" + KEY, parts.etcd.revision)  # (the watch's news)
            assert (await claims.acquire(KEY, OTHER)).decision == pb.COMPILE
            assert (await operations.status()).store == "disk (test)"

    run(main())
