"""Keys, scoped by tenant, and what each key was made of.

The layout helpers every coordinator module shares, and the records that
explain misses:

    P/k/TENANT/KEY               the key's component digests and program name
    P/n/TENANT/NAMEHASH/KEY      keys by program name (the nearest earlier key on a miss,
                                 and the program's known compile times for hedging)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from typing import TYPE_CHECKING, Any

from compilecast import tracing, validate
from compilecast.errors import InvalidRequest, NotFound
from compilecast.serving import cancel_all
from compilecast.v1 import cache_pb2 as pb

from .etcd import cmp_absent, op_put

if TYPE_CHECKING:
    from .etcd import KV, EtcdClient
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
LATEST = 64  # a miss is compared with this many latest keys of its program name
# How long the latest keys of a program name, as read from etcd, serve before
# they are read again. Between reads a replica sees its own records, not
# those of other replicas: a miss explained meanwhile may be compared with a
# less near key. It only ever changes which component a miss is counted by.
NAME_TTL_S = 10.0
NAMES_MAX = 1024  # program names whose latest keys are kept
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



class _Components:
    """A key's components, as sets that compare fast."""

    __slots__ = ("items", "names")

    def __init__(self, comps: dict[str, str]) -> None:
        self.items = frozenset(comps.items())
        self.names = frozenset(comps)

    def differing(self, other: _Components) -> int:
        """How many components differ (a name on one side only counts)."""
        entries = len(self.items ^ other.items)
        if self.names == other.names:
            return entries // 2  # each differing name: its two values
        return len(self.names_differing(other))

    def names_differing(self, other: _Components) -> list[str]:
        return sorted({n for n, _ in self.items ^ other.items})


class _Latest:
    """The LATEST keys of a program name, and which of them hold each
    (component, value): a miss finds its nearest earlier key among those it
    shares entries with, and compares with the others only while one of them
    could still be nearer."""

    __slots__ = ("_holding", "_keys", "_serial", "_sizes")

    def __init__(self, newest_first: list[_Components]) -> None:
        self._keys: OrderedDict[int, _Components] = OrderedDict()  # serial -> key, oldest first
        self._holding: dict[tuple[str, str], set[int]] = {}  # entry -> serials of keys with it
        self._sizes: Counter[int] = Counter()  # how many keys have so many components
        self._serial = 0
        for comps in reversed(newest_first[:LATEST]):
            self.add(comps)

    def add(self, comps: _Components) -> None:
        """The newest key; the oldest goes beyond LATEST."""
        self._serial += 1
        self._keys[self._serial] = comps
        self._sizes[len(comps.items)] += 1
        holding = self._holding
        for entry in comps.items:
            if (holders := holding.get(entry)) is None:
                holding[entry] = {self._serial}
            else:
                holders.add(self._serial)
        while len(self._keys) > LATEST:
            serial, old = self._keys.popitem(last=False)
            self._sizes[len(old.items)] -= 1
            for entry in old.items:
                holders = self._holding[entry]
                holders.discard(serial)
                if not holders:
                    del self._holding[entry]

    def nearest(self, mine: _Components) -> _Components | None:
        """The key with the fewest components differing from `mine`, the
        newest of those (a twin, all equal, first); None when there is none.
        Two keys that do not share u entries differ in u/2 to u components:
        the keys sharing some are tried by u, and the rest only while one
        could still be as near."""
        shared: dict[int, int] = {}
        for entry in mine.items:
            for serial in self._holding.get(entry, ()):
                shared[serial] = shared.get(serial, 0) + 1
        n = len(mine.items)
        best, fewest = 0, 0  # serial, components differing

        def nearer(serial: int, unshared: int) -> bool | None:
            """Compare with this key when it could be nearer (or as near and
            newer); None once no key left in a sorted walk can be."""
            nonlocal best, fewest
            least = (unshared + 1) // 2  # components differing, at least
            if best and (least > fewest or (least == fewest and serial < best)):
                return None if least > fewest else False
            differing = mine.differing(self._keys[serial])
            if not best or (differing, -serial) < (fewest, -best):
                best, fewest = serial, differing
            return True

        for unshared, neg_serial in sorted(
                (n + len(self._keys[s].items) - 2 * k, -s) for s, k in shared.items()):
            if nearer(-neg_serial, unshared) is None:
                break
        if len(shared) < len(self._keys):
            least = n + min(size for size, count in self._sizes.items() if count)
            for serial in reversed(self._keys):  # newest first
                if best and ((least + 1) // 2 > fewest or
                             ((least + 1) // 2 == fewest and serial < best)):
                    break  # none left can be nearer, nor as near and newer
                if serial not in shared:
                    nearer(serial, n + len(self._keys[serial].items))
        return self._keys[best] if best else None


class KeyRecords:
    BATCH_MAX = 32  # keys a round records: 2 puts each in one txn (etcd's 128-op limit)
    BACKLOG_MAX = 4096  # keys waiting to be recorded; more go unrecorded (counted)
    # Bookkeeping, read by people and scrapes: a tenth of a second late costs
    # nothing, and at 500 misses a second a round then records ~32 keys, not 1-2.
    ROUND_GAP_S = 0.1
    CLOSE_S = 5.0  # the longest a stop waits for the keys waiting to be recorded

    def __init__(self, etcd: EtcdClient, prefix: bytes, metrics: CoordinatorMetrics) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.metrics = metrics
        # The latest explained misses of this replica: (scoped key, name, differing, when).
        self.recent: deque[tuple[str, str, list[str], float]] = deque(maxlen=20)
        # Keys waiting to be recorded, and the task recording them.
        self._pending: deque[tuple[str, str, dict[str, str]]] = deque()
        self._recorder: asyncio.Task | None = None
        self.backlog_max = self.BACKLOG_MAX
        self.round_gap_s = self.ROUND_GAP_S
        self._stopping = asyncio.Event()  # set by close(): no round waits for more
        # (tenant, program name) -> (read at, the components of its latest keys,
        # newest first): read from etcd at most every NAME_TTL_S, and kept up
        # to date with what this replica records meanwhile.
        self._latest_of: dict[tuple[str, str], tuple[float, _Latest]] = {}
        # Expected compile times by (tenant, program name): looked up when
        # read, shared by every waiter of a pod for EXPECTED_TTL_S.
        self._expected: dict[tuple[str, str], tuple[float, asyncio.Future]] = {}
        self._children: dict[str, Any] = {}  # misses_by_component's, by component

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
        arts = await self._latest_of_name("a", tenant, program, 32)
        times = [t for a in arts if isinstance(
            t := (json_dict(a.value) or {}).get("compile_time_seconds"), int | float)]
        return max(times) if times else None

    async def _latest_of_name(self, kind: str, tenant: str, program: str,
                              limit: int) -> list[KV]:
        """The `kind` records (P/kind/...) of the `limit` keys of this program
        name recorded last, newest first, those that exist: two reads."""
        latest = await self.etcd.get_prefix(self.name_prefix(tenant, program), limit=limit,
                                            newest_first=True)
        if not latest:
            return []
        records = await self.etcd.get_many(
            [self._k(kind, f"{tenant}/{kv.key.rsplit(b'/', 1)[1].decode()}") for kv in latest])
        return [r for r in records if r is not None]

    def _by_component(self, component: str):
        """misses_by_component's child for `component`, made once (labels()
        costs several times an inc())."""
        child = self._children.get(component)
        if child is None:
            child = self._children[component] = self.metrics.misses_by_component.labels(component)
        return child

    def name_prefix(self, tenant: str, program_name: str) -> bytes:
        digest = hashlib.sha256(program_name.encode()).hexdigest()[:32]
        return self.prefix + f"/n/{tenant}/{digest}/".encode()

    def record(self, sk: str, program_name: str, comps: dict[str, str]) -> None:
        """Remember a key's components, in the background; count the miss by
        what differed from the nearest earlier key of the same program name.
        Bookkeeping only: beyond BACKLOG_MAX keys waiting (a storm of misses)
        a key goes unrecorded and is counted, and nothing ever fails a
        decision."""
        if not comps or self._stopping.is_set():
            return
        if len(self._pending) >= self.backlog_max:
            self.metrics.key_records_skipped.inc()
            return
        self._pending.append((sk, program_name, comps))
        if self._recorder is None:
            self._recorder = asyncio.get_running_loop().create_task(
                self._drain(), context=tracing.untraced())

    async def close(self) -> None:
        """Stop, once what waits is recorded (no round waits for more now),
        or after CLOSE_S: a graceful stop loses no records while etcd answers."""
        self._stopping.set()
        recorder = self._recorder
        if recorder is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(recorder), self.CLOSE_S)
        except TimeoutError:
            log.warning("stopping with %d key records unwritten", len(self._pending))
        finally:
            await cancel_all({recorder})

    async def _drain(self) -> None:
        """Record what waits, BATCH_MAX keys a round, in arrival order (a key
        is compared with the keys recorded before it, not raced by them).
        Short of a full batch, a round first waits ROUND_GAP_S for more: a
        round costs two etcd round trips whatever it holds."""
        try:
            while self._pending:
                if len(self._pending) < self.BATCH_MAX:
                    with contextlib.suppress(TimeoutError):  # the gap, or until close()
                        async with asyncio.timeout(self.round_gap_s):
                            await self._stopping.wait()
                batch = [self._pending.popleft()
                         for _ in range(min(self.BATCH_MAX, len(self._pending)))]
                try:
                    await self._record_batch(batch)
                except Exception as exc:  # bookkeeping only; never fails a decision
                    log.debug("could not record %d keys: %s", len(batch), exc)
        finally:
            self._recorder = None

    async def _record_batch(self, batch: list[tuple[str, str, dict[str, str]]]) -> None:
        """A few round trips for a whole batch: which keys are new, the
        latest 64 keys of each program name and their records, then the new
        records in one txn (one txn a key, should another replica have
        recorded one meanwhile)."""
        firsts, named = [], set()
        for item in batch:  # each key once, where it came first
            if item[0] not in named:
                named.add(item[0])
                firsts.append(item)
        seen = await self.etcd.get_many([self._k("k", sk) for sk, _, _ in firsts])
        new = [item for item, rec in zip(firsts, seen, strict=True) if rec is None]
        now = time.monotonic()
        names = [n for n in dict.fromkeys((tenant_of(sk), name) for sk, name, _ in new)
                 if now - self._latest_of.get(n, (-NAME_TTL_S, []))[0] >= NAME_TTL_S]
        earlier = await asyncio.gather(*(self._latest(tenant, name) for tenant, name in names))
        for n, comps in zip(names, earlier, strict=True):
            self._latest_of.pop(n, None)
            self._latest_of[n] = (now, _Latest(comps))
        while len(self._latest_of) > NAMES_MAX:  # the names read longest ago go
            self._latest_of.pop(next(iter(self._latest_of)))
        writes: list[tuple[list, list]] = []
        differed: Counter[str] = Counter()
        for sk, name, components in new:
            tenant, key = sk.split("/", 1)
            latest = self._latest_of[(tenant, name)][1]
            mine = _Components(components)
            best = latest.nearest(mine)
            latest.add(mine)  # the next key of this name is compared with it too
            differing = ["new_program"] if best is None else mine.names_differing(best)
            differed.update(differing)
            if differing:
                self.recent.appendleft((sk, name, differing, time.time()))
            record = json.dumps({"program_name": name, "components": components,
                                 "first_seen": time.time()}).encode()
            writes.append(([cmp_absent(self._k("k", sk))],
                           [op_put(self._k("k", sk), record),
                            op_put(self.name_prefix(tenant, name) + key.encode(), b"")]))
        for component, count in differed.items():
            self._by_component(component).inc(count)
        if not writes:
            return
        ok, _, _ = await self.etcd.txn([c for cmp, _ in writes for c in cmp],
                                       [op for _, ops in writes for op in ops])
        if not ok and len(writes) > 1:  # another replica recorded one of them
            await asyncio.gather(*(self.etcd.txn(cmp, ops) for cmp, ops in writes))

    async def _latest(self, tenant: str, program_name: str) -> list[_Components]:
        """The components of the LATEST keys of this program name recorded
        last, newest first."""
        comps = [(json_dict(rec.value) or {}).get("components")
                 for rec in await self._latest_of_name("k", tenant, program_name, LATEST)]
        return [_Components({str(k): str(v) for k, v in c.items()})
                for c in comps if isinstance(c, dict)]

    async def list_artifacts(self, after: str, limit: int, tenant: str = DEFAULT_TENANT,
                             prefix: str = "") -> pb.ListArtifactsResponse:
        """A page of the tenant's index (key order, after `after`, keys that
        start with `prefix`) with each key's program name, read in one round
        trip per page."""
        for value in (after, prefix):
            if value:
                validate.key(value)
        if not 0 <= limit <= MAX_LIST:
            raise InvalidRequest(f"limit must be between 0 and {MAX_LIST}, got {limit}")
        head = self._k("a", scope(tenant, ""))
        under = head + prefix.encode()
        start = max(under, head + after.encode() + b"\x00") if after else None
        resp = pb.ListArtifactsResponse()
        page = await self.etcd.page(under, start, limit or DEFAULT_LIST)
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

