"""A host's decisions upstream: one request a key for all the host's callers
(HostDecisions), on one Decide stream a credential (Deciders).

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

The Decide streams upstream (compilecast/decide.py's `Decider`) are one a
caller credential, the least recently used closed past MAX_DECIDERS once its
waits have ended.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Hashable

from compilecast import retry, tracing
from compilecast.decide import Decider
from compilecast.errors import UpstreamError
from compilecast.serving import Background
from compilecast.v1 import cache_pb2 as pb

from .hits import HostHits
from .metrics import WorkerMetrics
from .upstream import CoordinatorLink, relay_error

Asking = Callable[[list[pb.AcquireRequest]], Awaitable[list[pb.AcquireResponse]]]


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
                     upstream: Asking) -> list[tuple[pb.AcquireResponse, bool]]:
        """(answer, joined) for each request, in order; what `upstream` raises
        for the requests it was sent propagates."""
        self.deciding += len(requests)
        try:
            return await self._decide(scope, requests, upstream)
        finally:
            self.deciding -= len(requests)

    async def _decide(self, scope: Hashable, requests: list[pb.AcquireRequest],
                      upstream: Asking) -> list[tuple[pb.AcquireResponse, bool]]:
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


MAX_DECIDERS = 64  # upstream Decide streams kept open (one per caller credential)


class Deciders:
    """`gap_s`: between two messages of a Decide stream upstream."""

    def __init__(self, link: CoordinatorLink, background: Background, *, gap_s: float) -> None:
        self.link = link
        self.background = background
        self.gap_s = gap_s
        self.open: collections.OrderedDict[tuple, Decider] = collections.OrderedDict()
        self.retiring: set[Decider] = set()  # evicted, closed once their waits end

    def of(self, md: tuple) -> Decider:
        """The Decide stream to the coordinator for one upstream credential."""
        decider = self.open.pop(md, None)
        if decider is None:
            decider = Decider(self.link.decisions, md, timeout_s=self.link.rpc_timeout_s,
                              gap_s=self.gap_s)
            if len(self.open) >= MAX_DECIDERS:  # the least recently used goes
                _, old = self.open.popitem(last=False)
                self.retiring.add(old)  # closed at shutdown too, if its waits last that long
                self.background.spawn(self._retire(old))
        self.open[md] = decider
        return decider

    def credentials(self) -> list[tuple]:
        """The credentials of the streams open now (the per-job tokens in use)."""
        return list(self.open)

    async def _retire(self, decider: Decider) -> None:
        """Close a stream no longer used once its waits have ended (they may
        last the share-binary timeout: cutting them would fail them)."""
        try:
            await decider.close(when_idle=True)
        finally:
            self.retiring.discard(decider)

    async def close(self) -> None:
        for decider in [*self.open.values(), *self.retiring]:
            await decider.close()


class Upstream:
    """An Acquire's last source: one request a key for all the host's
    callers, in one message of the credential's Decide stream; an
    unreachable coordinator: COMPILE_LOCALLY at once. And a wait upstream,
    a message of the same stream."""

    def __init__(self, link: CoordinatorLink, decisions: HostDecisions, deciders: Deciders,
                 hits: HostHits, metrics: WorkerMetrics) -> None:
        self.link = link
        self.decisions = decisions
        self.deciders = deciders
        self.hits = hits
        self.metrics = metrics
        self._answered = metrics.upstream_decision_seconds.labels("answered")
        self._unreachable = metrics.upstream_decision_seconds.labels("unreachable")

    def local(self, rpc_name: str, exc: UpstreamError) -> str:
        """Why a caller compiles locally: the coordinator does not answer."""
        self.metrics.fallbacks.labels(rpc_name).inc()
        return f"coordinator {self.link.address} unreachable ({exc.status.name}); compile locally"

    async def answer(self, ns, md, requests, answers) -> None:
        ask = [r for r, a in zip(requests, answers, strict=True) if a is None]
        if not ask:
            return
        start = time.perf_counter()
        try:  # shared with this host's other requests for the key (worker/daemon/decisions.py)
            with tracing.span("worker.upstream.decide", keys=len(ask)):
                for r in ask:  # ours, never a caller's map
                    r.ClearField("trace_context")
                    tracing.inject(r.trace_context)
                upstream = await self.decisions.decide(md, ask, self.deciders.of(md).decide)
            self._answered.observe(time.perf_counter() - start)
        except UpstreamError as exc:  # (the Decider's: compilecast/decide.py's edge)
            if exc.status not in retry.DEGRADED:
                raise relay_error(exc) from None
            self._unreachable.observe(time.perf_counter() - start)
            why = self.local("acquire", exc)
            upstream = [(pb.AcquireResponse(decision=pb.COMPILE_LOCALLY, reason=why), False)
                        for _ in ask]
        it = iter(upstream)
        for i, a in enumerate(answers):
            if a is not None:
                continue
            got, joined = next(it)
            self.metrics.lookups.labels(pb.Decision.Name(got.decision).lower()).inc()
            if joined:  # nor this one: another's request was (for Status)
                self.hits.shared(got)
            answers[i] = got

    async def wait(self, md: tuple, request: pb.WaitRequest, until: bool) -> pb.WaitEvent:
        self.metrics.waits.labels("upstream").inc()
        with tracing.span("worker.upstream.wait", key=request.key):
            request.ClearField("trace_context")  # ours, never a caller's map
            tracing.inject(request.trace_context)
            return await self.deciders.of(md).wait(request, until_publishing=until)
