"""A host's waits for one key, sent to the coordinator as one.

On a GPU host every process (one per GPU) waits for the same programs at
the same moment. The worker sends one wait upstream per key and credential,
in the name of the lowest process id among its waiters, and answers all of
them from it:

- HIT, or the notice that the holder has started to publish: everyone.
  A holder of this host that publishes through this worker is noticed here
  first: its host's waiters until publishing are told at once (`publishing`).
- COMPILE (a promotion or a hedge): the lowest process id of the job it was
  asked for, among the waiters then (one may have joined after the upstream
  wait was sent; publish checks the job, not the process); the others wait
  on, under a new upstream wait.
- COMPILE_LOCALLY when the upstream wait timed out: those whose own timeout
  has come; the others (who started waiting later) wait on. Any other
  COMPILE_LOCALLY (the holder's compile failed, etcd is unreachable):
  everyone.
- An error (the stream failed): everyone, as an exception; each caller
  handles it as it would its own.

Each waiter keeps its own timeout here too: the upstream wait runs until the
latest of them, and a waiter whose time has come gets COMPILE_LOCALLY at
once. A waiter that leaves (its process went away) leaves the group; the
last one to leave cancels the upstream wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable

from compilecast.deadline import Deadline
from compilecast.v1 import cache_pb2 as pb

Upstream = Callable[[pb.WaitRequest, bool], Awaitable[pb.WaitEvent]]

GRACE_S = 1.0  # a waiter's own timeout backs up the coordinator's, this much later
EARLY_S = 0.5  # a COMPILE_LOCALLY this close to the upstream deadline is its timeout


class _Waiter:
    __slots__ = ("deadline", "done", "request")

    def __init__(self, request: pb.WaitRequest, done: asyncio.Future,
                 deadline: Deadline) -> None:
        self.request = request
        self.done = done
        self.deadline = deadline


def _rank(w: _Waiter) -> int:
    return w.request.requester.process_id


class _Group:
    __slots__ = ("task", "waiters")

    def __init__(self) -> None:
        self.waiters: list[_Waiter] = []
        self.task: asyncio.Task | None = None


class HostWaits:
    """`counted` (optional): a Counter labelled by "joined" (a wait that
    shared another's); the upstream function counts what it sends."""

    def __init__(self, counted=None) -> None:
        self._groups: dict[tuple, _Group] = {}
        self._counted = counted

    @property
    def waiting(self) -> int:
        """Waits in progress (processes waiting, on a worker)."""
        return sum(len(g.waiters) for g in self._groups.values())

    def _count(self, how: str) -> None:
        if self._counted is not None:
            self._counted.labels(how).inc()

    async def wait(self, scope: Hashable, request: pb.WaitRequest, until_publishing: bool,
                   upstream: Upstream, deadline: Deadline | None = None) -> pb.WaitEvent:
        """The event that ends this wait (see the module docstring) by
        `deadline` (default: as the request says); `scope` (the upstream
        credential) separates waits that must not be shared."""
        if deadline is None:
            deadline = Deadline.after_ms(request.timeout_ms)
        gk = (scope, request.key, until_publishing)
        group = self._groups.get(gk)
        if group is None or (group.task is not None and group.task.cancelling()):
            group = self._groups[gk] = _Group()  # (a group whose last waiter left is ending)
        else:
            self._count("joined")
        me = _Waiter(request, asyncio.get_running_loop().create_future(), deadline)
        group.waiters.append(me)
        if group.task is None:
            group.task = asyncio.create_task(self._run(gk, group, upstream, until_publishing))
        limit = deadline.left_s() + GRACE_S if deadline.bounded else None
        try:
            return await asyncio.wait_for(me.done, limit)
        except TimeoutError:
            return pb.WaitEvent(decision=pb.COMPILE_LOCALLY,
                                reason=f"share-binary timeout of {deadline.said()} "
                                       "passed; compile locally")
        finally:
            if me in group.waiters:
                group.waiters.remove(me)
            if not group.waiters and group.task is not None:
                group.task.cancel()  # nobody left to answer: end the upstream wait

    def publishing(self, scope: Hashable, key: str, event: pb.WaitEvent) -> int:
        """A process of this host has started to publish `key` through this
        worker (under the credential `scope`): its waiters until publishing
        get `event` now, before the coordinator could tell them, and follow
        the worker's copy as it is written. The upstream wait ends with its
        last waiter. Returns how many were woken."""
        group = self._groups.get((scope, key, True))
        if group is None:
            return 0
        woken = 0
        for w in list(group.waiters):
            group.waiters.remove(w)
            if not w.done.done():
                w.done.set_result(event)
                woken += 1
        return woken

    async def _run(self, gk: tuple, group: _Group, upstream: Upstream,
                   until_publishing: bool) -> None:
        try:
            while group.waiters:
                leader = min(group.waiters, key=_rank)
                request = pb.WaitRequest()
                request.CopyFrom(leader.request)
                last = max((w.deadline for w in group.waiters), key=lambda d: d.at)
                request.timeout_ms = last.left_ms()  # (0: one waits without a bound)
                try:  # (counted by the caller's upstream: sent up, or on the job's stream)
                    event = await upstream(request, until_publishing)
                except Exception as exc:  # each caller handles it as its own
                    for w in group.waiters:
                        if not w.done.done():
                            w.done.set_exception(exc)
                    return
                if event.decision == pb.COMPILE:
                    # One lease, for the lowest waiter of the job it was asked
                    # for (publish checks the job): who is lowest may have
                    # joined after the upstream wait was sent.
                    job = leader.request.requester.job
                    taker = min((w for w in group.waiters if w.request.requester.job == job),
                                key=_rank, default=None)
                    if taker is not None:
                        group.waiters.remove(taker)
                        if not taker.done.done():
                            taker.done.set_result(event)
                    continue
                now = time.monotonic()
                timed_out = (event.decision == pb.COMPILE_LOCALLY and last.bounded
                             and now >= last.at - EARLY_S)
                for w in list(group.waiters):
                    if timed_out and w.deadline.at > now + EARLY_S:
                        continue  # started waiting later: waits on
                    group.waiters.remove(w)
                    if not w.done.done():
                        w.done.set_result(event)
                if not timed_out:
                    return
        finally:
            if self._groups.get(gk) is group:
                del self._groups[gk]
