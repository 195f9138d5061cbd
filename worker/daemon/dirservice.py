"""The worker's HostDirectories service over worker/daemon/dirsync.py."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

import grpc

from compilecast.config import WorkerConfig
from compilecast.errors import CompilecastError, PermissionDenied, Unauthenticated, Unavailable
from compilecast.grpcutil import TlsFiles, rpc_errors
from compilecast.v1 import cache_pb2 as pb

from ..inprocess.client import CacheClient
from ..inprocess.identity import Identity, default_client_name
from .dirsync import DirSync
from .metrics import WorkerMetrics

TENANT_TTL_S = 300.0  # a credential's tenant, as the coordinator said, trusted this long
TENANTS_KEPT = 4096


def make_dirsync(cfg: WorkerConfig, token: str, metrics: WorkerMetrics) -> DirSync:
    """The host's synced directories, under the host cache directory, talking
    to the coordinator as the process that opened each (its token), or as
    this worker."""
    clients: dict[str, CacheClient] = {}
    tls = TlsFiles(cfg.coordinator_ca_file, cfg.coordinator_cert_file, cfg.coordinator_key_file)
    # Its own name: claims of one name may share a lease (coordinator/leases.py),
    # and this worker's syncs are not the host's processes.
    me = Identity(client=f"{default_client_name()} dirs {cfg.cache_dir}"[:200])

    def client_for(caller: str) -> CacheClient:
        if caller not in clients:
            clients[caller] = CacheClient(
                cfg.coordinator, timeout_s=cfg.rpc_timeout_s, token=caller or token, identity=me,
                tls=tls)
        return clients[caller]

    tenants: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()

    def authenticate(caller: str) -> str:
        """The tenant the coordinator gives `caller`'s credential (asked with a
        Revoked call that returns nothing else), remembered for
        TENANT_TTL_S; raises what the coordinator answered when it refuses
        it, or Unavailable."""
        known = tenants.get(caller)
        if known is not None and time.monotonic() - known[1] < TENANT_TTL_S:
            return known[0]
        probe = CacheClient(cfg.coordinator, timeout_s=cfg.rpc_timeout_s, token=caller or token,
                            tls=tls)
        try:
            tenant = probe.revoked(since_revision=1 << 62).tenant or "default"
        except Unauthenticated:
            raise Unauthenticated("the coordinator does not know this credential: no "
                                  "directory is kept for it") from None
        except PermissionDenied as exc:
            raise PermissionDenied(f"the coordinator refuses this credential: {exc}") from None
        except CompilecastError as exc:
            raise Unavailable(f"the coordinator cannot check this credential now "
                              f"({exc.status.name})") from None
        finally:
            probe.close()
        tenants[caller] = (tenant, time.monotonic())
        tenants.move_to_end(caller)
        while len(tenants) > TENANTS_KEPT:
            tenants.popitem(last=False)
        return tenant

    def count(kind: str, event: str, size: int) -> None:
        metrics.dir_entries.labels(kind, event).inc()
        if size and event != "refused":
            metrics.dir_bytes.labels(kind, event).inc(size)

    return DirSync(f"{cfg.cache_dir}/dirs", client_for, settle_s=cfg.dir_settle_s,
                   max_entry_bytes=cfg.dir_max_entry_bytes, authenticate=authenticate,
                   count=count)


class DirectoriesService:
    """OpenDirectory and SyncDirectory. `caller(context)` gives the caller's
    token ("" : none) and its scope (its host-cache namespace)."""

    def __init__(self, dirsync: DirSync,
                 caller: Callable[[grpc.aio.ServicerContext], tuple[str, str]]) -> None:
        self.dirsync = dirsync
        self.caller = caller

    @rpc_errors
    async def OpenDirectory(self, request, context):
        token, _ = self.caller(context)
        d = await asyncio.to_thread(self.dirsync.open, request.kind, dict(request.namespace),
                                    token=token, publish_off=request.publish_off,
                                    install_off=request.install_off)
        return pb.OpenDirectoryResponse(directory=await asyncio.to_thread(d.describe))

    @rpc_errors
    async def SyncDirectory(self, request, context):
        token, _ = self.caller(context)
        d = await asyncio.to_thread(self.dirsync.find, token, request.namespace_id)
        # (the coordinator's refusals pass on as they are: its client's edge)
        published, installed = await asyncio.to_thread(self.dirsync.sync, d)
        return pb.SyncDirectoryResponse(published=published, installed=installed,
                                        directory=await asyncio.to_thread(d.describe))
