"""The hits a worker answers without the coordinator (its host cache, a
job's manifest or stream, a request shared among its host's processes) and
the compile time they saved: counted on the host and reported (ReportHits)
every so often. A report the coordinator refuses is dropped and said once a
kind, never sent again with every later hit held in it."""

from __future__ import annotations

import asyncio
import logging

from compilecast import validate
from compilecast.errors import Status
from compilecast.grpcutil import bearer
from compilecast.v1 import cache_pb2 as pb

from .metrics import WorkerMetrics
from .upstream import CoordinatorLink, Relayed

log = logging.getLogger(__name__)

PASSING = (Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED, Status.CANCELLED)  # sent with the next


class HostHits:
    def __init__(self, link: CoordinatorLink, metrics: WorkerMetrics) -> None:
        self.link = link
        self.metrics = metrics
        self.unreported: list[float] = [0, 0.0]  # hits answered here, and their seconds
        self.joined = [0, 0]  # answers shared from another's request: misses, hits
        self._refused: set[Status] = set()  # kinds of refusal of a report, logged once

    def saved_here(self, info: pb.ArtifactInfo) -> None:
        """A hit the coordinator did not answer: its saved compile counted
        here, and reported; a day's at most (validate.MAX_SECONDS_PER_HIT)."""
        self.metrics.compile_seconds_saved.inc(info.compile_time_seconds)
        self.unreported[0] += 1
        self.unreported[1] += min(info.compile_time_seconds, validate.MAX_SECONDS_PER_HIT)

    def answered_here(self, info: pb.ArtifactInfo) -> pb.AcquireResponse:
        """A HIT answered on the host (its cache, a job's manifest): the
        coordinator never saw it, so it is counted and reported here."""
        self.metrics.lookups.labels("host_hit").inc()
        self.saved_here(info)
        return pb.AcquireResponse(decision=pb.HIT, artifact=info)

    def shared(self, answer: pb.AcquireResponse) -> None:
        """An answer another caller's request brought: the coordinator
        counted one request for both."""
        self.joined[answer.decision == pb.HIT] += 1
        if answer.decision == pb.HIT:
            self.saved_here(answer.artifact)

    def add_to(self, resp: pb.StatusResponse) -> None:
        """The coordinator's counts in `resp`, with what it has not heard yet."""
        resp.hits += int(self.unreported[0])
        resp.misses += self.joined[False]
        resp.compile_seconds_saved += self.unreported[1]

    async def run(self, every_s: float) -> None:
        """Report every `every_s` (what was not reported stays for the next)."""
        while True:
            await asyncio.sleep(every_s)
            await self.report_now()

    async def report_now(self) -> None:
        hits, seconds = int(self.unreported[0]), self.unreported[1]
        if not hits:
            return
        try:
            await self.link.up.ReportHits(
                pb.ReportHitsRequest(hits=hits, compile_seconds_saved=seconds),
                timeout=self.link.rpc_timeout_s, metadata=bearer(self.link.token))
        except Relayed as exc:
            if exc.code in PASSING:
                log.debug("reporting %d hits failed: %s", hits, exc.code.name)
                return
            # Refused, not failed: sent again it would be refused again, with
            # every later hit held in it. Dropped; said once a kind.
            if exc.code not in self._refused:
                self._refused.add(exc.code)
                log.warning("the coordinator did not count %d of this worker's hits: %s: %s%s",
                            hits, exc.code.name, exc.details,
                            " (give the worker's token the worker permission)"
                            if exc.code == Status.PERMISSION_DENIED else "")
        self.unreported[0] -= hits
        self.unreported[1] -= seconds
