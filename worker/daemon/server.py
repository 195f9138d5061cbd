"""Worker daemon entry point: the host cache and the local API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from prometheus_client import CollectorRegistry

from compilecast import tracing
from compilecast.config import ConfigError, WorkerConfig, read_small_file
from compilecast.errors import Unauthenticated
from compilecast.grpcutil import bearer, channel_credentials, server_credentials, token_from
from compilecast.serving import Role, listen, make_server, set_serving, start_metrics

from ..inprocess.handoff import handoff_supported
from ..pjrtdoor.pjrtgate import PjrtGate
from .dirservice import DirectoriesService, make_dirsync
from .handoff import Handoffs
from .hostcache import HostCache
from .metrics import WorkerMetrics
from .relayplane import RelayPlane
from .service import RelayService, WorkerService
from .wiring import Channels, WorkerParts, WorkerSettings

log = logging.getLogger(__name__)

HIT_REPORT_S = 10.0  # how often the hits answered here reach the coordinator's counts


class Worker(Role):
    ROLE = "worker"

    def __init__(self, cfg: WorkerConfig, registry: CollectorRegistry | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.registry = registry or CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry)
        self.cache = HostCache(cfg.cache_dir, max_bytes=cfg.cache_max_bytes,
                               min_free=cfg.cache_min_free_bytes,
                               reverify_s=cfg.store_reverify_s, readable=cfg.local_files,
                               on_refused=self.metrics.refused_entries.inc)
        self._metrics_server = None
        self.relay_server = None
        self._revocations: asyncio.Task | None = None
        self._hit_reports: asyncio.Task | None = None
        self._keep_free: asyncio.Task | None = None
        self._dir_sync: asyncio.Task | None = None
        self.pjrt_gate: PjrtGate | None = None

    @property
    def target(self) -> str:
        return self.cfg.listen

    async def start(self) -> None:
        if self.cfg.otlp_endpoint:
            tracing.configure(self.cfg.otlp_endpoint, "compilecast-worker")
        cfg = self.cfg
        token = (read_small_file(cfg.token_file, "token_file").decode("utf-8", "replace").strip()
                 if cfg.token_file else "")
        try:
            bearer(token)
        except Unauthenticated as exc:
            raise ConfigError(f"token_file {cfg.token_file}: {exc}") from None
        upstream_creds = channel_credentials(cfg.coordinator_ca_file, cfg.coordinator_cert_file,
                                             cfg.coordinator_key_file)
        relay_address = ""
        if cfg.relay_listen:
            port = cfg.relay_listen.rpartition(":")[2]
            relay_address = cfg.relay_advertise or f"{socket.getfqdn()}:{port}"
        settings = WorkerSettings(
            cfg.coordinator, rpc_timeout_s=cfg.rpc_timeout_s,
            share_binary_timeout_ms=cfg.share_binary_between_hosts_timeout_ms,
            decide_gap_s=cfg.decide_gap_ms / 1000, token=token, relay_address=relay_address,
            local_files=cfg.local_files, data_plane=cfg.data_plane and upstream_creds is None,
            wake_on_host_publish=cfg.wake_on_host_publish, bucket_urls=cfg.bucket_urls,
            job=cfg.job, job_streams=cfg.job_streams, job_relay_fanout=cfg.job_relay_fanout)
        # Peers serve with the same certificates as the coordinator's CA signs
        # (one PKI per release).
        self.parts = WorkerParts(settings, self.cache, self.metrics,
                                 Channels(upstream=upstream_creds, peers=upstream_creds))
        self.service = WorkerService(self.parts)
        self.server_streams = self.service.streams
        self.dirs = make_dirsync(cfg, token, self.metrics)
        self.service.dirs = self.dirs
        self.server, self.health = make_server(
            self.service, HostDirectories=DirectoriesService(self.dirs, self._caller))
        address = self.cfg.listen
        creds = server_credentials(cfg.tls_cert_file, cfg.tls_key_file)
        # Metrics first: a taken port fails the start before anything listens.
        self._metrics_server = start_metrics(self.registry, self.cfg.metrics_host,
                                             self.cfg.metrics_port)
        listen(self.server, address, None if address.startswith("unix://") else creds,
               setting="listen")
        self.relay_server = None
        if cfg.relay_listen:
            # (Fetch and WatchJob: the servicer's other calls answer UNIMPLEMENTED.)
            relay = RelayService(self.service)  # type: ignore[abstract]
            self.relay_server, _ = make_server(relay)
            listen(self.relay_server, cfg.relay_listen, creds, setting="relay_listen")
        await self.server.start()
        if self.relay_server is not None:
            await self.relay_server.start()
            log.info("relaying artifacts to peer workers on %s (as %s)", cfg.relay_listen,
                     relay_address)
            await self._relay_plane(creds)
        if address.startswith("unix://"):
            os.chmod(address.removeprefix("unix://"), 0o660)
            if handoff_supported():  # this host's processes hand their publishes over
                handoffs = Handoffs(f"{address.removeprefix('unix://')}.handoff",
                                    self.parts.publishes.publish_handoff, self.metrics.handoffs)
                try:
                    await handoffs.start()
                    self.parts.publishes.handoffs = handoffs
                except OSError as exc:  # a path too long for a socket, say: gRPC serves
                    log.warning("publishes are not handed over: cannot listen on %s (%s)",
                                handoffs.path, exc)
            await self._pjrt_gate(address)
        await set_serving(self.health, True)
        log.info("worker listening on %s (coordinator %s, host cache %s)", address,
                 self.cfg.coordinator, self.cfg.cache_dir)
        self._revocations = asyncio.create_task(
            self.parts.revocations.run(self.cfg.revocation_poll_s))
        self._hit_reports = asyncio.create_task(self.parts.hits.run(HIT_REPORT_S))
        self._keep_free = asyncio.create_task(self._give_way())
        self._dir_sync = asyncio.create_task(self.dirs.run(cfg.dir_sync_s))
        if self.cfg.job:  # the host's job: its manifest, prefetched while the framework starts
            self.parts.manifests.learn("host", bearer(token), self.cfg.job)

    def _caller(self, context) -> tuple[str, str]:
        """A caller's token ("" : none, or this worker's) and host-cache namespace."""
        scope, _ = self.parts.link.credential(context)
        token = token_from(context) or ""
        return ("" if token == self.parts.link.token else token), scope

    async def _pjrt_gate(self, address: str) -> None:
        """The socket of the host's interposed PJRT compiles (worker/pjrtdoor/pjrtgate.py)."""
        timeout_ms = self.cfg.share_binary_between_hosts_timeout_ms or 20 * 60 * 1000
        gate = PjrtGate(f"{address.removeprefix('unix://')}.pjrt", address,
                        wait_timeout_s=timeout_ms / 1000,
                        count=self.metrics.count_pjrt,
                        tokens_required=bool(self.parts.link.token))
        try:
            await gate.start()
            self.pjrt_gate = gate
        except OSError as exc:
            log.warning("interposed PJRT compiles are not served: cannot listen on %s (%s)",
                        gate.path, exc)

    async def _relay_plane(self, creds) -> None:
        """The relay's data plane (worker/daemon/relayplane.py), unless it is off."""
        cfg = self.cfg
        if cfg.relay_data_listen == "off":
            return
        if creds is not None:  # its tokens would cross the network in the clear
            log.info("relay data plane off: the relay serves TLS, so relays go over gRPC")
            return
        address = cfg.relay_data_listen
        if address == "auto":
            address = cfg.relay_listen.rpartition(":")[0] + ":0"
        plane = RelayPlane(address, self.metrics.relay_data_plane)
        await plane.start()
        self.parts.fetches.relay_plane = plane

    async def _give_way(self) -> None:
        """The host's jobs come first: while their files leave the disk with
        less than cache_min_free_bytes free, evict from the host cache."""
        while True:
            await asyncio.sleep(self.cfg.cache_free_check_s)
            try:
                await asyncio.to_thread(self.cache.store.make_room, 0)
            except OSError as exc:
                log.warning("could not check the host cache's free space: %s", exc)

    async def _release(self) -> None:
        if self.cfg.otlp_endpoint:
            tracing.shutdown()
        if self._hit_reports is not None:  # the last hits counted, before going
            self._hit_reports.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.parts.hits.report_now(), 2.0)
        for task in (self._revocations, self._keep_free, self._dir_sync):
            if task is not None:
                task.cancel()
        if self.parts.publishes.handoffs is not None:
            await self.parts.publishes.handoffs.stop()
        if self.pjrt_gate is not None:
            await self.pjrt_gate.stop()
        if self.relay_server is not None:
            await self.relay_server.stop(2.0)
        if self.parts.fetches.relay_plane is not None:
            await self.parts.fetches.relay_plane.stop()
        await self.service.close()


def run(cfg: WorkerConfig) -> None:
    from ..keylib import mlircanon
    mlircanon.warm_up()  # the host's JAX processes then key MLIR programs by the C path at once
    asyncio.run(Worker(cfg).serve())
