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

from collections.abc import Sequence
from typing import Protocol

from compilecast import decide, retry, validate
from compilecast.deadline import Deadline
from compilecast.errors import UpstreamError
from compilecast.v1 import cache_pb2 as pb

from .decisions import Upstream
from .manifests import ManifestSource
from .metrics import WorkerMetrics
from .upstream import relay_error
from .waits import HostWaits

Answered = list[pb.AcquireResponse | None]


class Source(Protocol):
    async def answer(self, ns: str, md: tuple, requests: Sequence[pb.AcquireRequest],
                     answers: Answered) -> None:
        """Fill the answers still None that this source has."""


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

    def deadline(self, request: pb.WaitRequest) -> Deadline:
        """When a process's wait ends: as it asks, within the operator's
        share-binary timeout for this host (the worker's edge)."""
        validate.key(request.key)
        return Deadline.asked(request.timeout_ms, self.share_binary_timeout_ms)

    async def wait(self, ns: str, md: tuple, request: pb.WaitRequest,
                   until_publishing: bool, within: Deadline) -> pb.WaitEvent:
        """A wait, shared with this host's other waits for the key, over the
        job's stream or else the Decide stream (a message, not a call of its
        own), by `within` (`deadline`); an unreachable coordinator means
        COMPILE_LOCALLY."""

        async def one(req: pb.WaitRequest, until: bool) -> pb.WaitEvent:
            jobs = self.jobs
            stream = jobs.manifests.stream(ns, req.requester) if jobs is not None else None
            if jobs is not None and stream is not None:
                info = jobs.entry(ns, req.key)  # (the stream told of it meanwhile)
                if info is not None:
                    jobs.hits.saved_here(info)
                    return pb.WaitEvent(decision=pb.HIT, artifact=info)
                self.metrics.waits.labels("stream").inc()  # (sent on it; maybe upstream next)
                event = await stream.wait(req, until)
                if event is not None:
                    if event.decision == pb.HIT:  # (the coordinator answered no wait of ours)
                        jobs.hits.saved_here(event.artifact)
                    return event
            return await self.upstream.wait(md, req, until)

        async def once() -> pb.WaitEvent:
            request.timeout_ms = within.left_ms()
            return await self.waits.wait(md, request, until_publishing, one, within)

        # A replica stopping (a rolling update) ends its waits: asked again, on
        # a new stream, rather than have every waiter compile (retry.RELAYED_WAIT).
        try:
            return await retry.RELAYED_WAIT.arun(once, what=f"the wait for {request.key}",
                                                 deadline=within)
        except UpstreamError as exc:
            if exc.status not in retry.DEGRADED:
                raise relay_error(exc) from None
            return pb.WaitEvent(decision=pb.COMPILE_LOCALLY,
                                reason=self.upstream.local("wait", exc))
