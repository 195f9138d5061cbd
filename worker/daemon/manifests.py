"""The manifests of the jobs a host runs (coordinator/manifests.py): a warm
start in a call per host and job, not a decision per host and program.

A worker learns a job's name from `compilecast up --job` (COMPILECAST_JOB)
or from its callers' requests (Requester.job), names it on the requests it
sends up (the coordinator records the job's keys), and asks once for the
job's manifest with the credential of the caller that named it. Then:

- an Acquire for a key the manifest names, of that caller's host-cache
  namespace, is answered HIT here, with the manifest's entry: that exact key
  only, and the bytes the process then fetches are verified against the
  entry's digest as every fetch's are;
- the manifest's artifacts are fetched into the host cache meanwhile
  (PREFETCHES at a time), while their total fits the host cache's bound;
  `compilecast status` shows how far it got;
- an entry that proves stale (a fetch of it fails: purged, lost, another
  digest) or whose digest is revoked is dropped, and its key is asked for as
  any other: a manifest never makes a wrong hit;
- the job's stream (worker/daemon/jobstream.py) carries the waits of the
  job's processes that do not compile a program themselves, and the job's
  publishes, which the manifest then answers too: a cold start in a stream a
  host, not a request and a wait per host and program.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from compilecast import jobtree
from compilecast.errors import CompilecastError, NotFound
from compilecast.v1 import cache_pb2 as pb

from .fetches import Fetches
from .hits import HostHits
from .jobrelay import Subtree
from .jobstream import JobStream
from .metrics import WorkerMetrics
from .upstream import CoordinatorLink

log = logging.getLogger(__name__)

PREFETCHES = 4  # artifacts of one job fetched into the host cache at once
MAX_JOBS = 64  # jobs whose manifests a worker holds (past it: no other is asked for)
MAX_ENTRIES = 200_000  # manifest entries a worker holds in all
RETRY_S = 30.0  # a manifest that could not be had is asked for again after this
PLACED_S = 5.0  # a job's manifest waits this long for its stream's place in the tree


@dataclass
class _Job:
    ns: str
    job: str
    md: tuple
    asked: float
    task: asyncio.Task | None = None
    held_digest: str = ""
    held: bytes = b""  # the manifest as it came (a relaying worker serves it to its subtree)
    asked_once: asyncio.Event = field(default_factory=asyncio.Event)  # its first load answered
    progress: pb.JobPrefetch = field(default_factory=pb.JobPrefetch)
    problem: str = ""
    stream: JobStream | None = None


class HostManifests:
    """`relay_address`: where this worker relays its jobs' news to peers
    ("": it does not), `fanout` peers a job."""

    def __init__(self, link: CoordinatorLink, fetches: Fetches, *, max_bytes: int,
                 counted: Callable[[int], None] = lambda size: None,
                 streams: bool = True, relay_address: str = "",
                 fanout: int = jobtree.FANOUT) -> None:
        self.link = link
        self.fetches = fetches
        self.max_bytes = max_bytes  # the host cache's bound: what a job's prefetch may fill
        self.counted = counted  # an artifact of `size` bytes prefetched (metrics)
        self.streams = streams  # open each job's stream (worker/daemon/jobstream.py)
        self.relay_address = relay_address
        self.fanout = fanout
        self.jobs: collections.OrderedDict[tuple[str, str], _Job] = collections.OrderedDict()
        self.entries: dict[str, dict[str, pb.ArtifactInfo]] = {}  # ns -> key -> entry
        self.held = 0  # entries in all
        self.hits = 0  # Acquires answered from a manifest
        self.full = False  # MAX_JOBS held (said once)

    # -- learning a job ---------------------------------------------------------------
    def learn(self, ns: str, md: tuple, job: str) -> None:
        """A caller of namespace `ns` (credential `md`) runs `job`: its manifest
        is asked for, once (again after RETRY_S where that failed)."""
        if not job:
            return
        known = self.jobs.get((ns, job))
        if known is not None:
            if known.problem and time.monotonic() - known.asked > RETRY_S \
                    and (known.task is None or known.task.done()):
                known.asked, known.problem = time.monotonic(), ""
                known.task = asyncio.ensure_future(self._load(known))
            return
        if len(self.jobs) >= MAX_JOBS:  # (a caller naming job after job costs nothing more)
            if not self.full:
                self.full = True
                log.warning("%d jobs' manifests held: job %s is asked for key by key",
                            MAX_JOBS, job)
            return
        entry = self.jobs[(ns, job)] = _Job(ns, job, md, time.monotonic(),
                                            progress=pb.JobPrefetch(job=job))
        if self.streams:
            entry.stream = JobStream(self.link, md, job, lambda infos: self._add(ns, infos),
                                     known=lambda key: self.entries.get(ns, {}).get(key),
                                     relay_address=self.relay_address, fanout=self.fanout)
        entry.task = asyncio.ensure_future(self._load(entry))

    async def _load(self, j: _Job) -> None:
        request = pb.ManifestRequest(job=j.job, held_digest=j.held_digest)
        manifest = None
        via = await j.stream.placed(PLACED_S) if j.stream is not None else ""
        if via:  # down the tree, as the job's news comes: the relay's own copy
            try:
                manifest = await self.link.peer(via).GetManifest(
                    request, timeout=self.link.rpc_timeout_s, metadata=j.md)
            except CompilecastError as exc:
                log.info("job %s: relay %s had no manifest for it (%s); the coordinator's",
                         j.job, via, exc.status.name)
        try:
            if manifest is not None and not manifest.unchanged:
                # A relay's word, checked whole in one call: the coordinator's
                # manifest has the same digest, or its own entries come back
                # in place of the relay's (stale, or forged: never a fetch a
                # bogus entry).
                mine = await self.link.up.GetManifest(
                    pb.ManifestRequest(job=j.job, held_digest=manifest.digest),
                    timeout=self.link.rpc_timeout_s, metadata=j.md)
                if not mine.unchanged:
                    log.warning("job %s: relay %s's manifest is not the coordinator's; the "
                                "coordinator's is used", j.job, via)
                    manifest = mine
            if manifest is None:
                manifest = await self.link.up.GetManifest(
                    request, timeout=self.link.rpc_timeout_s, metadata=j.md)
        except CompilecastError as exc:
            j.problem = f"the manifest could not be had ({exc.status.name})"
            log.info("job %s: %s; its keys are asked for one by one", j.job, j.problem)
            return
        finally:
            j.asked_once.set()
        if manifest.unchanged:
            return
        j.held_digest = manifest.digest
        if self.relay_address:
            j.held = manifest.SerializeToString()
        self._add(j.ns, manifest.entries)
        j.progress.artifacts_total = len(manifest.entries)
        j.progress.bytes_total = sum(e.size for e in manifest.entries)
        log.info("job %s: manifest of %d artifacts (%d bytes); prefetching", j.job,
                 len(manifest.entries), j.progress.bytes_total)
        await self._prefetch(j, list(manifest.entries))

    def _add(self, ns: str, entries) -> None:
        mine = self.entries.setdefault(ns, {})
        for e in entries:
            if self.held >= MAX_ENTRIES:
                break
            if e.key not in mine:
                self.held += 1
            mine[e.key] = e

    async def _prefetch(self, j: _Job, entries: list[pb.ArtifactInfo]) -> None:
        room = self.max_bytes
        todo: asyncio.Queue[pb.ArtifactInfo] = asyncio.Queue()
        for e in entries:
            if e.size > room:
                j.progress.stopped = (f"the host cache's bound ({self.max_bytes} bytes) holds "
                                      f"{j.progress.artifacts_total - todo.qsize()} fewer")
                break
            room -= e.size
            todo.put_nowait(e)

        async def one() -> None:
            while not todo.empty():
                e = todo.get_nowait()
                try:
                    await self.fetches.prefetch(j.ns, j.md, e.key, e.digest)
                except CompilecastError as exc:
                    log.info("job %s: %s did not prefetch (%s); it is asked for", j.job,
                             e.key, exc.status.name, extra={"key": e.key})
                    self.forget(j.ns, e.key)
                    continue
                j.progress.artifacts_done += 1
                j.progress.bytes_done += e.size
                self.counted(e.size)

        await asyncio.gather(*(one() for _ in range(PREFETCHES)))

    # -- answering ----------------------------------------------------------------
    def answer(self, ns: str, key: str) -> pb.ArtifactInfo | None:
        """The manifest's entry for exactly `key` in namespace `ns`, if any."""
        mine = self.entries.get(ns)
        info = mine.get(key) if mine else None
        if info is not None:
            self.hits += 1
        return info

    def stream(self, ns: str, requester: pb.Requester) -> JobStream | None:
        """The open stream that carries this requester's waits: of its job,
        when it does not compile the program itself (None otherwise)."""
        if not requester.job or requester.process_id == requester.designated_process:
            return None
        j = self.jobs.get((ns, requester.job))
        s = j.stream if j is not None else None
        return s if s is not None and s.live else None

    def subtree(self, ns: str, md: tuple, job: str) -> Subtree | None:
        """The subtree of `job`'s streams this worker serves to a peer of
        namespace `ns` whose credential is `md`: only where this host's own
        stream of the job goes up with that credential (the peer may do what
        this worker's stream may), and is open."""
        j = self.jobs.get((ns, job))
        s = j.stream if j is not None and j.md == md else None
        return s.subtree if s is not None and s.live else None

    async def relayed(self, ns: str, md: tuple, job: str, digest: str) -> pb.Manifest | bytes:
        """The manifest of `job` this worker holds, for a peer of its subtree
        (the credential its stream goes up with): as it came, or unchanged
        when the peer holds `digest`; NotFound where it holds none."""
        j = self.jobs.get((ns, job))
        if j is None or j.md != md or j.stream is None or j.stream.subtree is None:
            raise NotFound(f"this worker relays no manifest of job {job!r} for this credential")
        try:  # (its own load under way: its answer, not its prefetch)
            await asyncio.wait_for(j.asked_once.wait(), self.link.rpc_timeout_s)
        except TimeoutError:
            raise NotFound(f"this worker is still asking for job {job!r}'s manifest") from None
        if not j.held_digest:
            raise NotFound(f"this worker holds no manifest of job {job!r}")
        if digest == j.held_digest:
            return pb.Manifest(job=job, digest=digest, unchanged=True)
        return j.held

    def forget(self, ns: str, key: str) -> None:
        """A stale entry (its fetch failed): the key is asked for as any other."""
        mine = self.entries.get(ns)
        if mine is not None and mine.pop(key, None) is not None:
            self.held -= 1

    def revoke(self, digests: set[str]) -> None:
        """Purged artifacts: no entry names them any more."""
        for mine in self.entries.values():
            for key in [k for k, e in mine.items() if e.digest in digests]:
                del mine[key]
                self.held -= 1

    def status(self) -> list[pb.JobPrefetch]:
        return [pb.JobPrefetch(job=j.job, artifacts_done=j.progress.artifacts_done,
                               artifacts_total=j.progress.artifacts_total,
                               bytes_done=j.progress.bytes_done,
                               bytes_total=j.progress.bytes_total,
                               stopped=j.problem or j.progress.stopped,
                               stream_open=j.stream is not None and j.stream.live,
                               stream_waits=j.stream.waiting if j.stream is not None else 0,
                               **(_tree(j.stream) if j.stream is not None else {}))
                for j in self.jobs.values()]

    async def close(self) -> None:
        for j in self.jobs.values():
            if j.task is not None:
                j.task.cancel()
            if j.stream is not None:
                await j.stream.close()


def _tree(stream: JobStream) -> dict:
    """Where a job's stream hangs in the tree of its news (status)."""
    return {"stream_via": stream.upstream, "stream_resumes": stream.resumed,
            "stream_restarts": stream.restarted,
            "stream_children": len(stream.subtree.children) if stream.subtree else 0}


class ManifestSource:
    """An Acquire's source: a HIT from the job's manifest, for exactly the
    keys it lists (every byte served for it is verified as any fetch's).
    Also where a request learns its job: the job whose manifest records
    the key (coordinator/manifests.py), this host's own when it names none."""

    def __init__(self, manifests: HostManifests, hits: HostHits, metrics: WorkerMetrics,
                 *, job: str) -> None:
        self.manifests = manifests
        self.hits = hits
        self.metrics = metrics
        self.job = job

    async def answer(self, ns, md, requests, answers) -> None:
        for i, r in enumerate(requests):
            r.manifest_job = r.manifest_job or r.requester.job or self.job
            self.manifests.learn(ns, md, r.manifest_job)
            if answers[i] is None and (info := self.entry(ns, r.key)) is not None:
                answers[i] = self.hits.answered_here(info)

    def entry(self, ns: str, key: str) -> pb.ArtifactInfo | None:
        info = self.manifests.answer(ns, key)
        if info is not None:
            self.metrics.manifest_hits.inc()
        return info


class StreamSource:
    """An Acquire's source: WAIT for a process of a job whose stream is
    open (the job's designated process compiles; the stream says when it
    published): nothing goes upstream."""

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
