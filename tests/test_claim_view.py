"""Decisions that need no etcd round trip of their own: keys someone compiles
(the watch's view of compile lease records) and concurrent reads of one key
(shared). Against a real etcd and real gRPC on loopback."""

from __future__ import annotations

import asyncio
import os
import signal

from compilecast.coordinator.records import scope
from compilecast.coordinator.server import Coordinator
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import EtcdProcess, coordinator_config, eventually, slow_counted_reads

DATA = b"claimed" * 5_000


def member(target: str, process_id: int, timeout_s: float = 5.0) -> CacheClient:
    return CacheClient(target, timeout_s=timeout_s, identity=Identity(
        job="j", process_id=process_id, designated_process=0, client=f"p{process_id}"))


def test_someone_compiles_is_answered_without_etcd(tmp_path, prefix, started):
    """Once the watch has seen process 0's claim, the others get WAIT even
    while etcd does not answer at all."""
    etcd = EtcdProcess(tmp_path)
    try:
        coord = started(Coordinator(coordinator_config(etcd, tmp_path, prefix)))
        target = coord.cfg.listen
        p0, p1 = member(target, 0), member(target, 1, timeout_s=3.0)
        try:
            assert p0.acquire("k").decision == pb.COMPILE
            eventually(lambda: scope("default", "k") in coord.state.view.claimed,
                       "the watch reports the claim")
            os.kill(etcd.proc.pid, signal.SIGSTOP)
            try:
                resp = p1.acquire("k")
            finally:
                os.kill(etcd.proc.pid, signal.SIGCONT)
            assert resp.decision == pb.WAIT and "process 0 (p0)" in resp.reason
        finally:
            p0.close()
            p1.close()
            coord.stop()
    finally:
        etcd.stop()


def test_the_view_follows_release_and_publish(coordinator):
    target = coordinator.cfg.listen
    p0, p1 = member(target, 0), member(target, 1)
    try:
        failed = p0.acquire("released").lease
        p0.release("released", failed, pb.COMPILE_FAILED, "boom")
        eventually(lambda: p1.acquire("released").decision == pb.COMPILE_LOCALLY,
                   "a released key stops being WAIT")
        lease = p0.acquire("published").lease
        assert p1.acquire("published").decision == pb.WAIT
        p0.publish("published", lease, DATA, 1.0)
        eventually(lambda: p1.acquire("published").decision == pb.HIT,
                   "a published key is a HIT")
        assert not coordinator.state.view.claimed
    finally:
        p0.close()
        p1.close()


def test_a_stale_entry_costs_one_wait_and_no_wrong_answer(coordinator, loop_thread):
    """An entry the watch has not removed yet (here: one that never existed)
    answers WAIT; the Wait that follows reads etcd and promotes the caller."""
    sk = scope("default", "ghost")

    async def plant():
        coordinator.state.view.claimed[sk] = "compiled by a ghost"

    loop_thread.run(plant())
    c = CacheClient(coordinator.cfg.listen)
    try:
        resp = c.acquire("ghost")
        assert resp.decision == pb.WAIT and resp.reason == "compiled by a ghost"
        event = c.wait("ghost", 10)
        assert event.decision == pb.COMPILE and event.lease.id > 0
        c.publish("ghost", event.lease, DATA, 1.0)
    finally:
        c.close()


def test_a_record_the_view_cannot_read_is_asked_of_etcd(coordinator, loop_thread):
    """The view keeps a claim record as the watch delivered it and reads it
    when a decision first needs it; one that is not a claim record answers
    nothing from the view (the decision reads etcd, which holds no claim
    here) and leaves it."""
    sk = scope("default", "unreadable")

    async def plant():
        coordinator.state.view.claimed[sk] = b"\xff not a claim record"

    loop_thread.run(plant())
    c = CacheClient(coordinator.cfg.listen)
    try:
        resp = c.acquire("unreadable")
        assert resp.decision == pb.COMPILE and resp.lease.id > 0
        c.release("unreadable", resp.lease, pb.COMPILE_FAILED, "test")
    finally:
        c.close()
    assert coordinator.state.view.claimed.get(sk) != b"\xff not a claim record"


def test_concurrent_decisions_on_one_key_share_one_etcd_read(coordinator, loop_thread):
    state = coordinator.state

    async def ask_all():
        with slow_counted_reads(state) as reads:
            return await asyncio.gather(*(state.claims.acquire(
                "shared", pb.Requester(job="j", process_id=i, designated_process=0))
                for i in range(1, 51))), reads

    answers, reads = loop_thread.run(ask_all())
    assert [a.decision for a in answers] == [pb.WAIT] * 50
    assert all("process 0 of job j compiles" in a.reason for a in answers)
    assert reads.count(state.view.k("a", scope("default", "shared"))) == 1, reads


def test_claimers_still_race_through_etcd(coordinator):
    """The view only ever answers WAIT: with no claim known, two independent
    processes still get exactly one COMPILE between them."""
    a, b = CacheClient(coordinator.cfg.listen), CacheClient(coordinator.cfg.listen)
    try:
        got = sorted(c.acquire("race").decision for c in (a, b))
        assert got == [pb.COMPILE, pb.WAIT]
    finally:
        a.close()
        b.close()



def test_the_in_memory_index_is_bounded_and_a_forgotten_entry_still_hits(coordinator, loop_thread):
    async def cap():
        coordinator.state.view.index_max = 3

    loop_thread.run(cap())
    c = CacheClient(coordinator.cfg.listen)
    try:
        digests = {}
        for i in range(6):
            key = f"bounded-{i}"
            digests[key] = c.publish(key, c.acquire(key).lease, DATA + bytes([i]), 1.0).digest
        # The watch has reported all six publishes; only the newest three stay.
        eventually(lambda: sorted(coordinator.state.view.index) == [
            scope("default", f"bounded-{i}") for i in range(3, 6)], "the index keeps the newest")
        for key, digest in digests.items():
            resp = c.acquire(key)
            assert resp.decision == pb.HIT and resp.artifact.digest == digest
        assert len(coordinator.state.view.index) == 3
    finally:
        c.close()


def test_the_waiters_of_a_program_look_up_its_compile_time_once(start_coordinator, loop_thread):
    """Hedging compares a holder with the program's expected compile time:
    read once for all the waiters of a pod (within EXPECTED_TTL_S)."""
    coordinator = start_coordinator(hedge_factor=2.0, hedge_min_s=30.0)
    state = coordinator.state
    holder = member(coordinator.cfg.listen, 0)
    try:
        assert holder.acquire("v1", program_name="jit_step").decision == pb.COMPILE
    finally:
        holder.close()
    lookups: list[bytes] = []
    real = state.etcd.get_prefix

    async def get_prefix(prefix, **kw):
        lookups.append(prefix)
        return await real(prefix, **kw)

    async def wait_all():
        state.etcd.get_prefix = get_prefix
        try:
            return await asyncio.gather(*(
                _last(state.waiting.wait("v1", pb.Requester(job="j", process_id=i, designated_process=0),
                                 300)) for i in range(1, 21)))
        finally:
            del state.etcd.get_prefix

    events = loop_thread.run(wait_all())
    assert [e.decision for e in events] == [pb.COMPILE_LOCALLY] * 20  # timed out, not hedged
    name = state.records.name_prefix("default", "jit_step")
    assert lookups.count(name) == 1, lookups


async def _last(events):
    seen = [event async for event in events]
    return seen[-1]
