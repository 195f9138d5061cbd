"""Coordinator entry point: wires etcd, the store, metrics and the service."""

from __future__ import annotations

import asyncio
import logging
import random
import threading

from prometheus_client import CollectorRegistry

from compilecast import tracing
from compilecast.blobstore import DiskBlobStore
from compilecast.config import CoordinatorConfig
from compilecast.decideserve import GapAdvice
from compilecast.errors import Unavailable
from compilecast.grpcutil import channel_credentials, server_credentials
from compilecast.serving import Role, listen, make_server, set_serving, start_metrics
from compilecast.store import ArtifactStore

from .auth import Authenticator
from .dataplane import DataPlane
from .etcd import Etcd
from .metrics import CoordinatorMetrics
from .service import CoordinatorService
from .state import CoordinatorState

log = logging.getLogger(__name__)


class Coordinator(Role):
    """A running coordinator replica (start/stop for tests and `up`)."""

    ROLE = "coordinator"

    def __init__(self, cfg: CoordinatorConfig, registry: CollectorRegistry | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.registry = registry or CollectorRegistry()
        self.metrics = CoordinatorMetrics(self.registry)
        self.store: ArtifactStore = DiskBlobStore(cfg.store_dir, max_blob_size=cfg.max_artifact_bytes,
                                   reverify_s=cfg.store_reverify_s,
                                   max_bytes=cfg.store_max_bytes or None,
                                   min_free=cfg.store_min_free_bytes,
                                   on_evict=lambda _size: self.metrics.store_evictions.inc())
        if cfg.store_type == "s3":
            from compilecast.objectstore import Bucket, BucketStore

            bucket = Bucket(cfg.s3_bucket, prefix=cfg.s3_prefix, endpoint=cfg.s3_endpoint,
                            region=cfg.s3_region, observe=self.metrics.observe_bucket)
            self.store = BucketStore(self.store, bucket, on_local=self.metrics.observe_local)
        self.metrics.store_bytes.set_function(lambda: self.store.stored_bytes)
        self.port = 0
        self._metrics_server = None
        self._store_scans: asyncio.Task | None = None
        self._scrubs: asyncio.Task | None = None
        self._scrub_stop = threading.Event()
        self._sweeps: asyncio.Task | None = None
        self._advising: asyncio.Task | None = None

    async def start(self) -> None:
        if self.cfg.otlp_endpoint:
            tracing.configure(self.cfg.otlp_endpoint, "compilecast-coordinator")
        # grpc.aio objects bind to the running loop: build them here.
        cfg = self.cfg
        bucket = getattr(self.store, "bucket", None)
        if bucket is not None:  # a bucket that is missing or refuses us: say so, do not serve
            await asyncio.to_thread(bucket.check)
        self.etcd = Etcd(cfg.etcd_endpoints.split(","), credentials=channel_credentials(
            cfg.etcd_ca_file, cfg.etcd_cert_file, cfg.etcd_key_file))
        self.etcd.observe = self.metrics.observe_etcd
        self.state = CoordinatorState(cfg, self.etcd, self.store, self.metrics)
        auth = Authenticator.from_file(cfg.auth_tokens_file, cfg.allow_unauthenticated)
        self.data_plane = self._data_plane()
        # Measured whatever decide_busy_gap_ms says (0: it never asks for a gap).
        advice = self.advice = GapAdvice(cfg.decide_busy_gap_ms)
        self.metrics.decide_gap_ms.set_function(lambda: advice.gap_ms)
        self.metrics.loop_busy.set_function(lambda: advice.busy)
        service = CoordinatorService(self.state, auth, self.data_plane, self.advice)
        self.server_streams = service.streams
        self.server, self.health = make_server(service)
        creds = server_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
        # Metrics first: a taken port fails the start before anything listens.
        self._metrics_server = start_metrics(self.registry, self.cfg.metrics_host,
                                             self.cfg.metrics_port)
        self.port = listen(self.server, cfg.listen, creds, setting="listen")
        await self.state.start()
        if self.data_plane is not None:
            await self.data_plane.start()
        await self.server.start()
        await set_serving(self.health, True)
        self._store_scans = asyncio.create_task(self._scan_store())
        if cfg.scrub_bytes_per_s:
            self._scrubs = asyncio.create_task(self._scrub_store())
        self._sweeps = (asyncio.create_task(self._sweep_index()) if cfg.index_sweep_s > 0
                        else None)
        self._advising = asyncio.create_task(self.advice.run())
        log.info("coordinator listening on %s (%s; etcd %s; store %s)", cfg.listen,
                 "TLS" if creds else "plaintext", cfg.etcd_endpoints, cfg.store_dir)

    def _data_plane(self) -> DataPlane | None:
        cfg = self.cfg
        if cfg.data_listen == "off":
            return None
        if cfg.tls_cert_file:  # its tokens would cross the network in the clear
            log.info("data plane off: the coordinator serves TLS, so every fetch goes over gRPC")
            return None
        address = cfg.data_listen
        if address == "auto" and cfg.listen.startswith("unix://"):
            log.info("data plane off: the coordinator listens on a unix socket; set "
                     "--data-listen to serve one over TCP")
            return None
        if address == "auto":
            host = cfg.listen.rpartition(":")[0]
            if host.strip("[]") in ("0.0.0.0", "::", "") and not cfg.data_advertise:
                # Clients would be told "this port, on the host you dialed": behind a
                # Service or a proxy that host is not this process, and a connection to
                # a port nobody forwards may hang until it times out.
                log.info("data plane off: the coordinator listens on all addresses; set "
                         "--data-listen and --data-advertise (this replica's own address) "
                         "to serve one")
                return None
            address = host + ":0"
        return DataPlane(self.store, self.metrics, address, cfg.data_advertise)

    async def _scan_store(self) -> None:
        """Count the store's directory every store_scan_s and hold it to its
        bound. Replicas on one shared volume each count only their own writes
        between scans, so each scan also evicts what the others pushed over."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.cfg.store_scan_s)
            try:
                await loop.run_in_executor(None, self.store.rescan)
            except OSError as exc:
                log.warning("artifact store scan failed: %s", exc)

    async def _scrub_store(self) -> None:
        """Verify the store's blobs in the background, scrub_bytes_per_s at
        most, a pass store_scan_s after the last: the corrupt ones are quarantined,
        and their keys compile again when next asked for."""
        loop = asyncio.get_running_loop()
        stop = self._scrub_stop
        while not stop.is_set():
            await asyncio.sleep(self.cfg.store_scan_s)
            try:
                checked, corrupt = await loop.run_in_executor(
                    None, self.store.scrub, self.cfg.scrub_bytes_per_s, stop,
                    lambda digest: self.metrics.corrupt_blobs.inc())
                self.metrics.scrubbed.inc(checked)
                if corrupt:
                    log.error("store scrub: %d of %d blobs were corrupt and are quarantined",
                              corrupt, checked)
            except Exception:  # a bug must not end the scrubs, nor the replica
                log.exception("store scrub failed (the next pass tries again)")

    async def _sweep_index(self) -> None:
        """Sweep etcd's index every index_sweep_s (coordinator/sweep.py),
        replicas at staggered times. The first sweep comes at a random point
        of the first interval, so that replicas restarted more often than
        that (rolling updates) still sweep."""
        await asyncio.sleep(self.cfg.index_sweep_s * random.uniform(0.05, 1.0))
        while True:
            try:
                await self.state.sweeper.sweep()
            except Unavailable as exc:
                log.warning("index sweep failed (the next one tries again): %s", exc)
            except Exception:  # a bug must not end the sweeps, nor the replica
                log.exception("index sweep failed (the next one tries again)")
            await asyncio.sleep(self.cfg.index_sweep_s * random.uniform(0.8, 1.2))

    async def _release(self) -> None:
        if self.cfg.otlp_endpoint:
            tracing.shutdown()
        self._scrub_stop.set()
        for task in (self._store_scans, self._sweeps, self._advising, self._scrubs):
            if task is not None:
                task.cancel()
        if self.data_plane is not None:
            await self.data_plane.stop()
        await self.state.stop()
        await self.etcd.close()


def run(cfg: CoordinatorConfig) -> None:
    asyncio.run(Coordinator(cfg).serve())
