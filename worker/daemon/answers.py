"""How a worker answers its host's processes: an Acquire's answer comes from
an ordered list of sources, each a component, the first that has one:

    HostCacheSource   a HIT from the host cache (no round trip)
    ManifestSource    a HIT from the job's manifest, for exactly the keys it
                      lists (worker/daemon/manifests.py); every byte served
                      for it is verified as any fetch's
    StreamSource      WAIT for a process of a job whose stream is open: the
                      job's designated process compiles, and the stream says
                      when it published (worker/daemon/jobstream.py); nothing
                      goes upstream
    Upstream          one request a key for all the host's callers
                      (worker/daemon/decisions.py), in one message of the
                      credential's Decide stream (worker/daemon/decisions.py);
                      an unreachable coordinator: COMPILE_LOCALLY at once

A wait goes the same way: the job's stream where it serves the waiter, else
upstream, shared with the host's other waits for the key (one upstream wait
for all: worker/daemon/waits.py), within the operator's share-binary timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

from compilecast import decide, retry, tracing, validate
from compilecast.errors import UpstreamError
from compilecast.v1 import cache_pb2 as pb

from .decisions import Deciders, HostDecisions
from .hostcache import HostCache
from .manifests import HostManifests
from .metrics import WorkerMetrics
from .reports import HostHits
from .upstream import CoordinatorLink, relay_error
from .waits import HostWaits

Answered = list[pb.AcquireResponse | None]


class Source(Protocol):
    async def answer(self, ns: str, md: tuple, requests: Sequence[pb.AcquireRequest],
                     answers: Answered) -> None:
        """Fill the answers still None that this source has."""


class HostCacheSource:
    def __init__(self, cache: HostCache, reports: HostHits, metrics: WorkerMetrics) -> None:
        self.cache = cache
        self.reports = reports
        self.metrics = metrics

    async def answer(self, ns, md, requests, answers) -> None:
        keys = [r.key for r in requests]  # one trip to a thread for the batch's lookups
        found = await asyncio.to_thread(lambda: [self.cache.lookup(ns, k) for k in keys])
        for i, info in enumerate(found):
            if answers[i] is None and info is not None:
                answers[i] = hit_here(info, self.reports, self.metrics)


def hit_here(info: pb.ArtifactInfo, reports: HostHits,
             metrics: WorkerMetrics) -> pb.AcquireResponse:
    """A HIT answered on the host: the coordinator never saw it (reported)."""
    metrics.lookups.labels("host_hit").inc()
    reports.saved_here(info)
    return pb.AcquireResponse(decision=pb.HIT, artifact=info)


class ManifestSource:
    """Also where a request learns its job: the job whose manifest records
    the key (coordinator/manifests.py), this host's own when it names none."""

    def __init__(self, manifests: HostManifests, reports: HostHits, metrics: WorkerMetrics,
                 *, job: str) -> None:
        self.manifests = manifests
        self.reports = reports
        self.metrics = metrics
        self.job = job

    async def answer(self, ns, md, requests, answers) -> None:
        for i, r in enumerate(requests):
            r.manifest_job = r.manifest_job or r.requester.job or self.job
            self.manifests.learn(ns, md, r.manifest_job)
            if answers[i] is None and (info := self.entry(ns, r.key)) is not None:
                answers[i] = hit_here(info, self.reports, self.metrics)

    def entry(self, ns: str, key: str) -> pb.ArtifactInfo | None:
        info = self.manifests.answer(ns, key)
        if info is not None:
            self.metrics.manifest_hits.inc()
        return info


class StreamSource:
    def __init__(self, manifests: HostManifests, metrics: WorkerMetrics) -> None:
        self.manifests = manifests
        self.metrics = metrics

    async def answer(self, ns, md, requests, answers) -> None:
        for i, r in enumerate(requests):  # a waiter of its job's designated process
            if answers[i] is None and self.manifests.stream(ns, r.requester) is not None:
                answers[i] = pb.AcquireResponse(decision=pb.WAIT, reason=(
                    f"process {r.requester.designated_process} of job {r.requester.job} "
                    "compiles; the job's stream tells this host"))
                self.metrics.lookups.labels("wait").inc()
                self.metrics.decisions.labels("stream").inc()


class Upstream:
    def __init__(self, link: CoordinatorLink, decisions: HostDecisions, deciders: Deciders,
                 reports: HostHits, metrics: WorkerMetrics) -> None:
        self.link = link
        self.decisions = decisions
        self.deciders = deciders
        self.reports = reports
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
                self.reports.shared(got)
            answers[i] = got

    async def wait(self, md: tuple, request: pb.WaitRequest, until: bool) -> pb.WaitEvent:
        self.metrics.waits.labels("upstream").inc()
        with tracing.span("worker.upstream.wait", key=request.key):
            request.ClearField("trace_context")  # ours, never a caller's map
            tracing.inject(request.trace_context)
            return await self.deciders.of(md).wait(request, until_publishing=until)


class Answers:
    """`sources`, in order, then `upstream`; `jobs`: the manifests a wait
    looks at first (their streams, and what the streams told of); and
    `share_binary_timeout_ms`: the longest a wait of this host's lasts (0:
    as the caller asks)."""

    def __init__(self, sources: Sequence[Source], upstream: Upstream, waits: HostWaits,
                 metrics: WorkerMetrics, *, jobs: ManifestSource | None,
                 share_binary_timeout_ms: int) -> None:
        self.sources = tuple(sources)
        self.jobs = jobs
        self.upstream = upstream
        self.waits = waits
        self.metrics = metrics
        self.share_binary_timeout_ms = share_binary_timeout_ms

    async def decide(self, ns: str, md: tuple, requests: Sequence[pb.AcquireRequest]
                     ) -> list[pb.AcquireResponse]:
        decide.check_batch(requests)
        for r in requests:
            if 0 < r.key_seconds < 3600:
                self.metrics.key_seconds.observe(r.key_seconds)
        answers: Answered = [None] * len(requests)
        for source in (*self.sources, self.upstream):
            await source.answer(ns, md, requests, answers)
        assert all(a is not None for a in answers)  # (upstream answers the rest)
        return [a for a in answers if a is not None]

    def bounded(self, request: pb.WaitRequest) -> pb.WaitRequest:
        """The wait within the operator's share-binary timeout for this host."""
        validate.key(request.key)
        if self.share_binary_timeout_ms > 0:
            request.timeout_ms = min(request.timeout_ms or self.share_binary_timeout_ms,
                                     self.share_binary_timeout_ms)
        return request

    async def wait(self, ns: str, md: tuple, request: pb.WaitRequest,
                   until_publishing: bool) -> pb.WaitEvent:
        """A wait (`bounded` already), shared with this host's other waits
        for the key, over the job's stream or else the Decide stream (a
        message, not a call of its own); an unreachable coordinator means
        COMPILE_LOCALLY."""

        async def one(req: pb.WaitRequest, until: bool) -> pb.WaitEvent:
            jobs = self.jobs
            stream = jobs.manifests.stream(ns, req.requester) if jobs is not None else None
            if jobs is not None and stream is not None:
                info = jobs.entry(ns, req.key)  # (the stream told of it meanwhile)
                if info is not None:
                    self.upstream.reports.saved_here(info)
                    return pb.WaitEvent(decision=pb.HIT, artifact=info)
                self.metrics.waits.labels("stream").inc()  # (sent on it; maybe upstream next)
                event = await stream.wait(req, until)
                if event is not None:
                    if event.decision == pb.HIT:  # (the coordinator answered no wait of ours)
                        self.upstream.reports.saved_here(event.artifact)
                    return event
            return await self.upstream.wait(md, req, until)

        deadline = time.monotonic() + request.timeout_ms / 1000.0 if request.timeout_ms else None

        async def once() -> pb.WaitEvent:
            if deadline is not None:
                request.timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
            return await self.waits.wait(md, request, until_publishing, one)

        # A replica stopping (a rolling update) ends its waits: asked again, on
        # a new stream, rather than have every waiter compile (retry.RELAYED_WAIT).
        try:
            return await retry.RELAYED_WAIT.arun(once, what=f"the wait for {request.key}",
                                                 deadline=deadline)
        except UpstreamError as exc:
            if exc.status not in retry.DEGRADED:
                raise relay_error(exc) from None
            return pb.WaitEvent(decision=pb.COMPILE_LOCALLY,
                                reason=self.upstream.local("wait", exc))
