"""Latency metrics: the coordinator's etcd requests by method and the Acquire
decisions that had to ask etcd; a worker's decisions sent to the coordinator
(real etcd, real gRPC)."""

from __future__ import annotations

import asyncio
import os

import pytest

from compilecast.coordinator.etcd import Etcd
from compilecast.errors import Unavailable
from compilecast.launch import free_port
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import sample


def decided_via_etcd(coordinator, decision: str) -> float:
    return sample(coordinator, "compilecast_coordinator_etcd_decision_seconds_count",
                  decision=decision)


def test_a_miss_is_timed_as_an_etcd_decision_and_a_hit_from_memory_is_not(coordinator):
    holder = CacheClient(coordinator.cfg.listen, identity=Identity(client="holder"))
    other = CacheClient(coordinator.cfg.listen, identity=Identity(client="other"))
    key = os.urandom(32).hex()
    txns = sample(coordinator, "compilecast_coordinator_etcd_request_seconds_count",
                  method="Txn")

    lease = holder.acquire(key)
    assert lease.decision == pb.COMPILE
    assert decided_via_etcd(coordinator, "compile") == 1
    # The claim was a write txn, and it took some time.
    assert sample(coordinator, "compilecast_coordinator_etcd_request_seconds_count",
                  method="Txn") > txns
    assert sample(coordinator, "compilecast_coordinator_etcd_decision_seconds_sum",
                  decision="compile") > 0

    holder.publish(key, lease.lease, b"executable bytes", 3.0)
    hits = [other.acquire(key).decision for _ in range(10)]
    assert hits == [pb.HIT] * 10
    assert sample(coordinator, "compilecast_coordinator_decisions_total", decision="hit") >= 10
    # The replica that took the publish knows the artifact: its HITs need no
    # etcd round trip, and only those that do are timed here.
    assert decided_via_etcd(coordinator, "hit") <= 1
    assert decided_via_etcd(coordinator, "compile") == 1


def test_every_etcd_request_is_observed_by_method_failures_too(etcd):
    seen: list[tuple[str, float]] = []

    async def run() -> None:
        client = Etcd([etcd.endpoint])
        client.observe = lambda method, seconds: seen.append((method, seconds))
        try:
            await client.put(b"/metrics-test/a", b"1")
            assert await client.get_many([b"/metrics-test/a", b"/metrics-test/b"]) != [None, None]
            await client.get(b"/metrics-test/a")
        finally:
            await client.close()
        gone = Etcd([f"127.0.0.1:{free_port()}"], timeout=0.5)
        gone.observe = lambda method, seconds: seen.append((method, seconds))
        try:
            with pytest.raises(Unavailable):
                await gone.get(b"/metrics-test/a")
        finally:
            await gone.close()

    asyncio.run(run())
    # get_many is a read-only txn: told apart from the write txns.
    assert [m for m, _ in seen] == ["Put", "Txn/read", "Range", "Range"]
    assert all(s >= 0 for _, s in seen)
    # The failed request is observed once, its retries included.
    assert seen[-1][1] > 0.05


def upstream(worker, result: str) -> float:
    return sample(worker, "compilecast_worker_upstream_decision_seconds_count", result=result)


def test_a_worker_times_what_it_asks_the_coordinator(coordinator, start_worker):
    w = start_worker(coordinator.cfg.listen)
    proc = CacheClient(w.cfg.listen, identity=Identity(client="p0"))
    try:
        assert proc.acquire(os.urandom(32).hex()).decision == pb.COMPILE
        assert upstream(w, "answered") == 1
        assert sample(w, "compilecast_worker_upstream_decision_seconds_sum",
                      result="answered") > 0
        assert upstream(w, "unreachable") == 0
    finally:
        proc.close()


def test_a_worker_times_a_coordinator_it_cannot_reach_apart(start_worker):
    w = start_worker(f"127.0.0.1:{free_port()}")  # nothing listens there
    proc = CacheClient(w.cfg.listen, identity=Identity(client="p0"))
    try:
        assert proc.acquire(os.urandom(32).hex()).decision == pb.COMPILE_LOCALLY
        assert upstream(w, "unreachable") == 1
        assert upstream(w, "answered") == 0
    finally:
        proc.close()
