"""Keys, scoped by tenant, and what each key was made of.

The layout helpers every coordinator module shares, and the records that
explain misses:

    P/k/TENANT/KEY               the key's component digests and program name
    P/n/TENANT/NAMEHASH/KEY      keys by program name (the nearest earlier key on a miss,
                                 and the program's known compile times for hedging)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from compilecast import validate
from compilecast.errors import InvalidRequest, NotFound
from compilecast.v1 import cache_pb2 as pb

from .etcd import cmp_absent, op_put

if TYPE_CHECKING:
    from .etcd import Etcd
    from .metrics import CoordinatorMetrics

log = logging.getLogger(__name__)


def info_json(info: pb.ArtifactInfo) -> bytes:
    return json.dumps(
        {
            "digest": info.digest,
            "size": info.size,
            "compile_time_seconds": info.compile_time_seconds,
            "created_unix": info.created_unix,
            **({"recipe_digest": info.recipe_digest} if info.recipe_digest else {}),
        },
        sort_keys=True,
    ).encode()


# An index entry's fields; others (a newer replica's, in a rolling upgrade) are
# ignored, so that an entry is only ever unreadable when it is damaged.
_INFO_FIELDS = frozenset(pb.ArtifactInfo.DESCRIPTOR.fields_by_name) - {"key"}


def info_from(key: str, raw: bytes) -> pb.ArtifactInfo:
    d = json.loads(raw)
    return pb.ArtifactInfo(key=key, **{k: v for k, v in d.items() if k in _INFO_FIELDS})


def json_dict(raw: bytes) -> dict | None:
    """A record's JSON object, or None when it is not one (damaged, or put
    there by something else)."""
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def read_info(key: str, raw: bytes) -> pb.ArtifactInfo | None:
    """info_from, or None for an index entry that cannot be read (damaged, or
    written by something else): callers treat it as absent, never fail on it."""
    try:
        return info_from(key, raw)
    except (ValueError, TypeError, AttributeError):
        return None


DEFAULT_TENANT = "default"
EXPECTED_TTL_S = 10.0  # how long a program's expected compile time is reused
EXPECTED_MAX = 4096  # programs remembered at once (expired ones go first)
DEFAULT_LIST, MAX_LIST = 500, 5000  # artifacts per ListArtifacts page


def scope(tenant: str, key: str) -> str:
    """Tenants namespace every etcd record: P/<kind>/<tenant>/<key>."""
    return f"{tenant}/{key}"


def plain(sk: str) -> str:
    return sk.split("/", 1)[1]


def tenant_of(sk: str) -> str:
    return sk.split("/", 1)[0]



class KeyRecords:
    def __init__(self, etcd: Etcd, prefix: bytes, metrics: CoordinatorMetrics) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.metrics = metrics
        # The latest explained misses of this replica: (scoped key, name, differing, when).
        self.recent: deque[tuple[str, str, list[str], float]] = deque(maxlen=20)
        # Keys of one program name are recorded one at a time on a replica, so a
        # key is compared with the one recorded just before it, not raced by it.
        self._names: dict[tuple[str, str], list] = {}  # -> [lock, users]
        # Expected compile times by (tenant, program name): looked up when
        # read, shared by every waiter of a pod for EXPECTED_TTL_S.
        self._expected: dict[tuple[str, str], tuple[float, asyncio.Future]] = {}

    def _k(self, kind: str, sk: str) -> bytes:
        return self.prefix + f"/{kind}/{sk}".encode()

    async def expected_compile_s(self, tenant: str, program: str) -> float | None:
        """The longest compile time published for earlier keys of the same
        program name (None when unknown), as read at most EXPECTED_TTL_S ago:
        the thousand waiters of a pod's job start make one read, not two
        thousand. A hedge is a heuristic; seconds of staleness do not matter."""
        if not program:
            return None
        now = time.monotonic()
        entry = self._expected.get((tenant, program))
        if entry is None or now - entry[0] > EXPECTED_TTL_S:
            if len(self._expected) >= EXPECTED_MAX:
                self._expected = {k: v for k, v in self._expected.items()
                                  if now - v[0] <= EXPECTED_TTL_S}
                if len(self._expected) >= EXPECTED_MAX:
                    self._expected.clear()
            read = asyncio.ensure_future(self._expected_compile_s(tenant, program))
            entry = self._expected[(tenant, program)] = (now, read)

            def failed(read: asyncio.Future, name=(tenant, program)) -> None:
                if (read.cancelled() or read.exception() is not None) and \
                        self._expected.get(name, (0, None))[1] is read:
                    del self._expected[name]  # the next waiter reads again

            read.add_done_callback(failed)
        return await asyncio.shield(entry[1])

    async def _expected_compile_s(self, tenant: str, program: str) -> float | None:
        names = await self.etcd.get_prefix(self.name_prefix(tenant, program), limit=32,
                                           newest_first=True)
        keys = [f"{tenant}/{kv.key.rsplit(b'/', 1)[1].decode()}" for kv in names]
        if not keys:
            return None
        arts = await self.etcd.get_many([self._k("a", k) for k in keys])
        times = [t for a in arts if a is not None and isinstance(
            t := (json_dict(a.value) or {}).get("compile_time_seconds"), int | float)]
        return max(times) if times else None

    def name_prefix(self, tenant: str, program_name: str) -> bytes:
        digest = hashlib.sha256(program_name.encode()).hexdigest()[:32]
        return self.prefix + f"/n/{tenant}/{digest}/".encode()

    async def record(self, sk: str, program_name: str, comps: dict[str, str]) -> None:
        """Remember a key's components; count the miss by what differed from
        the nearest earlier key of the same program name."""
        name = (tenant_of(sk), program_name)
        slot = self._names.setdefault(name, [asyncio.Lock(), 0])
        slot[1] += 1
        try:
            async with slot[0]:
                await self._record(sk, program_name, comps)
        finally:
            slot[1] -= 1
            if not slot[1]:
                del self._names[name]

    async def _record(self, sk: str, program_name: str, comps: dict[str, str]) -> None:
        tenant, key = sk.split("/", 1)
        try:
            if not comps or await self.etcd.get(self._k("k", sk)) is not None:
                return
            # The 64 keys of this program name recorded last, their records in one read.
            earlier = await self.etcd.get_prefix(self.name_prefix(tenant, program_name),
                                                 limit=64, newest_first=True)
            others = await self.etcd.get_many(
                [self._k("k", f"{tenant}/{kv.key.rsplit(b'/', 1)[1].decode()}")
                 for kv in earlier]) if earlier else []
            best: list[str] | None = None
            for other in others:
                if other is None:
                    continue
                theirs = (json_dict(other.value) or {}).get("components", {})
                diff = sorted(n for n in set(comps) | set(theirs) if comps.get(n) != theirs.get(n))
                if best is None or len(diff) < len(best):
                    best = diff
            differing = ["new_program"] if best is None else best
            for component in differing:
                self.metrics.misses_by_component.labels(component).inc()
            if differing:
                self.recent.appendleft((sk, program_name, differing, time.time()))
            record = json.dumps({"program_name": program_name, "components": comps,
                                 "first_seen": time.time()}).encode()
            await self.etcd.txn([cmp_absent(self._k("k", sk))],
                                [op_put(self._k("k", sk), record),
                                 op_put(self.name_prefix(tenant, program_name) + key.encode(), b"")])
        except Exception as exc:  # bookkeeping only; never fails a decision
            log.debug("could not record key %s: %s", key, exc)

    async def list_artifacts(self, after: str, limit: int,
                             tenant: str = DEFAULT_TENANT) -> pb.ListArtifactsResponse:
        """A page of the tenant's index (key order, after `after`) with each
        key's program name, read in one round trip per page."""
        if after:
            validate.key(after)
        if not 0 <= limit <= MAX_LIST:
            raise InvalidRequest(f"limit must be between 0 and {MAX_LIST}, got {limit}")
        head = self._k("a", scope(tenant, ""))
        start = head + after.encode() + b"\x00" if after else None
        resp = pb.ListArtifactsResponse()
        page = await self.etcd.page(head, start, limit or DEFAULT_LIST)
        keys = [kv.key[len(head):].decode() for kv in page.kvs]
        records = await self.etcd.get_many([self._k("k", scope(tenant, k)) for k in keys])
        for key, kv, rec in zip(keys, page.kvs, records, strict=True):
            info = read_info(key, kv.value)
            if info is None:
                log.warning("unreadable index entry for %s: not listed", key)
                continue
            item = resp.artifacts.add(artifact=info)
            if rec is not None:
                item.program_name = str((json_dict(rec.value) or {}).get("program_name", ""))
        if page.more and keys:
            resp.next_after = keys[-1]
        return resp

    async def describe(self, key: str, tenant: str = DEFAULT_TENANT) -> pb.DescribeKeyResponse:
        validate.key(key)
        sk = scope(tenant, key)
        rec, art = await self.etcd.get_many([self._k("k", sk), self._k("a", sk)])
        if rec is None and art is None:
            raise NotFound(f"the coordinator has not seen key {key}")
        # A key published by a client that sent no components has no record.
        d = (json_dict(rec.value) if rec is not None else None) or {}
        resp = pb.DescribeKeyResponse(key=key, program_name=str(d.get("program_name", "")),
                                      first_seen_unix=float(d.get("first_seen", 0.0)))
        comps = d.get("components")
        if isinstance(comps, dict):
            resp.key_components.update({str(k): str(v) for k, v in comps.items()})
        if art is not None and (info := read_info(key, art.value)) is not None:
            resp.artifact.CopyFrom(info)
        return resp

