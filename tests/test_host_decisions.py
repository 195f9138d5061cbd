"""A host's requests for one key go upstream as one (worker/daemon/decisions.py):
unit tests with an upstream of our own, then through a real worker and
coordinator."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.daemon.decisions import HostDecisions
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import all_at_once, until

WAIT = pb.AcquireResponse(decision=pb.WAIT, reason="compiled by gpu0")
COMPILE = pb.AcquireResponse(decision=pb.COMPILE, lease=pb.Lease(id=7, revision=9))


def req(process_id: int, key: str = "k", job: str = "j") -> pb.AcquireRequest:
    return pb.AcquireRequest(key=key, requester=pb.Requester(
        job=job, process_id=process_id, designated_process=0, client=f"gpu{process_id}"))


class Upstream:
    """Answers each call with the next of `answers` (one per request, or an
    exception for the call; the last one for every call after it) once `go`
    is set."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.asked: list[list[int]] = []  # the process ids of each call
        self.go = asyncio.Event()

    async def __call__(self, requests: list[pb.AcquireRequest]) -> list[pb.AcquireResponse]:
        self.asked.append([r.requester.process_id for r in requests])
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        await self.go.wait()
        if isinstance(answer, Exception):
            raise answer
        return [answer] * len(requests)


def counted() -> Counter:
    return Counter("decisions", "test", ["how"], registry=CollectorRegistry())


def run_all(loop_thread, decisions: HostDecisions, up: Upstream, *calls):
    """Start each call's decide, let the upstream answer, return each's result
    (or the exception it raised)."""

    async def body():
        tasks = [asyncio.ensure_future(decisions.decide(scope, rs, up)) for scope, rs in calls]
        await until(lambda: decisions.deciding == sum(len(rs) for _, rs in calls),
                    "every request being decided")
        up.go.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    return loop_thread.run(body())


def test_a_hosts_processes_share_one_request_for_a_key(loop_thread):
    up, c = Upstream(WAIT), counted()
    results = run_all(loop_thread, HostDecisions(c), up,
                      *(("cred", [req(p)]) for p in (3, 1, 2, 4)))
    assert up.asked == [[3]]  # the first to ask went upstream; the rest joined it
    assert [[(a.decision, joined) for a, joined in r] for r in results] == \
        [[(pb.WAIT, False)], [(pb.WAIT, True)], [(pb.WAIT, True)], [(pb.WAIT, True)]]
    assert results[1][0][0].reason == WAIT.reason
    assert results[1][0][0] is not results[0][0][0]  # a copy each
    assert (c.labels("upstream")._value.get(), c.labels("joined")._value.get()) == (1, 3)


def test_a_compile_is_not_shared_its_joiners_ask_again(loop_thread):
    up = Upstream(COMPILE, WAIT)
    results = run_all(loop_thread, HostDecisions(), up,
                      *(("cred", [req(p, job="")]) for p in (5, 6, 7)))
    assert up.asked == [[5], [6], [7]]
    decisions = [r[0][0].decision for r in results]
    assert decisions == [pb.COMPILE, pb.WAIT, pb.WAIT]
    assert not any(joined for r in results for _, joined in r)


def test_the_designated_process_never_joins_and_is_never_joined(loop_thread):
    up = Upstream(COMPILE, WAIT, WAIT)
    results = run_all(loop_thread, HostDecisions(), up,
                      ("cred", [req(0)]), ("cred", [req(1)]), ("cred", [req(0)]))
    assert sorted(up.asked) == [[0], [0], [1]]  # three calls: nothing shared
    assert [r[0][0].decision for r in results] == [pb.COMPILE, pb.WAIT, pb.WAIT]


def test_other_credentials_jobs_and_keys_do_not_share(loop_thread):
    up = Upstream(WAIT, WAIT, WAIT, WAIT)
    run_all(loop_thread, HostDecisions(), up,
            ("cred", [req(1)]), ("other", [req(2)]), ("cred", [req(3, job="j2")]),
            ("cred", [req(4, key="k2")]))
    assert len(up.asked) == 4


def test_a_failed_request_sends_its_joiners_to_ask_alone(loop_thread):
    up = Upstream(ConnectionError("stream broke"), WAIT)
    results = run_all(loop_thread, HostDecisions(), up, ("cred", [req(1)]), ("cred", [req(2)]),
                      ("cred", [req(3)]))
    assert isinstance(results[0], ConnectionError)
    assert [r[0][0].decision for r in results[1:]] == [pb.WAIT, pb.WAIT]
    assert up.asked == [[1], [2], [3]]


def test_a_cancelled_request_sends_its_joiners_to_ask_alone(loop_thread):
    up = Upstream(WAIT, WAIT)
    decisions = HostDecisions()

    async def body():
        leader = asyncio.ensure_future(decisions.decide("cred", [req(1)], up))
        await until(lambda: up.asked, "the leader asking upstream")
        joiner = asyncio.ensure_future(decisions.decide("cred", [req(2)], up))
        await until(lambda: decisions.deciding == 2, "the joiner joined")
        leader.cancel()  # its process went away
        await until(lambda: len(up.asked) == 2, "the joiner asking alone")
        up.go.set()
        return await joiner

    ((answer, joined),) = loop_thread.run(body())
    assert answer.decision == pb.WAIT and not joined and up.asked == [[1], [2]]


def test_an_answer_is_shared_only_while_its_request_is_in_flight(loop_thread):
    up = Upstream(WAIT, pb.AcquireResponse(decision=pb.HIT))
    decisions = HostDecisions()

    async def body():
        up.go.set()
        first = await decisions.decide("cred", [req(1)], up)
        second = await decisions.decide("cred", [req(2)], up)  # after: asks again
        return first, second

    first, second = loop_thread.run(body())
    assert (first[0][0].decision, second[0][0].decision) == (pb.WAIT, pb.HIT)
    assert up.asked == [[1], [2]]


# -- through a real worker and coordinator ------------------------------------

def test_a_hosts_processes_get_their_answers_and_every_one_is_counted_once(
        coordinator, start_worker):
    """Eight processes of a job on one host ask for the same programs at
    once, before and after the designated process (on another host) has
    compiled them. Whatever was shared, each gets the coordinator's answer,
    and each answer is counted once: by the coordinator if it went upstream,
    by the worker if another process's request answered it (without the
    job's stream: tests/test_job_streams.py)."""
    w = start_worker(coordinator.cfg.listen, job_streams=False)
    keys = [f"prog{i}" for i in range(6)]
    procs = [CacheClient(w.cfg.listen, timeout_s=10,
                         identity=Identity(job="j", process_id=p, designated_process=0,
                                           client=f"gpu{p}"))
             for p in range(1, 9)]
    designated = CacheClient(coordinator.cfg.listen,
                             identity=Identity(job="j", process_id=0, client="host0"))

    def everyone_asks() -> list[list[pb.AcquireResponse]]:
        return all_at_once([lambda p=p: [p.acquire(k) for k in keys] for p in procs])

    before = everyone_asks()
    assert {a.decision for answers in before for a in answers} == {pb.WAIT}
    for k in keys:
        designated.publish(k, designated.acquire(k).lease, b"exe-" + k.encode(), 2.0)
    after = everyone_asks()
    assert {a.decision for answers in after for a in answers} == {pb.HIT}
    assert all(a.artifact.key == k for answers in after for a, k in zip(answers, keys, strict=True))

    wr, cr = w.registry, coordinator.registry
    asked = 2 * len(procs) * len(keys)
    upstream = wr.get_sample_value("compilecast_worker_decisions_total", {"how": "upstream"})
    joined = wr.get_sample_value("compilecast_worker_decisions_total", {"how": "joined"}) or 0
    assert upstream + joined == asked
    assert wr.get_sample_value("compilecast_worker_lookups_total", {"result": "wait"}) == asked / 2
    assert wr.get_sample_value("compilecast_worker_lookups_total", {"result": "hit"}) == asked / 2
    # The coordinator saw the upstream ones (and the designated process's own).
    coordinator_lookups = sum(cr.get_sample_value("compilecast_coordinator_lookups_total",
                                                  {"result": r}) or 0 for r in ("hit", "miss"))
    assert coordinator_lookups == upstream + len(keys)
    saved = (cr.get_sample_value("compilecast_coordinator_saved_compile_seconds_total")
             + wr.get_sample_value("compilecast_worker_saved_compile_seconds_total"))
    assert saved == 2.0 * asked / 2  # every process's hit saved its compile, counted once
    status = procs[0].status()  # what `compilecast status` prints, through the worker
    assert (status.hits, status.misses) == (asked / 2, asked / 2 + len(keys))
    assert status.compile_seconds_saved == saved
    for c in (designated, *procs):
        c.close()
