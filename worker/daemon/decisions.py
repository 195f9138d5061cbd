"""A host's decisions for one key, sent to the coordinator as one.

On a GPU host every process (one per GPU) asks for the same programs at the
same moment. A process's request for a key joins one that another process of
the same job (or, outside any job, any process) has in flight for the same
key and credential, and takes its answer, instead of going upstream too:

- HIT, WAIT and COMPILE_LOCALLY are what the coordinator would have told each
  of them (the same key, tenant and job, a few milliseconds apart; a WAIT that
  is stale by then is corrected by the wait that follows it).
- COMPILE is a lease for the one process that asked: a joiner of it asks again
  on its own (and is then told to WAIT).
- The designated process of a job never joins and is never joined: its
  answer is its COMPILE.
- A request that failed sends its joiners to ask on their own.

The coordinator then counts one decision for the host's processes; the
worker counts every process's answer (`compilecast_worker_lookups_total`,
and `compilecast_worker_decisions_total{how="upstream"|"joined"}`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable

from compilecast.v1 import cache_pb2 as pb

Upstream = Callable[[list[pb.AcquireRequest]], Awaitable[list[pb.AcquireResponse]]]


def _share_key(scope: Hashable, r: pb.AcquireRequest) -> tuple | None:
    """What a request may share an answer over, or None when it asks alone."""
    q = r.requester
    if q.job and q.process_id == q.designated_process:
        return None
    return scope, r.key, q.job, q.designated_process if q.job else 0


class HostDecisions:
    """`counted` (optional): a Counter labelled by "upstream" (a request sent
    to the coordinator) and "joined" (one answered by another's request)."""

    def __init__(self, counted=None) -> None:
        self._deciding: dict[tuple, asyncio.Future] = {}
        self._counted = counted
        self.deciding = 0  # requests being decided now (sent upstream, or joined)

    def _count(self, how: str, n: int) -> None:
        if self._counted is not None and n:
            self._counted.labels(how).inc(n)

    async def decide(self, scope: Hashable, requests: list[pb.AcquireRequest],
                     upstream: Upstream) -> list[tuple[pb.AcquireResponse, bool]]:
        """(answer, joined) for each request, in order; what `upstream` raises
        for the requests it was sent propagates."""
        self.deciding += len(requests)
        try:
            return await self._decide(scope, requests, upstream)
        finally:
            self.deciding -= len(requests)

    async def _decide(self, scope: Hashable, requests: list[pb.AcquireRequest],
                      upstream: Upstream) -> list[tuple[pb.AcquireResponse, bool]]:
        loop = asyncio.get_running_loop()
        send: list[int] = []
        led: dict[int, tuple[tuple, asyncio.Future]] = {}  # position in send -> share
        joins: dict[int, asyncio.Future] = {}
        for i, r in enumerate(requests):
            share = _share_key(scope, r)
            fut = self._deciding.get(share) if share is not None else None
            if fut is not None:
                joins[i] = fut
                continue
            if share is not None:
                fut = loop.create_future()
                self._deciding[share] = fut
                led[len(send)] = (share, fut)
            send.append(i)
        answers: list[pb.AcquireResponse | None] = [None] * len(requests)
        try:
            if send:
                got = await upstream([requests[i] for i in send])
                self._count("upstream", len(send))
                for j, (i, answer) in enumerate(zip(send, got, strict=True)):
                    answers[i] = answer
                    if j in led:
                        led[j][1].set_result(answer)
        finally:
            for share, fut in led.values():
                if not fut.done():
                    fut.set_result(None)  # failed or cancelled: joiners ask alone
                if self._deciding.get(share) is fut:
                    del self._deciding[share]
        joined = [False] * len(requests)
        again: list[int] = []
        for i, fut in joins.items():
            answer = await asyncio.shield(fut)
            if answer is None or answer.decision == pb.COMPILE:
                again.append(i)
            else:
                copy = pb.AcquireResponse()
                copy.CopyFrom(answer)
                answers[i] = copy
                joined[i] = True
        self._count("joined", sum(joined))
        if again:
            got = await upstream([requests[i] for i in again])
            self._count("upstream", len(again))
            for i, answer in zip(again, got, strict=True):
                answers[i] = answer
        decided = [a for a in answers if a is not None]
        assert len(decided) == len(answers)  # each joined, or asked upstream
        return list(zip(decided, joined, strict=True))
