"""Taking artifacts out of service (Purge) and the revocations workers
apply to their host caches, against real etcd, gRPC, coordinators and
workers."""

from __future__ import annotations

import hashlib
import subprocess

import grpc

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

from .conftest import cc, code_of, eventually, publish

BAD = b"miscompiled" * 20_000
GOOD = b"fine-executable" * 20_000


def test_purged_bytes_are_served_under_no_key_and_never_published_again(start_coordinator):
    coordinator = start_coordinator(local_marker_ttl_s=1)
    c = CacheClient(coordinator.cfg.listen)
    bad = publish(c, "k1", BAD).digest
    publish(c, "k2", BAD)  # the same bytes under another key
    publish(c, "k3", GOOD)
    resp = c.purge(["k1", "nothing-here"], reason="XLA miscompile, bug 123")
    assert list(resp.purged) == ["k1", "k2"] and list(resp.missing) == ["nothing-here"]
    assert list(resp.revoked) == [bad]
    for k in ("k1", "k2"):
        assert code_of(lambda k=k: c.fetch(k))[0] == grpc.StatusCode.NOT_FOUND
    assert c.acquire("k3").decision == pb.HIT  # other bytes are untouched
    again = c.acquire("k1")
    assert again.decision == pb.COMPILE  # a miss now: it compiles again
    waiter = CacheClient(coordinator.cfg.listen)
    assert waiter.acquire("k1").decision == pb.WAIT
    code, details = code_of(lambda: c.publish("k1", again.lease, BAD, 3.0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "bug 123" in details
    # Its waiters compile locally at once: promoted one by one, each would
    # compile the same bytes and be refused in turn.
    event = waiter.wait("k1", 10)
    assert event.decision == pb.COMPILE_LOCALLY and "purged" in event.reason
    once_more = eventually(lambda: (r := c.acquire("k1")).decision == pb.COMPILE and r,
                           "the verdict lapses")
    c.publish("k1", once_more.lease, GOOD, 3.0)  # other bytes may take its place
    assert c.fetch("k1")[1] == GOOD
    (rev,) = c.revoked().revocations
    assert (rev.digest, rev.reason, list(rev.keys)) == (bad, "XLA miscompile, bug 123",
                                                        ["k1", "k2"])
    assert coordinator.registry.get_sample_value("compilecast_coordinator_purges_total") == 1
    assert c.status().revoked == 1  # what `compilecast status` prints
    now = c.revoked().revision
    assert list(c.revoked(now).revocations) == []  # nothing new since


def test_purge_by_digest_and_bad_requests(coordinator):
    c = CacheClient(coordinator.cfg.listen)
    same = [f"k{i:03d}" for i in range(75)]  # more keys than one txn deletes
    for k in same:
        publish(c, k, b"tiny")
    digest = hashlib.sha256(b"tiny").hexdigest()
    resp = c.purge([], [digest])
    assert list(resp.purged) == same and list(resp.revoked) == [digest]
    assert all(c.acquire(k).decision == pb.COMPILE for k in same[::10])
    assert code_of(lambda: c.purge([]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: c.purge(["bad/key"]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: c.purge([], ["not-a-digest"]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: c.revoked(-1))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: c.revoked(2**63 - 1))[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_an_out_of_range_revision_is_refused_through_a_worker(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    c = CacheClient(worker.target)
    assert code_of(lambda: c.revoked(2**63 - 1))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert c.revoked(2**63 - 2).revocations == []  # the largest it takes


def test_only_an_admin_purges_and_only_its_own_tenants_keys(start_coordinator, tokens_file):
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    target = secured.cfg.listen
    a, b = CacheClient(target, token="a-pub"), CacheClient(target, token="b-pub")
    publish(a, "k", BAD)
    publish(b, "k", BAD)
    for who in (a, CacheClient(target, token="a-read")):
        code, details = code_of(lambda who=who: who.purge(["k"]))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in details
    resp = CacheClient(target, token="a-admin").purge(["k"], reason="bad")
    assert list(resp.purged) == ["k"]
    assert b.fetch("k")[1] == BAD  # tenant b's entry and blob are untouched
    assert list(b.revoked().revocations) == []
    assert code_of(lambda: a.fetch("k"))[0] == grpc.StatusCode.NOT_FOUND


def test_another_replica_stops_serving_a_purged_key_at_once(start_coordinator):
    one, two = start_coordinator(), start_coordinator()
    c1, c2 = CacheClient(one.cfg.listen), CacheClient(two.cfg.listen)
    publish(c1, "k", BAD)
    assert c2.acquire("k").decision == pb.HIT  # replica two holds it in memory
    c1.purge(["k"])
    eventually(lambda: c2.acquire("k").decision == pb.COMPILE, "replica two misses")


def test_workers_drop_revoked_bytes_from_their_host_caches(coordinator, start_worker):
    polling = start_worker(coordinator.cfg.listen, revocation_poll_s=0.2)
    other = start_worker(coordinator.cfg.listen, revocation_poll_s=3600)
    upstream = CacheClient(coordinator.cfg.listen)
    publish(upstream, "k", BAD)
    procs = [CacheClient(w.cfg.listen) for w in (polling, other)]
    for p in procs:
        assert p.fetch("k")[1] == BAD  # now in each host cache
        assert p.acquire("k").decision == pb.HIT
    assert polling.cache.store.has(hashlib.sha256(BAD).hexdigest())
    upstream.purge(["k"], reason="bad bytes")
    eventually(lambda: polling.registry.get_sample_value(
        "compilecast_worker_revoked_total") == 1, "the polling worker drops it")
    assert not polling.cache.store.has(hashlib.sha256(BAD).hexdigest())
    assert procs[0].acquire("k").decision == pb.COMPILE  # no host hit: the coordinator's miss
    # A purge through a worker drops the bytes there at once, not at its next poll.
    publish(upstream, "k2", GOOD)
    assert procs[1].fetch("k2")[1] == GOOD
    procs[1].purge(["k2"])
    assert other.registry.get_sample_value("compilecast_worker_revoked_total") == 1
    assert not other.cache.store.has(hashlib.sha256(GOOD).hexdigest())
    assert procs[1].acquire("k2").decision == pb.COMPILE


def test_a_worker_applies_the_revocations_of_its_processes_tenants(start_coordinator,
                                                                    tokens_file, start_worker):
    """The worker acts as tenant a; a process on its host presents tenant b's
    token. Tenant b's purge reaches that host's cache too."""
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    own = tokens_file.parent / "worker.token"
    own.write_text("a-pub")
    worker = start_worker(secured.cfg.listen, token_file=str(own), revocation_poll_s=0.2)
    b = CacheClient(worker.target, token="b-pub")
    publish(b, "k", BAD)
    assert b.fetch("k")[1] == BAD and b.acquire("k").decision == pb.HIT  # in the host cache
    CacheClient(secured.cfg.listen, token="b-admin").purge(["k"], reason="bad")
    eventually(lambda: worker.registry.get_sample_value(
        "compilecast_worker_revoked_total") == 1, "tenant b's revocation applied")
    assert not worker.cache.store.has(hashlib.sha256(BAD).hexdigest())
    assert b.acquire("k").decision == pb.COMPILE


def test_a_purge_through_a_shared_worker_acts_within_its_tenant(start_coordinator, tokens_file,
                                                                start_worker):
    """Tenants a and b both have the same bytes in one worker's host cache.
    Tenant b's admin purges them through that worker: b's entry goes, and
    a's copy stays (a hits it on the host, without fetching it again)."""
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    own = tokens_file.parent / "worker.token"
    own.write_text("a-pub")
    worker = start_worker(secured.cfg.listen, token_file=str(own), revocation_poll_s=3600)
    a, b = CacheClient(worker.target, token="a-pub"), CacheClient(worker.target, token="b-pub")
    for token in ("a-pub", "b-pub"):
        publish(CacheClient(secured.cfg.listen, token=token), "k", BAD)
    for c in (a, b):
        assert c.fetch("k")[1] == BAD and c.acquire("k").decision == pb.HIT
    digest = hashlib.sha256(BAD).hexdigest()
    fetched = worker.registry.get_sample_value("compilecast_worker_artifact_bytes_total",
                                               {"direction": "fetched"})
    assert fetched
    resp = CacheClient(worker.target, token="b-admin").purge(["k"], reason="bad")
    assert list(resp.revoked) == [digest] and resp.tenant == "team-b"
    assert worker.cache.store.has(digest)  # tenant a's copy stays
    assert b.acquire("k").decision == pb.COMPILE  # tenant b's entry went
    assert a.fetch("k")[1] == BAD and a.acquire("k").decision == pb.HIT
    assert worker.registry.get_sample_value("compilecast_worker_artifact_bytes_total",
                                            {"direction": "fetched"}) == fetched


def test_the_purge_command(coordinator):
    c = CacheClient(coordinator.cfg.listen)
    digest = publish(c, "k", BAD).digest

    def purge_cli(*args: str) -> subprocess.CompletedProcess:
        return cc("purge", "--coordinator", coordinator.cfg.listen, *args)

    publish(c, "k-twin", BAD)  # the same bytes under another key
    r = purge_cli("k", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "would purge   k\n" in r.stdout and "would purge   k-twin" in r.stdout
    assert f"would revoke  {digest}" in r.stdout and "nothing changed" in r.stdout
    assert c.acquire("k").decision == pb.HIT and list(c.revoked().revocations) == []
    r = purge_cli("k", "gone", "--reason", "miscompile")
    assert r.returncode == 1, r.stderr  # one key had nothing to purge
    assert "purged   k" in r.stdout and "missing  gone" in r.stdout and digest in r.stdout
    r = purge_cli()
    assert r.returncode != 0 and "name the keys" in r.stderr and "Traceback" not in r.stderr
