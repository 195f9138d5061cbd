"""A job's manifest: the keys its processes asked for, each with its
artifact's index entry, so that a pod's warm start costs a call a host, not
a decision a host and program (docs/architecture/pod-start.md, "A pod's start").

A worker names its job on the requests it sends up (AcquireRequest.
manifest_job); the first time a replica sees a key of a job it records it in
etcd, P/j/<tenant>/<job digest>/<key> (one write per job and key on each
replica, however many hosts ask: etcd's writes grow with programs, not hosts
x programs), under a lease of RECORD_TTL_S: a job nobody runs for that long
leaves nothing behind (a replica writes a key again after REWRITE_S). GetManifest reads the job's keys and their published entries
(the key view's memory first, etcd for the rest) and sends them in key
order with the digest of what it sends: a caller that holds that digest gets
"unchanged" and no entries. A built manifest serves every caller for
BUILT_S, then is read again.

A manifest entry is a claim to be checked, never trusted: a worker answers
only that exact key with it, and every byte it then serves is verified
against the digest; a purged or lost artifact fails its fetch, and the key is
asked for as any other.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from dataclasses import dataclass, field

from compilecast.v1 import cache_pb2 as pb

from .etcd import EtcdClient, WriteBatcher
from .keyview import KeyView
from .records import read_info, scope

log = logging.getLogger(__name__)

MAX_KEYS = 20_000  # recorded keys of one job (past it: not recorded; a manifest fits a message)
JOBS_NOTED = 4096  # jobs whose recorded keys a replica remembers (LRU)
NOTED_KEYS = 1_000_000  # keys a replica remembers in all (past it: the oldest jobs go)
BUILT_KEPT = 16  # built manifests kept (each up to a few MB)
BUILT_S = 2.0  # a built manifest serves callers this long
RECORD_TTL_S = 30 * 86400  # a job's record of a key lasts this long unless written again
REWRITE_S = 86400  # a replica writes a key it recorded again after this (on a new ask)
PAGE = 1000  # keys read from etcd a range


@dataclass(eq=False)
class _JobKeys:
    """A job's keys as this replica knows them: recorded (and when), and
    those asked for while the stored ones are read in."""

    keys: dict[str, float] = field(default_factory=dict)
    pending: dict[str, None] = field(default_factory=dict)
    loading: asyncio.Future[None] | None = None


def job_digest(tenant: str, job: str) -> str:
    return hashlib.sha256(f"{tenant}\0{job}".encode()).hexdigest()[:32]


class Manifests:
    def __init__(self, etcd: EtcdClient, view: KeyView, prefix: bytes) -> None:
        self.etcd = etcd
        self.view = view
        self.prefix = prefix
        self._writes = WriteBatcher(etcd)
        # (tenant, job) -> the keys this replica recorded, and when
        self._noted: collections.OrderedDict[tuple[str, str], _JobKeys] = \
            collections.OrderedDict()
        self._lease: tuple[float, asyncio.Future[int]] | None = None  # (granted, its id)
        # (tenant, job) -> (when built, its manifest, serialized once for all
        # callers) and builds in flight
        self._built: dict[tuple[str, str], tuple[float, pb.Manifest, bytes]] = {}
        self._building: dict[tuple[str, str], asyncio.Future[pb.Manifest]] = {}
        self.recorded = 0  # keys this replica wrote (Status, tests)
        self.sent = 0  # manifests sent whole (not "unchanged"): the tree's relays serve the rest
        self._noted_keys = 0

    def _job_prefix(self, tenant: str, job: str) -> bytes:
        return self.prefix + f"/j/{job_digest(tenant, job)}/".encode()

    # -- recording ----------------------------------------------------------------
    def note(self, tenant: str, requests: list[pb.AcquireRequest],
             answers: list[pb.AcquireResponse | None] | None, *, may_publish: bool) -> None:
        """Record the keys of `requests` that name a job (those answered, and
        not refused), each once per replica. An identity that may not
        publish records nothing: it could grow a job's manifest, which every
        host of the job prefetches."""
        if answers is None or not may_publish:
            return
        for r, a in zip(requests, answers, strict=False):
            if r.manifest_job and a is not None and a.decision != pb.DECISION_UNSPECIFIED:
                self._record(tenant, r.manifest_job, r.key)

    def _record(self, tenant: str, job: str, key: str) -> None:
        noted = self._noted.get((tenant, job))
        if noted is None:
            # A job this replica does not remember: the keys stored for it
            # (by any replica, before) are read first, so that its bound
            # holds where the keys are kept, not only while remembered here.
            noted = self._noted[(tenant, job)] = _JobKeys()
            noted.loading = asyncio.ensure_future(self._load(tenant, job, noted))
            noted.loading.add_done_callback(_logged)
        else:
            self._noted.move_to_end((tenant, job))
        if noted.loading is not None:
            if len(noted.pending) < MAX_KEYS:
                noted.pending[key] = None
            return
        now = time.monotonic()
        when = noted.keys.get(key)
        if (when is not None and now - when < REWRITE_S) or \
                (when is None and len(noted.keys) >= MAX_KEYS):
            return
        if when is None:
            self._noted_keys += 1
        noted.keys[key] = now
        self._forget_oldest()
        self.recorded += 1
        task = asyncio.ensure_future(self._write(self._job_prefix(tenant, job) + key.encode()))
        task.add_done_callback(_logged)

    async def _load(self, tenant: str, job: str, noted: _JobKeys) -> None:
        prefix = self._job_prefix(tenant, job)
        try:
            async for kv in self.etcd.scan_prefix(prefix, page=PAGE):
                if len(noted.keys) >= MAX_KEYS:
                    break
                # (stored before: written again on this replica's first ask)
                noted.keys.setdefault(kv.key[len(prefix):].decode(errors="replace"), -REWRITE_S)
        finally:
            noted.loading = None
            pending, noted.pending = noted.pending, {}
            if self._noted.get((tenant, job)) is noted:  # (else forgotten while read: uncounted)
                self._noted_keys += len(noted.keys)
                self._forget_oldest()
                for key in pending:
                    self._record(tenant, job, key)

    def _forget_oldest(self) -> None:
        # (a job forgotten here is recorded in etcd: read again when it returns)
        while len(self._noted) > JOBS_NOTED or self._noted_keys > NOTED_KEYS:
            _, dropped = self._noted.popitem(last=False)
            self._noted_keys -= len(dropped.keys) if dropped.loading is None else 0
            if dropped.loading is not None:
                dropped.loading.cancel()

    async def _write(self, record: bytes) -> None:
        now = time.monotonic()
        if self._lease is None or now - self._lease[0] > REWRITE_S or \
                (self._lease[1].done() and self._lease[1].exception() is not None):
            self._lease = (now, asyncio.ensure_future(self.etcd.grant(RECORD_TTL_S)))
        lease = await asyncio.shield(self._lease[1])
        await self._writes.put(record, b"", lease)

    # -- reading ------------------------------------------------------------------
    async def manifest(self, tenant: str, job: str, held_digest: str = ""
                       ) -> pb.Manifest | bytes:
        """The job's manifest (see the module's docstring), serialized once
        for every caller that gets it whole (wire.SERIALIZED)."""
        now = time.monotonic()
        built = self._built.get((tenant, job))
        if built is None or now - built[0] > BUILT_S:
            building = self._building.get((tenant, job))
            if building is None:
                building = asyncio.ensure_future(self._build(tenant, job))
                self._building[(tenant, job)] = building
                building.add_done_callback(lambda _: self._building.pop((tenant, job), None))
            made = await asyncio.shield(building)
            built = (time.monotonic(), made, made.SerializeToString())
            self._built[(tenant, job)] = built
            while len(self._built) > BUILT_KEPT:
                self._built.pop(next(iter(self._built)))
        made = built[1]
        if held_digest and held_digest == made.digest:
            return pb.Manifest(job=job, digest=made.digest, unpublished=made.unpublished,
                               unchanged=True)
        self.sent += 1
        return built[2]

    async def _build(self, tenant: str, job: str) -> pb.Manifest:
        prefix = self._job_prefix(tenant, job)
        keys = [kv.key[len(prefix):].decode(errors="replace")
                async for kv in self.etcd.scan_prefix(prefix, page=PAGE)]
        noted = self._noted.get((tenant, job))
        if noted is not None:  # (what this replica recorded whose write is still queued)
            keys = sorted(set(keys) | set(noted.keys))
        entries: list[pb.ArtifactInfo] = []
        unknown: list[str] = []
        for key in keys:
            info = self.view.cached_artifact(scope(tenant, key))
            if info is not None:
                entries.append(info)
            else:
                unknown.append(key)
        if unknown:
            found = await self.etcd.get_many([self.view.k("a", scope(tenant, k))
                                              for k in unknown])
            for key, kv in zip(unknown, found, strict=True):
                info = read_info(key, kv.value) if kv is not None else None
                if info is not None:
                    entries.append(info)
        entries.sort(key=lambda e: e.key)
        h = hashlib.sha256()
        for e in entries:
            h.update(e.SerializeToString(deterministic=True))
        return pb.Manifest(job=job, digest=h.hexdigest(), entries=entries,
                           unpublished=len(keys) - len(entries))


def _logged(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("recording a manifest key failed: %s", task.exception())
