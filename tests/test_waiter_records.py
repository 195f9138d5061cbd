"""Waiter records: one P/w record per key and replica counts that replica's
waiters (a pod's job start writes a few per key, not two per waiter); the
promotion order, hedging and `status` read them. Unit tests of the record,
then a real coordinator (and two replicas) over a real etcd."""

from __future__ import annotations

import json
import threading
import time

from compilecast.coordinator import waiting as waiting_mod
from compilecast.coordinator.etcd import KV
from compilecast.coordinator.keystate import KeyWaiters, lowest_rank, waiters_by_job
from compilecast.coordinator.records import scope
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import eventually

DATA = b"waiter-records" * 1000


def test_a_replicas_waiters_keep_their_count_jobs_and_lowest_rank():
    w = KeyWaiters()
    for rank, job in (("0000000003", "a"), ("0000000001", "a"), ("0000000002", "b"),
                      ("0000000001", "a")):
        w.add(rank, job)
    assert (w.count, w.lowest, dict(w.jobs)) == (4, "0000000001", {"a": 3, "b": 1})
    assert w.below("0000000003") == 3 and w.below("0000000001") == 0
    w.remove("0000000001", "a")  # one of the two under the lowest rank: it stays lowest
    assert w.lowest == "0000000001"
    w.remove("0000000001", "a")
    assert (w.count, w.lowest) == (2, "0000000002")
    assert json.loads(w.record()) == {"count": 2, "lowest": "0000000002",
                                      "jobs": {"a": 1, "b": 1}}
    w.remove("0000000002", "b")
    w.remove("0000000003", "a")
    assert (w.count, w.lowest, dict(w.ranks), dict(w.jobs)) == (0, "", {}, {})


def test_a_replicas_record_of_its_waiters_is_read():
    mine = KV(b"/p/w/default/k/3f2a", KeyWaiters().record(), 1, 1, 0)
    assert lowest_rank(mine) is None and waiters_by_job(mine) == {}
    w = KeyWaiters()
    w.add("0000000007", "job-1")
    w.add("0000000005", "job-2")
    ours = KV(b"/p/w/default/k/3f2a", w.record(), 1, 1, 0)
    assert lowest_rank(ours) == "0000000005"
    assert waiters_by_job(ours) == {"job-1": 1, "job-2": 1}
    damaged = KV(b"/p/w/default/k/3f2a", b"not json", 1, 1, 0)
    assert waiters_by_job(damaged) == {"": 1}  # counted as one, never fails a status
    assert lowest_rank(damaged) is None  # and names no rank: it never goes first


def _records(coordinator, loop_thread, key: str) -> list[KV]:
    state = coordinator.state
    return loop_thread.run(state.etcd.get_prefix(state.view.k("w", scope("default", key)) + b"/"))


def test_a_replicas_waiters_of_a_key_share_one_record(coordinator, loop_thread):
    target = coordinator.cfg.listen
    holder = CacheClient(target, identity=Identity(job="j", process_id=0))
    lease = holder.acquire("shared").lease
    results: dict[int, pb.WaitEvent] = {}

    def wait(pid: int) -> None:
        c = CacheClient(target, identity=Identity(job="j", process_id=pid))
        try:
            results[pid] = c.wait("shared", 60)
        finally:
            c.close()

    threads = [threading.Thread(target=wait, args=(pid,)) for pid in range(1, 13)]
    for t in threads:
        t.start()

    def counted() -> bool:
        recs = _records(coordinator, loop_thread, "shared")
        return len(recs) == 1 and json.loads(recs[0].value)["count"] == 12

    eventually(counted, "one record counting the 12 waiters")
    (rec,) = _records(coordinator, loop_thread, "shared")
    assert json.loads(rec.value) == {"count": 12, "lowest": "0000000001", "jobs": {"j": 12}}
    st = holder.status()
    assert st.waiters == 12
    assert [(j.job, j.waiters) for j in st.jobs] == [("j", 12)]
    assert [(f.key, f.waiters) for f in st.in_flight] == [("shared", 12)]

    holder.publish("shared", lease, DATA, 1.0)
    for t in threads:
        t.join(20)
    assert {pid: e.decision for pid, e in results.items()} == {pid: pb.HIT for pid in range(1, 13)}
    eventually(lambda: not _records(coordinator, loop_thread, "shared"),
               "the record deleted once no waiter is left")
    assert holder.status().waiters == 0


def test_status_counts_its_own_waiters_before_their_record_lands(coordinator, loop_thread,
                                                                monkeypatch):
    """A replica's record of its waiters lands WAITER_FLUSH_S after they
    come; its `status` counts them from the moment they wait, and once."""
    monkeypatch.setattr(waiting_mod, "WAITER_FLUSH_S", 5.0)  # margin for a loaded machine
    target = coordinator.cfg.listen
    holder = CacheClient(target, identity=Identity(job="j", process_id=0))
    lease = holder.acquire("slow").lease
    waiter = CacheClient(target, identity=Identity(job="j", process_id=1))
    got: list[pb.WaitEvent] = []
    t = threading.Thread(target=lambda: got.append(waiter.wait("slow", 60)))
    t.start()
    eventually(lambda: coordinator.registry.get_sample_value(
        "compilecast_coordinator_waiters") == 1, "the process waiting")
    assert _records(coordinator, loop_thread, "slow") == []  # not written yet
    st = holder.status()
    assert (st.waiters, [(f.key, f.waiters) for f in st.in_flight]) == (1, [("slow", 1)])
    assert [(j.job, j.compiles_in_flight, j.waiters) for j in st.jobs] == [("j", 1, 1)]
    eventually(lambda: len(_records(coordinator, loop_thread, "slow")) == 1, "the record",
               seconds=30)
    assert holder.status().waiters == 1  # the replica's own record is not counted again
    holder.publish("slow", lease, DATA, 1.0)
    t.join(20)
    waiter.close()
    assert [e.decision for e in got] == [pb.HIT]


def test_the_lowest_waiter_of_all_replicas_is_promoted_first(start_coordinator, tmp_path):
    """Process 1 waits on one replica, processes 2 and 3 on the other; the
    holder dies: process 1 compiles, and the others take its artifact."""
    shared = tmp_path / "shared-store"
    r1 = start_coordinator(store_dir=shared, lease_ttl_s=2)
    r2 = start_coordinator(store_dir=shared, lease_ttl_s=2)
    dead = CacheClient(r1.cfg.listen, identity=Identity(job="j", process_id=0))
    assert dead.acquire("orphan").decision == pb.COMPILE  # never kept alive: it "died"
    results: dict[int, tuple[float, pb.WaitEvent]] = {}

    def wait(pid: int, target: str) -> None:
        c = CacheClient(target, identity=Identity(job="j", process_id=pid))
        try:
            event = c.wait("orphan", 60)
            results[pid] = (time.monotonic(), event)
            if event.decision == pb.COMPILE:
                c.publish("orphan", event.lease, DATA, 1.0)
        finally:
            c.close()

    threads = [threading.Thread(target=wait, args=(3, r1.cfg.listen)),
               threading.Thread(target=wait, args=(2, r1.cfg.listen)),
               threading.Thread(target=wait, args=(1, r2.cfg.listen))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {pid: e.decision for pid, (_, e) in results.items()} == {
        1: pb.COMPILE, 2: pb.HIT, 3: pb.HIT}, results
    assert dead.fetch("orphan")[1] == DATA
