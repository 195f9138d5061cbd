"""A job's manifest (coordinator/manifests.py, worker/daemon/manifests.py):
a warm host answers the job's keys and holds their bytes without a decision
a key upstream; a stale entry, a source that dies and a purge all end in
correct answers. Real etcd, coordinators and workers on loopback, at a job's
size (more keys than one etcd transaction holds)."""

from __future__ import annotations

import dataclasses
import hashlib

from compilecast.deadline import Deadline
from compilecast.errors import Unavailable
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess import policy
from compilecast.worker.inprocess.client import CacheClient, ClientShell, Identity

from .conftest import cc, eventually

JOB = "train-a"


def published_job(coordinator, start_worker, n: int) -> dict[str, bytes]:
    """`n` keys of JOB, each compiled and published by a host of the job."""
    first = start_worker(coordinator.cfg.listen, "first", job=JOB)
    c = CacheClient(first.target, timeout_s=30)
    artifacts = {f"prog{i:05d}": f"executable {i}".encode() * 50 for i in range(n)}
    keys = list(artifacts)
    for start in range(0, n, 100):  # (each page published well within its leases' TTL)
        page = keys[start:start + 100]
        for key, answer in zip(page, c.acquire_many(page), strict=True):
            assert answer.decision == pb.COMPILE, answer
            c.publish(key, answer.lease, artifacts[key], 1.0)
    c.close()
    return artifacts


def decided(client: CacheClient, key: str) -> policy.Decision:
    """What a process's client policy (the JAX door's) ends with for `key`;
    an unavailable upstream is a local compile, as the door makes it."""
    me = Identity()
    try:
        return policy.drive(policy.decide(policy.acquire_request(key, me), me, Deadline.after_s(10.0)),
                            ClientShell(client))
    except Unavailable as exc:
        return policy.Decision("LOCAL", key, reason=str(exc))


def prefetch_of(client: CacheClient) -> pb.JobPrefetch | None:
    st = client.status()
    return next((p for p in st.prefetches if p.job == JOB), None)


def decisions_upstream(coordinator) -> int:
    st = CacheClient(coordinator.cfg.listen).status()
    return st.hits + st.misses


def test_a_warm_host_of_the_job_holds_every_byte_and_asks_nothing(coordinator, start_worker):
    artifacts = published_job(coordinator, start_worker, 1000)
    assert coordinator.state.manifests.recorded == 1000  # one record a key

    second = start_worker(coordinator.cfg.listen, "second", job=JOB)
    c = CacheClient(second.target, timeout_s=30)
    done = eventually(lambda: (p := prefetch_of(c)) and p.artifacts_done == 1000 and p,
                      "the job's manifest prefetched", 120)
    assert done.artifacts_total == 1000
    assert done.bytes_done == done.bytes_total == sum(len(d) for d in artifacts.values())
    shown = cc("status", "--worker", second.target).stdout
    assert f"job          {JOB}: 1,000/1,000 artifacts" in shown

    asked = decisions_upstream(coordinator)
    keys = list(artifacts)
    for start in range(0, len(keys), 500):
        for key, answer in zip(keys[start:start + 500], c.acquire_many(keys[start:start + 500]),
                               strict=True):
            assert answer.decision == pb.HIT
            assert answer.artifact.digest == hashlib.sha256(artifacts[key]).hexdigest()
    for key in keys[::97]:  # the bytes, from the host cache, verified
        assert c.fetch(key)[1] == artifacts[key]
    # The coordinator decided none of the 1,000, and recorded no key twice.
    assert decisions_upstream(coordinator) == asked
    assert coordinator.state.manifests.recorded == 1000

    # A host of the job that asks key by key (no manifest: another job's
    # name) is answered upstream, and still records nothing again.
    third = start_worker(coordinator.cfg.listen, "third", job="another-job")
    t = CacheClient(third.target, timeout_s=30)
    assert all(a.decision == pb.HIT for a in t.acquire_many(keys[:300]))
    assert decisions_upstream(coordinator) == asked + 300
    assert coordinator.state.manifests.recorded == 1000 + 300  # (the other job's, once)


def test_a_stale_manifest_entry_is_asked_for_again_and_never_hits(coordinator, start_worker):
    artifacts = published_job(coordinator, start_worker, 200)
    keys = list(artifacts)
    # A host whose cache holds nothing of it (its bound), that hears of no purge.
    second = start_worker(coordinator.cfg.listen, "second", job=JOB, cache_max_bytes=1,
                          revocation_poll_s=3600.0)
    c = CacheClient(second.target, timeout_s=30)
    held = eventually(lambda: (p := prefetch_of(c)) and p.artifacts_total == 200 and p,
                      "the manifest held", 60)
    assert held.artifacts_done == 0 and "bound" in held.stopped
    purged = CacheClient(coordinator.cfg.listen).purge(keys[:20], reason="a bad build")
    assert sorted(purged.purged) == keys[:20]

    for key in keys[:20]:  # the manifest says HIT; its fetch fails; asked again: compiled
        got = decided(c, key)
        assert got.kind == "COMPILE", got
    for key in keys[20:40]:  # the rest: the manifest's HIT, its bytes verified
        got = decided(c, key)
        assert got.kind == "HIT" and got.data == artifacts[key]
    assert c.status().manifest_hits >= 40


def test_a_manifest_source_that_dies_mid_fan_out_leaves_every_answer_correct(
        start_coordinator, start_worker, started, tmp_path):
    from compilecast.coordinator.server import Coordinator

    coordinator = start_coordinator(store_dir=tmp_path / "store")
    artifacts = published_job(coordinator, start_worker, 300)
    keys = list(artifacts)
    second = start_worker(coordinator.cfg.listen, "second", job=JOB, rpc_timeout_s=2.0)
    c = CacheClient(second.target, timeout_s=30)
    eventually(lambda: prefetch_of(c) is not None, "the job learned", 30)
    coordinator.stopped = True  # wherever the manifest's fan-out is: gone
    coordinator.lt.run(coordinator.server.stop(0.0))

    asked = keys[::60]
    answers = [decided(c, key) for key in asked]
    for key, got in zip(asked, answers, strict=True):
        assert got.kind in ("HIT", "LOCAL"), got  # never COMPILE: nobody holds a lease
        if got.kind == "HIT":
            assert got.data == artifacts[key]  # bytes of the host, verified

    started(Coordinator(dataclasses.replace(coordinator.cfg)))  # the replica back
    for key in keys[::10]:  # (the worker's channel reconnects within gRPC's backoff)
        got = eventually(lambda k=key: (d := decided(c, k)).kind == "HIT" and d,
                         f"{key} answered again", 120)
        assert got.data == artifacts[key]


def test_a_purge_during_the_prefetch_ends_in_correct_answers(coordinator, start_worker):
    artifacts = published_job(coordinator, start_worker, 300)
    keys = list(artifacts)
    second = start_worker(coordinator.cfg.listen, "second", job=JOB, revocation_poll_s=0.2)
    c = CacheClient(second.target, timeout_s=30)
    eventually(lambda: prefetch_of(c) is not None, "the job learned", 30)
    CacheClient(coordinator.cfg.listen).purge(keys[:50], reason="purged mid-prefetch")
    eventually(lambda: (p := prefetch_of(c)) and p.artifacts_total
               and p.artifacts_done + 50 >= p.artifacts_total, "the prefetch over", 60)
    # Once the worker has heard of the purge (its revocation poll), a purged
    # key compiles and every other key hits with its own bytes.
    eventually(lambda: all(decided(c, k).kind == "COMPILE" for k in keys[:50:7]),
               "the purge heard", 30)
    for key in keys[50::25]:
        got = decided(c, key)
        assert got.kind == "HIT" and got.data == artifacts[key]


def _ask(target: str, token: str, job: str, keys: list[str]) -> None:
    """AcquireMany for `keys`, naming `job`'s manifest, as a worker of the job does."""
    c = CacheClient(target, timeout_s=30, token=token)
    me = Identity(job=job, process_id=0, designated_process=0).requester()
    c.stub.AcquireMany(pb.AcquireManyRequest(requests=[
        pb.AcquireRequest(key=k, requester=me, manifest_job=job) for k in keys]), timeout=60)
    c.close()


def _manifest_keys(target: str, job: str) -> int:
    m = CacheClient(target, token="a-pub").stub.GetManifest(pb.ManifestRequest(job=job),
                                                            timeout=60)
    return len(m.entries) + m.unpublished


def test_a_job_s_key_bound_holds_where_its_keys_are_stored(start_coordinator, tokens_file,
                                                          monkeypatch):
    from compilecast.coordinator import manifests

    bound = 300
    monkeypatch.setattr(manifests, "MAX_KEYS", bound)
    monkeypatch.setattr(manifests, "JOBS_NOTED", 1)  # the replica remembers one job
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    target, state = secured.cfg.listen, secured.state
    stored = state.manifests.prefix + f"/j/{manifests.job_digest('team-a', 'big-job')}/".encode()
    _ask(target, "a-pub", "big-job", [f"first{i:04d}" for i in range(bound)])
    eventually(lambda: len(secured.lt.run(state.etcd.get_prefix(stored))) == bound,
               "the job's keys stored", 30)
    _ask(target, "a-pub", "other-job", ["other"])  # the replica forgets big-job
    _ask(target, "a-pub", "big-job", [f"more{i:04d}" for i in range(bound)])
    # (before: the forgotten job recorded another `bound` keys, and more each time)
    assert _manifest_keys(target, "big-job") == bound
    assert len(secured.lt.run(state.etcd.get_prefix(stored))) == bound


def test_a_reader_cannot_grow_or_add_to_a_job_s_manifest(start_coordinator, tokens_file):
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    target = secured.cfg.listen
    c = CacheClient(target, timeout_s=30, token="a-pub")
    (answer,) = c.acquire_many(["published-elsewhere"])
    c.publish("published-elsewhere", answer.lease, b"an executable of team-a's", 1.0)
    _ask(target, "a-pub", "train-b", [f"prog{i:04d}" for i in range(1000)])
    before = eventually(lambda: secured.state.manifests.recorded >= 1000 and
                        secured.state.manifests.recorded, "the job's keys recorded", 30)
    # A reader names 1,000 keys of its own and a published artifact under the job.
    _ask(target, "a-read", "train-b", [f"junk{i:04d}" for i in range(999)] +
         ["published-elsewhere"])
    assert secured.state.manifests.recorded == before
    assert _manifest_keys(target, "train-b") == 1000
