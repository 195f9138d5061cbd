"""The worker's components, built from values (as coordinator/state.py
builds a replica's): the one place that knows how they connect.

    CoordinatorLink   the channel upstream, peers' channels, callers' credentials
    Routes            the ways bytes may travel besides the gRPC stream
    HostCopies        room made in the host cache, copies recorded, publishes under way
    HostWaits         a host's waits for one key, upstream as one
    HostDecisions     a host's requests for one key, upstream as one
    Deciders          one Decide stream upstream a credential
    Fetches           host cache hits from disk, a miss downloaded once
    Publishes         a process's publish forwarded, the worker's copy kept
    HostManifests     the jobs this host runs: their manifests and streams
    HostHits        hits answered here, reported
    Revocations       purged digests dropped from the host
    Answers           an Acquire's and a Wait's answer from its sources in order:
                      HostCacheSource, ManifestSource, StreamSource, Upstream
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from compilecast import decide, jobtree
from compilecast.negotiate import Routes
from compilecast.serving import Background

from .answers import Answers
from .bucketurl import BucketUrl
from .dataplane import DataPlaneFill, RelayFill
from .decisions import Deciders, HostDecisions, Upstream
from .fetches import Fetches, HostFiles
from .hits import HostHits
from .hostcache import HostCache, HostCacheSource, HostCopies
from .manifests import HostManifests, ManifestSource, StreamSource
from .metrics import WorkerMetrics
from .publishes import Publishes, UploadTickets
from .revocations import Revocations
from .upstream import CoordinatorLink
from .waits import HostWaits

log = logging.getLogger("compilecast.worker.daemon.service")


@dataclass(frozen=True)
class WorkerSettings:
    """What the worker's components are built with (from WorkerConfig)."""

    coordinator: str
    rpc_timeout_s: float
    share_binary_timeout_ms: int = 0  # the longest a wait of this host's lasts (0: the caller's)
    decide_gap_s: float = decide.GAP_S  # between two messages of a Decide stream upstream
    token: str = ""  # the worker's own credential
    relay_address: str = ""  # where peers fetch from this worker ("": it relays nothing)
    local_files: bool = True  # the host cache's files handed to this host's processes
    data_plane: bool = False  # whole downloads and uploads over the coordinator's data plane
    wake_on_host_publish: bool = False
    bucket_urls: bool = True  # a bucket's presigned URLs
    job: str = ""  # this host's job (`up --job`): its manifest's keys are answered here
    job_streams: bool = True  # a job's waits on one stream a host
    job_relay_fanout: int = jobtree.FANOUT  # peers this worker relays a job's news to


@dataclass(frozen=True)
class Channels:
    """TLS for the channel upstream and for peers' (None: plaintext)."""

    upstream: grpc.ChannelCredentials | None = None
    peers: grpc.ChannelCredentials | None = None


class WorkerParts:
    def __init__(self, settings: WorkerSettings, cache: HostCache, metrics: WorkerMetrics,
                 channels: Channels = Channels()) -> None:
        s = self.settings = settings
        self.cache = cache
        self.metrics = metrics
        # The routes besides gRPC this worker offers: the kinds of its ends of them.
        self.routes = Routes.of([UploadTickets, RelayFill,
                                 DataPlaneFill if s.data_plane else None,
                                 BucketUrl if s.bucket_urls else None,
                                 HostFiles if s.local_files else None])
        self.link = CoordinatorLink(s.coordinator, token=s.token, rpc_timeout_s=s.rpc_timeout_s,
                                    credentials=channels.upstream,
                                    peer_credentials=channels.peers)
        self.background = Background(log)
        self.copies = HostCopies(cache, metrics)
        self.waits = HostWaits(metrics.waits)
        self.decisions = HostDecisions(metrics.decisions)
        self.deciders = Deciders(self.link, self.background, gap_s=s.decide_gap_s)
        self.fetches = Fetches(self.link, cache, self.copies, metrics, self.routes,
                               self.background, relay_address=s.relay_address)
        self.publishes = Publishes(self.link, cache, self.copies, metrics, self.routes,
                                   self.waits, wake_on_host_publish=s.wake_on_host_publish)
        self.manifests = HostManifests(self.link, self.fetches,
                                       max_bytes=cache.store.max_bytes or 0,
                                       counted=self._prefetched, streams=s.job_streams,
                                       relay_address=s.relay_address,
                                       fanout=s.job_relay_fanout)
        self.hits = HostHits(self.link, metrics)
        self.revocations = Revocations(self.link, cache, self.manifests, metrics,
                                       self.deciders.credentials)
        upstream = Upstream(self.link, self.decisions, self.deciders, self.hits, metrics)
        jobs = ManifestSource(self.manifests, self.hits, metrics, job=s.job)
        self.answers = Answers(
            (HostCacheSource(cache, self.hits), jobs,
             StreamSource(self.manifests, metrics)),
            upstream, self.waits, metrics, jobs=jobs,
            share_binary_timeout_ms=s.share_binary_timeout_ms)
        metrics.waiting.set_function(lambda: self.waits.waiting)
        metrics.cache_bytes.set_function(lambda: cache.store.stored_bytes)

    def _prefetched(self, size: int) -> None:
        self.metrics.prefetched.inc()
        self.metrics.prefetched_bytes.inc(size)

    async def close(self) -> None:
        await self.deciders.close()
        await self.manifests.close()
        await self.link.close()
