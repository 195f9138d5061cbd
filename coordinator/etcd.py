"""A small asyncio etcd v3 client over grpc.aio.

It speaks the etcd v3 gRPC API directly, using the API stubs shipped by the
`cslab-etcd3` package, so the coordinator's event loop never blocks on etcd
and needs no thread bridges. It keeps one channel per member (IP or DNS
name, plaintext or TLS) and moves to the next member when a call fails, so
losing one member does not fail client operations. Every call has a
deadline; whatever etcd cannot serve is raised as
compilecast.errors.Unavailable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from etcd3.etcdrpc import rpc_pb2, rpc_pb2_grpc

from compilecast import tracing
from compilecast.errors import Unavailable
from compilecast.grpcutil import aio_channel, rpc_problem, unreachable

# etcd3's generated messages and stubs carry no types (protoc's old output):
# read as Any, and the answers they give as Any (Etcd._call).
pb: Any = rpc_pb2
rpc: Any = rpc_pb2_grpc

log = logging.getLogger(__name__)

Compare = pb.Compare
# Transport failures and etcd's own "no leader" / "request timed out" errors.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.UNKNOWN}
OUT_OF_SPACE_HELP = ("its database passed its space quota and it refuses writes until an "
                     "operator compacts, defragments and disarms it (docs/operations.md, "
                     "\"etcd out of space\")")


# etcd's --max-txn-ops default: it refuses a txn with more compares, more
# success ops or more failure ops than this. Every txn of the coordinator is
# checked against it before it is sent (Etcd.txn), and every multi-key read
# or write is batched within it.
MAX_TXN_OPS = 128


class LeaseGone(Exception):
    """etcd refused a write because its lease no longer exists (it expired)."""


class TxnTooLarge(ValueError):
    """A txn beyond MAX_TXN_OPS: a bug of its caller, which must batch."""


class EtcdOutOfSpace(Unavailable):
    """etcd raised its NOSPACE alarm: reads and deletes work, writes do not."""


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with `prefix`."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _kv(k) -> KV:
    return KV(k.key, k.value, k.create_revision, k.mod_revision, k.lease)


def ranged(responses) -> list[KV | None]:
    """The key each op_get of a txn read, or None where it was absent."""
    return [_kv(r.response_range.kvs[0]) if r.response_range.kvs else None for r in responses]


# -- txn building helpers ---------------------------------------------------
def cmp_absent(key: bytes):
    return pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.CREATE, key=key, create_revision=0)


def cmp_mod_revision(key: bytes, revision: int):
    return pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.MOD, key=key, mod_revision=revision)


def op_put(key: bytes, value: bytes, lease: int = 0):
    return pb.RequestOp(request_put=pb.PutRequest(key=key, value=value, lease=lease))


def op_delete(key: bytes):
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key))


def op_get(key: bytes, revision: int = 0):
    return pb.RequestOp(request_range=pb.RangeRequest(key=key, revision=revision))


def check_txn_size(compare: Sequence, success: Sequence, failure: Sequence) -> None:
    """Raise TxnTooLarge for a txn etcd would refuse (each of its three
    lists is bounded by MAX_TXN_OPS)."""
    largest = max(len(compare), len(success), len(failure))
    if largest > MAX_TXN_OPS:
        raise TxnTooLarge(f"a txn of {len(compare)} compares, {len(success)} ops and "
                          f"{len(failure)} failure ops: etcd takes at most {MAX_TXN_OPS} "
                          "of each; batch it")


class EtcdClient(Protocol):
    """The etcd calls a replica's components make: what `Etcd` does over
    gRPC, and what a test's in-memory etcd (tests/fake_etcd.py) does at this
    interface. Components name this, never the concrete client."""

    endpoints: list[str]

    async def get(self, key: bytes) -> KV | None: ...

    async def page(self, prefix: bytes, start: bytes | None, limit: int) -> Any: ...

    async def get_prefix(self, prefix: bytes, *, limit: int = 0,
                         newest_first: bool = False) -> list[KV]: ...

    def scan_prefix(self, prefix: bytes, *, page: int = 1000) -> AsyncIterator[KV]: ...

    async def keys_between(self, start: bytes, end: bytes) -> set[bytes]: ...

    async def changed_since(self, prefix: bytes, revision: int) -> tuple[list[KV], int]: ...

    async def count_prefix(self, prefix: bytes) -> int: ...

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int: ...

    async def delete(self, key: bytes) -> None: ...

    async def txn(self, compare: Any, success: Any, failure: Any = (), *,
                  label: str = "Txn") -> tuple[bool, int, list]: ...

    async def get_many(self, keys: Sequence[bytes]) -> list[KV | None]: ...

    async def grant(self, ttl: int) -> int: ...

    async def revoke(self, lease_id: int) -> None: ...

    async def keepalive_once(self, lease_id: int) -> int: ...

    async def health(self) -> tuple[bool, str]: ...

    def watch_prefix(self, prefix: bytes, start_revision: int
                     ) -> AsyncIterator[tuple[int, list[Any]]]: ...


class Etcd:
    def __init__(self, endpoints: Sequence[str], *, timeout: float = 5.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.endpoints = [e.strip().removeprefix("http://").removeprefix("https://")
                          for e in endpoints if e.strip()]
        # One channel per member (IPs or DNS names alike); calls stick to one
        # member and move to the next when it fails.
        self._channels = [
            aio_channel(host, credentials, options=[
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2_000),
            ])
            for host in self.endpoints
        ]
        self._current = 0
        self.timeout = timeout
        self._use(0)
        self._keepalives: _KeepAlives | None = None
        # Told each unary request's method and seconds (the coordinator's
        # metrics); the watch and renewal streams are not requests.
        self.observe: Callable[[str, float], None] | None = None

    def _use(self, index: int) -> None:
        self._current = index % len(self._channels)
        ch = self._channels[self._current]
        self.kv = rpc.KVStub(ch)
        self.lease = rpc.LeaseStub(ch)
        self.maintenance = rpc.MaintenanceStub(ch)
        self.watch_stub = rpc.WatchStub(ch)

    def failover(self, failed: int) -> None:
        """Move past member `failed` (after a transport failure on it). Only
        if it is still the current one: concurrent calls that failed on the
        same member move once, never around the ring and back onto it."""
        if len(self._channels) > 1 and self._current == failed:
            self._use(failed + 1)

    async def close(self) -> None:
        if self._keepalives is not None:
            await self._keepalives.close()
        for ch in self._channels:
            await ch.close()

    async def _call(self, service: str, method: str, request, *, retries: int = 3,
                    label: str = "") -> Any:
        """One unary call with a deadline; on a transport failure, retry with
        backoff on the next member. Observed under `label` (default: the
        method's name)."""
        with tracing.span(f"etcd.{label or method}"):
            if self.observe is None:
                return await self._call_retrying(service, method, request, retries)
            start = time.perf_counter()
            try:
                return await self._call_retrying(service, method, request, retries)
            finally:
                self.observe(label or method, time.perf_counter() - start)

    async def _call_retrying(self, service: str, method: str, request, retries: int) -> Any:
        delay = 0.05
        for attempt in range(retries + 1):
            member = self._current
            fn = getattr(getattr(self, service), method)
            try:
                return await fn(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRYABLE and attempt < retries:
                    self.failover(member)
                    await asyncio.sleep(delay)
                    delay *= 4
                    continue
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    if "lease not found" in (exc.details() or "") and service == "kv":
                        raise LeaseGone(exc.details()) from None  # a write on an expired lease
                    raise  # e.g. revoking a lease that already expired
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED \
                        and "space exceeded" in (exc.details() or ""):
                    raise EtcdOutOfSpace(f"etcd is out of space: {OUT_OF_SPACE_HELP}") from None
                # Whatever else etcd says, for the caller etcd cannot serve now.
                raise Unavailable(f"etcd {rpc_problem(exc)}") from None

    # -- KV ------------------------------------------------------------------
    async def get(self, key: bytes) -> KV | None:
        resp = await self._call("kv", "Range", pb.RangeRequest(key=key))
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def _range(self, prefix: bytes, start: bytes | None = None, **kw):
        """One Range over the keys under `prefix` (from `start` on)."""
        return await self._call("kv", "Range", pb.RangeRequest(
            key=prefix if start is None else start, range_end=prefix_end(prefix), **kw))

    async def page(self, prefix: bytes, start: bytes | None, limit: int):
        """Up to `limit` keys under `prefix` from `start` on (the Range
        response: its kvs, and whether more follow)."""
        return await self._range(prefix, start, limit=limit)

    async def get_prefix(self, prefix: bytes, *, limit: int = 0,
                         newest_first: bool = False) -> list[KV]:
        """The keys under `prefix` in key order; with newest_first, the most
        recently created first (etcd sorts the range before the limit)."""
        order = (dict(sort_order=pb.RangeRequest.DESCEND, sort_target=pb.RangeRequest.CREATE)
                 if newest_first else {})
        return [_kv(k) for k in (await self._range(prefix, limit=limit, **order)).kvs]

    async def scan_prefix(self, prefix: bytes, *, page: int = 1000) -> AsyncIterator[KV]:
        """Every key under `prefix`, in key order, `page` at a time (one range
        of a large prefix can exceed the channel's message limit), all read at
        the revision of the first page."""
        start, revision = None, 0
        while True:
            resp = await self._range(prefix, start, limit=page, revision=revision)
            revision = revision or int(resp.header.revision)
            for k in resp.kvs:
                yield _kv(k)
            if not resp.more or not resp.kvs:
                return
            start = resp.kvs[-1].key + b"\x00"

    async def keys_between(self, start: bytes, end: bytes) -> set[bytes]:
        """The keys in [start, end), without their values."""
        resp = await self._call("kv", "Range", pb.RangeRequest(key=start, range_end=end,
                                                                 keys_only=True))
        return {k.key for k in resp.kvs}

    async def changed_since(self, prefix: bytes, revision: int) -> tuple[list[KV], int]:
        """The keys under `prefix` written after `revision` (filtered by etcd),
        and the revision they were read at: pass it next time."""
        resp = await self._range(prefix, min_mod_revision=revision + 1)
        return [_kv(k) for k in resp.kvs], int(resp.header.revision)

    async def count_prefix(self, prefix: bytes) -> int:
        return int((await self._range(prefix, count_only=True)).count)

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        resp = await self._call("kv", "Put", pb.PutRequest(key=key, value=value, lease=lease))
        return int(resp.header.revision)

    async def delete(self, key: bytes) -> None:
        await self._call("kv", "DeleteRange", pb.DeleteRangeRequest(key=key))

    async def txn(self, compare, success, failure=(), *,
                  label: str = "Txn") -> tuple[bool, int, list]:
        """Run a transaction; returns (succeeded, revision, responses).

        Retried on UNAVAILABLE/DEADLINE_EXCEEDED like every call, although a
        write may have landed before the error: every write txn of the
        coordinator is guarded by compares that make a re-run fail instead of
        applying twice, and its callers treat "not succeeded" as "re-read and
        decide again" (see coordinator/state.py), so a retry is safe.
        """
        compare, success, failure = list(compare), list(success), list(failure)
        check_txn_size(compare, success, failure)
        resp = await self._call("kv", "Txn",
            pb.TxnRequest(compare=compare, success=success, failure=failure), label=label)
        return bool(resp.succeeded), int(resp.header.revision), list(resp.responses)

    async def get_many(self, keys: Sequence[bytes]) -> list[KV | None]:
        """Read any number of keys at one revision: MAX_TXN_OPS a round trip,
        the first read's revision pinned for the rest (one round trip for up
        to MAX_TXN_OPS keys, as most callers read)."""
        found: list[KV | None] = []
        revision = 0
        for start in range(0, len(keys), MAX_TXN_OPS):
            _, rev, responses = await self.txn(
                [], [op_get(k, revision) for k in keys[start:start + MAX_TXN_OPS]],
                label="Txn/read")
            revision = revision or rev
            found += ranged(responses)
        return found

    # -- leases --------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        resp = await self._call("lease", "LeaseGrant", pb.LeaseGrantRequest(TTL=ttl))
        return int(resp.ID)

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._call("lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def keepalive_once(self, lease_id: int) -> int:
        """Refresh a lease; returns the TTL left (0: the lease is gone).
        Every renewal of this client goes over one LeaseKeepAlive stream: a
        message on an open stream, not a call each (renewals are not raft
        writes; etcd's leader answers them)."""
        if self._keepalives is None:
            self._keepalives = _KeepAlives(self)
        return await self._keepalives.renew(lease_id)

    async def health(self) -> tuple[bool, str]:
        """Whether etcd answers reads, and why it cannot serve us ("" when it
        can): unreachable, or an alarm raised (NOSPACE: reads work, writes
        are refused)."""
        member = self._current
        try:
            await self.kv.Range(pb.RangeRequest(key=b"health", limit=1), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            self.failover(member)
            return False, f"etcd {unreachable(exc)}"
        try:
            resp = await self.maintenance.Alarm(pb.AlarmRequest(action=pb.AlarmRequest.GET),
                                                timeout=2.0)
        except grpc.aio.AioRpcError:  # e.g. a role that may not read alarms: unknown, not unhealthy
            return True, ""
        alarms = sorted({pb.AlarmType.Name(a.alarm) for a in resp.alarms})
        if "NOSPACE" in alarms:
            return True, f"etcd raised its NOSPACE alarm: {OUT_OF_SPACE_HELP}"
        return True, f"etcd raised alarm {', '.join(alarms)}" if alarms else ""

    # -- watch ---------------------------------------------------------------
    async def watch_prefix(self, prefix: bytes, start_revision: int
                           ) -> AsyncIterator[tuple[int, list[Any]]]:
        """Yield batches of events under `prefix` from `start_revision` on.

        Raises Unavailable when the stream breaks; the caller resumes from the
        last revision it saw plus one.
        """
        create = pb.WatchRequest(
            create_request=pb.WatchCreateRequest(
                key=prefix, range_end=prefix_end(prefix), start_revision=start_revision,
                progress_notify=True,
            )
        )
        queue: asyncio.Queue = asyncio.Queue()
        await queue.put(create)

        async def requests():
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item

        member = self._current
        call = self.watch_stub.Watch(requests())
        try:
            async for resp in call:
                if resp.compact_revision:
                    raise Unavailable(f"watch compacted at {resp.compact_revision}")
                if resp.canceled:
                    raise Unavailable(f"watch canceled: {resp.cancel_reason}")
                yield resp.header.revision, list(resp.events)
        except grpc.aio.AioRpcError as exc:
            self.failover(member)
            raise Unavailable(f"etcd watch broke: {rpc_problem(exc)}") from None
        finally:
            await queue.put(None)
            call.cancel()


class WriteBatcher:
    """Independent writes (puts and deletes of distinct keys, no compares)
    sent together: while one txn is in flight, the writes that arrive queue
    and leave in the next, at most `max_ops` per txn (etcd's --max-txn-ops
    default). For records many callers write at the same moment, such as
    the waiters of a pod's job start: one raft proposal and one round trip
    for all of them instead of one each. A write returns once its txn is
    applied; a failed txn fails every write in it."""

    def __init__(self, etcd: EtcdClient, max_ops: int = 128) -> None:
        self.etcd = etcd
        self.max_ops = max_ops
        self._queue: dict[bytes, tuple[Any, list[asyncio.Future]]] = {}
        self._task: asyncio.Task | None = None
        self.txns = 0  # for tests: txns sent

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self._submit(key, op_put(key, value, lease))

    async def delete(self, key: bytes, *, written_before: bool = False) -> None:
        """Delete `key`. Unless it may have been written before (by an
        earlier txn of this batcher or anyone), a put of it still queued and
        the delete cancel out, and nothing is sent."""
        queued = self._queue.get(key)
        if not written_before and queued is not None and queued[0].HasField("request_put"):
            # Never sent: the put and its delete cancel out (etcd refuses a
            # txn that names one key twice).
            del self._queue[key]
            for done in queued[1]:
                if not done.done():
                    done.set_result(None)
            return
        await self._submit(key, op_delete(key))

    async def _submit(self, key: bytes, op) -> None:
        done = asyncio.get_running_loop().create_future()
        _, waiting = self._queue.pop(key, (None, []))  # a later write of a queued key wins
        self._queue[key] = (op, [*waiting, done])
        if self._task is None:
            self._task = asyncio.create_task(self._run(), context=tracing.untraced())
        await done

    async def _run(self) -> None:
        try:
            while self._queue:
                keys = list(itertools.islice(self._queue, self.max_ops))
                batch = [self._queue.pop(key) for key in keys]
                try:
                    await self.etcd.txn([], [op for op, _ in batch])
                    self.txns += 1
                    error = None
                except Exception as exc:  # Unavailable, or a bug: fail the writers
                    error = exc
                for _, waiting in batch:
                    for done in waiting:
                        if done.done():
                            continue
                        if error is None:
                            done.set_result(None)
                        else:
                            done.set_exception(error)
        finally:
            self._task = None


class _KeepAlives:
    """One LeaseKeepAlive stream for all of a client's renewals, opened on
    first use and again after it fails. etcd answers every request with the
    lease's id and TTL left, in order, so each answer settles the oldest
    renewal of that lease waiting for one."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self._requests: asyncio.Queue | None = None
        self._waiting: dict[int, deque[asyncio.Future]] = {}
        self._stream: asyncio.Task | None = None
        self._call = None  # the stream's gRPC call

    async def renew(self, lease_id: int) -> int:
        if self._stream is None or self._stream.done():
            self._requests = asyncio.Queue()
            self._stream = asyncio.get_running_loop().create_task(
                self._run(self._requests), context=tracing.untraced())
        answer = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(lease_id, deque()).append(answer)
        assert self._requests is not None
        self._requests.put_nowait(pb.LeaseKeepAliveRequest(ID=lease_id))
        try:
            return await asyncio.wait_for(answer, self.etcd.timeout)
        except TimeoutError:
            # A stream that stops answering is broken: the next renewal opens another.
            self._stream.cancel()
            raise Unavailable(f"etcd did not answer a lease renewal within "
                              f"{self.etcd.timeout:.0f}s") from None

    async def _run(self, requests: asyncio.Queue) -> None:
        async def sent():
            # Ends at the None the stream's end puts: a request iterator left
            # waiting in Queue.get would be collected after its loop closed.
            while (request := await requests.get()) is not None:
                yield request

        member = self.etcd._current
        call = self._call = self.etcd.lease.LeaseKeepAlive(sent())
        error: Exception = Unavailable("etcd closed the lease renewal stream")
        try:
            async for resp in call:
                waiting = self._waiting.get(resp.ID)
                while waiting:
                    answer = waiting.popleft()
                    if not answer.done():  # else its caller timed out
                        answer.set_result(int(resp.TTL))
                        break
                if waiting is not None and not waiting:
                    del self._waiting[resp.ID]
        except grpc.aio.AioRpcError as exc:
            self.etcd.failover(member)
            error = Unavailable(f"etcd {rpc_problem(exc)}")
        except asyncio.CancelledError:
            error = Unavailable("the lease renewal stream was closed")
        finally:
            requests.put_nowait(None)
            call.cancel()
            left, self._waiting = self._waiting, {}
            for answers in left.values():
                for answer in answers:
                    if not answer.done():
                        answer.set_exception(error)

    async def close(self) -> None:
        stream = self._stream  # (the one this close ends: a lease lost meanwhile opens another)
        if stream is None:
            return
        # End the call itself, not only the task reading it: a cancel that
        # lands inside gRPC's read can be taken for the call's own and the
        # task then waits on for a status that never comes (a hang at
        # shutdown, one close in a few).
        if self._requests is not None:
            self._requests.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        stream.cancel()
        done, _ = await asyncio.wait({stream}, timeout=5.0)
        if done and not stream.cancelled():
            stream.exception()  # retrieved: nobody waits on a closed stream
        await asyncio.sleep(0)  # gRPC's request reader takes the None and ends


def _holds(cmp, kv: KV | None) -> bool:
    """Whether a compare of the kinds the coordinator uses (absent, mod
    revision) holds for `kv` as read."""
    if cmp.target == pb.Compare.CREATE and cmp.result == pb.Compare.EQUAL:
        return (kv.create_revision if kv else 0) == cmp.create_revision
    if cmp.target == pb.Compare.MOD and cmp.result == pb.Compare.EQUAL:
        return (kv.mod_revision if kv else 0) == cmp.mod_revision
    raise ValueError(f"GuardedBatcher cannot evaluate compare {cmp}")


class GuardedBatcher:
    """Guarded writes of distinct keys (compare, put; else read), many in one
    txn: the compare-and-claim of every miss. While `in_flight` txns are
    out, the writes that arrive queue and leave together in the next (at
    most `max_items`, each named at most once per txn), so a burst of misses
    costs one round trip and one raft proposal for many. A full batch does
    not wait: while a full batch's worth queues, up to `full_in_flight` txns
    are out (etcd commits concurrent txns in one raft round), so the claims
    of a busy coordinator are not capped at `max_items` per round trip.

    Each caller gets what a txn of its own would have given: its compares
    are ANDed with the others', and when the batch fails, the failure
    branch has read every item's keys at the txn's revision. A caller whose
    compares failed there gets (False, revision, its reads); the others were
    blocked only by someone else's, and go again in the next batch (after
    two such rounds, alone). The compares must be of the kinds `_holds`
    evaluates."""

    def __init__(self, etcd: EtcdClient, *, max_items: int = 32, in_flight: int = 1,
                 full_in_flight: int = 4) -> None:
        self.etcd = etcd
        self.max_items = max_items  # 4 compares and reads each: etcd's 128-op limit
        self.in_flight = in_flight
        self.full_in_flight = max(full_in_flight, in_flight)
        self._queue: list[list] = []  # [compare, success, read, future, rounds]
        self._running = 0
        self._tasks: set[asyncio.Task] = set()
        self.txns = 0  # for tests: txns sent

    async def txn(self, compare: list, success: list,
                  read: list[bytes]) -> tuple[bool, int, list[KV | None]]:
        done = asyncio.get_running_loop().create_future()
        self._queue.append([compare, success, read, done, 0])
        self._kick()
        return await done

    def _kick(self) -> None:
        while self._queue and (self._running < self.in_flight or (
                self._running < self.full_in_flight and len(self._queue) >= self.max_items)):
            batch: list[list] = []
            rest: list[list] = []
            named: set[bytes] | None = set()
            for item in self._queue:
                if item[3].done():  # its caller is gone: nothing to claim for
                    continue
                keys = {op.request_put.key for op in item[1]}
                if item[4] >= 2 and not batch:  # blocked twice by others: alone
                    batch, named = [item], None
                elif (item[4] < 2 and named is not None and len(batch) < self.max_items
                      and not keys & named):
                    batch.append(item)
                    named |= keys
                else:
                    rest.append(item)
            self._queue = rest
            self._running += 1
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[list]) -> None:
        try:
            # Every item's reads and compared keys, once each.
            reads = list(dict.fromkeys(k for item in batch for k in
                                       (*item[2], *(c.key for c in item[0]))))
            try:
                ok, rev, responses = await self.etcd.txn(
                    [c for item in batch for c in item[0]],
                    [op for item in batch for op in item[1]],
                    [op_get(k) for k in reads])
                self.txns += 1
            except Exception as exc:  # Unavailable, or a bug: fail the writers
                for item in batch:
                    if not item[3].done():
                        item[3].set_exception(exc)
                return
            kvs = dict(zip(reads, ranged(responses), strict=True)) if not ok else {}
            for item in batch:
                # A batch of one that failed failed on its own compares.
                if not ok and len(batch) > 1 and all(_holds(c, kvs[c.key]) for c in item[0]):
                    item[4] += 1  # blocked by another's compare: again, next batch
                    self._queue.append(item)
                elif not item[3].done():
                    item[3].set_result((True, rev, []) if ok
                                       else (False, rev, [kvs[k] for k in item[2]]))
        finally:
            self._running -= 1
            self._kick()
