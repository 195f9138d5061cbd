"""The coordinator's decisions over etcd: leases, the artifact index, waiters.

etcd layout under the prefix P. KEY below is the scoped key TENANT/KEY (a
validated cache key holds no '/', a tenant name neither), so tenants never
see each other's records:

    P/a/KEY              artifact index entry (JSON ArtifactInfo); write-once
    P/l/KEY              compile lease record (JSON), attached to the holder's etcd lease
                         (one per holder process, shared by its claims: leases.py)
    P/h/KEY              hedge lease record: a second compiler for a holder far past
                         the program's expected compile time, attached to its etcd lease
    P/x/KEY              "compile locally" verdict, attached to a short etcd lease
    P/w/KEY/REPLICA      this replica's waiters of KEY (JSON: how many, the lowest rank,
                         how many of each job), attached to its session lease
    P/k/..., P/n/...     what each key was made of: see records.py

Lease rules (the invariants everything else leans on):
- P/l/KEY is created only by a txn that checks P/l/KEY, P/a/KEY and P/x/KEY are all
  absent, so at most one holder exists per key at any revision.
- The lease's fencing token is the revision that created P/l/KEY. Publish and
  Release are txns that compare P/l/KEY's mod_revision with that token, so a
  holder whose etcd lease expired (and whose record may have been re-created
  for someone else) can never publish.
- Publish writes P/a/KEY and deletes P/l/KEY and P/h/KEY in one txn, after
  the blob is durably in the store; an index entry never points at a missing
  blob. With a hedge, the first valid publish (holder or hedger) wins.
- Waiters are woken by one prefix watch per replica (WatchHub), so a publish
  through any replica wakes waiters on every replica.
"""

from __future__ import annotations

import asyncio
import logging

from compilecast.config import CoordinatorConfig
from compilecast.serving import Background, cancel_all
from compilecast.store import ArtifactStore
from compilecast.v1 import cache_pb2 as pb

from .artifacts import Artifacts, ArtifactSettings
from .claims import Claims, ClaimSettings
from .etcd import Etcd
from .farm import Farm
from .jobwatch import JobWatches
from .keyview import Keyspace, KeyView, ViewSettings
from .leases import LeasePool, Session
from .manifests import Manifests
from .metrics import CoordinatorMetrics
from .operations import Operations, OperationSettings, describe_store
from .presence import Presence
from .records import KeyRecords
from .relay import RelayTrees
from .sweep import IndexSweeper
from .uploads import Uploads
from .waiting import Waiting, WaitSettings
from .watch import WatchHub

log = logging.getLogger(__name__)


class CoordinatorState:
    """One replica's state over etcd, assembled from its components: the key
    view (what it knows and how it reads the rest), the claims and Acquire,
    the artifacts' way in and out, the waits, and the operators' calls. The
    service (coordinator/service.py) calls the components directly."""

    def __init__(self, cfg: CoordinatorConfig, etcd: Etcd, store: ArtifactStore,
                 metrics: CoordinatorMetrics) -> None:
        self.cfg = cfg
        self.etcd = etcd
        self.store = store
        self.metrics = metrics
        self.presence = Presence(store, metrics.bucket_stalls)
        metrics.bucket_checks_waiting.set_function(lambda: self.presence.waiting)
        self.hub = WatchHub(etcd, cfg.etcd_prefix.rstrip("/").encode())
        self.view = KeyView(ViewSettings(designated_grace_s=cfg.designated_grace_s), etcd,
                            self.hub, self.presence, metrics)
        self.records = KeyRecords(etcd, self.hub.prefix, metrics)
        self.sweeper = IndexSweeper(etcd, self.hub.prefix, self.presence, self.records, metrics,
                                    record_max_age_s=cfg.key_record_days * 86400,
                                    forget=self.view.forget_artifact)
        self.farm = Farm(etcd, store, self.hub.prefix, metrics, cfg.lease_ttl_s)
        self.relays = RelayTrees(cfg.relay_fanout, chain_bytes=cfg.relay_chain_bytes)
        self.uploads = Uploads(self.hub.wake)
        self.leases = LeasePool(etcd, cfg.lease_ttl_s)
        self.session = Session(etcd, cfg.lease_ttl_s)
        self.background = Background(log)
        self.claims = Claims(ClaimSettings(publish_stream_readers=cfg.publish_stream_readers),
                             self.view, etcd, self.leases, self.records, metrics)
        self.keys = Keyspace(etcd, self.view, self.records, self.leases, self.session)
        self.artifacts = Artifacts(
            ArtifactSettings(publish_stream_readers=cfg.publish_stream_readers,
                             max_artifact_bytes=cfg.max_artifact_bytes,
                             local_marker_ttl_s=cfg.local_marker_ttl_s),
            self.keys, self.claims, store, metrics, self.uploads, self.farm)
        self.waiting = Waiting(
            WaitSettings(
                share_binary_between_hosts_timeout_ms=cfg.share_binary_between_hosts_timeout_ms,
                publish_stream_readers=cfg.publish_stream_readers,
                hedge_min_s=cfg.hedge_min_s, hedge_factor=cfg.hedge_factor,
                designated_grace_s=cfg.designated_grace_s),
            self.keys, self.claims, metrics, self.uploads, self.background)
        self.manifests = Manifests(etcd, self.view, self.hub.prefix)
        self.job_watches = JobWatches(self.waiting, self.view, self._give_back, metrics,
                                      fanout=cfg.job_stream_fanout)
        self.operations = Operations(
            OperationSettings(store_type=cfg.store_type, store_max_bytes=cfg.store_max_bytes,
                              store_description=describe_store(cfg)),
            self.keys, self.waiting, store, metrics, self.farm)
        self._tasks: list[asyncio.Task[None]] = []

    async def _give_back(self, key: str, lease: pb.Lease, tenant: str) -> None:
        await self.artifacts.release(key, lease, pb.ABANDONED, "its host's job stream ended",
                                     tenant=tenant)

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.hub.run(), name="watch-hub"))
        self._tasks.append(asyncio.create_task(self.session.keep(), name="session"))
        await self.hub.ready.wait()

    async def stop(self) -> None:
        self.job_watches.close()
        await cancel_all(self._tasks)  # the session keeper could swallow one cancel
        await self.records.close()
        await self.leases.close()
        self.artifacts.close()
        self.presence.close()
        await self.session.close()
