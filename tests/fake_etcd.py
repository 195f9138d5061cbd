"""An in-memory stand-in for coordinator/etcd.py's `Etcd`, at our own
interface (the methods the coordinator's components call), for unit tests
that build one component alone: one revision counter, keys with create and
mod revisions, leases that expire when told to (`expire`), transactions of
the compares the coordinator uses (absent, mod revision), the 128-operation
limit etcd keeps, and a prefix watch fed by every write. Real etcd is what
every other test runs against.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

from etcd3.etcdrpc import kv_pb2
from etcd3.etcdrpc import rpc_pb2 as pb

from compilecast.coordinator.etcd import KV, MAX_TXN_OPS, check_txn_size, prefix_end


class FakeEtcd:
    def __init__(self) -> None:
        self.endpoints = ["fake"]
        self.revision = 1
        self.data: dict[bytes, KV] = {}
        self.leases: dict[int, int] = {}  # id -> ttl
        self._lease_ids = itertools.count(1000)
        self._watchers: list[tuple[bytes, asyncio.Queue]] = []
        self.round_trips = 0  # reads and transactions (a component's cost, as tests count it)

    # -- writes --------------------------------------------------------------
    def _notify(self, events: list[Any]) -> None:
        for prefix, queue in self._watchers:
            mine = [e for e in events if e.kv.key.startswith(prefix)]
            if mine:
                queue.put_nowait((self.revision, mine))

    def _put(self, key: bytes, value: bytes, lease: int, events: list[Any]) -> None:
        if lease and lease not in self.leases:
            raise ValueError(f"lease {lease} not found")
        old = self.data.get(key)
        kv = KV(key, value, old.create_revision if old else self.revision, self.revision, lease)
        self.data[key] = kv
        events.append(kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv_pb2.KeyValue(
            key=key, value=value, create_revision=kv.create_revision,
            mod_revision=kv.mod_revision, lease=lease)))

    def _delete(self, key: bytes, events: list[Any]) -> bool:
        if self.data.pop(key, None) is None:
            return False
        events.append(kv_pb2.Event(type=kv_pb2.Event.DELETE, kv=kv_pb2.KeyValue(
            key=key, mod_revision=self.revision)))
        return True

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        self.revision += 1
        events: list[Any] = []
        self._put(key, value, lease, events)
        self._notify(events)
        return self.revision

    async def delete(self, key: bytes) -> None:
        events: list[Any] = []
        self.revision += 1
        if not self._delete(key, events):
            self.revision -= 1
        self._notify(events)

    # -- reads ---------------------------------------------------------------
    async def get(self, key: bytes) -> KV | None:
        self.round_trips += 1
        await asyncio.sleep(0)
        return self.data.get(key)

    def _under(self, prefix: bytes, start: bytes | None = None) -> list[KV]:
        end = prefix_end(prefix)
        return [kv for k, kv in sorted(self.data.items())
                if (start or prefix) <= k < end and k.startswith(prefix)]

    async def get_prefix(self, prefix: bytes, *, limit: int = 0,
                         newest_first: bool = False) -> list[KV]:
        kvs = self._under(prefix)
        if newest_first:
            kvs.sort(key=lambda kv: -kv.create_revision)
        return kvs[:limit] if limit else kvs

    async def page(self, prefix: bytes, start: bytes | None, limit: int) -> Any:
        kvs = self._under(prefix, start)
        resp = pb.RangeResponse(more=len(kvs) > limit, count=len(kvs))
        for kv in kvs[:limit]:
            resp.kvs.add(key=kv.key, value=kv.value, create_revision=kv.create_revision,
                         mod_revision=kv.mod_revision, lease=kv.lease)
        return resp

    async def scan_prefix(self, prefix: bytes, *, page: int = 1000) -> AsyncIterator[KV]:
        for kv in self._under(prefix):
            yield kv

    async def keys_between(self, start: bytes, end: bytes) -> set[bytes]:
        return {k for k in self.data if start <= k < end}

    async def changed_since(self, prefix: bytes, revision: int) -> tuple[list[KV], int]:
        return [kv for kv in self._under(prefix) if kv.mod_revision > revision], self.revision

    async def count_prefix(self, prefix: bytes) -> int:
        return len(self._under(prefix))

    async def get_many(self, keys: Sequence[bytes]) -> list[KV | None]:
        self.round_trips += (len(keys) + MAX_TXN_OPS - 1) // MAX_TXN_OPS
        await asyncio.sleep(0)
        return [self.data.get(k) for k in keys]

    # -- transactions ----------------------------------------------------------
    def _holds(self, cmp: Any) -> bool:
        kv = self.data.get(cmp.key)
        if cmp.target == pb.Compare.CREATE and cmp.result == pb.Compare.EQUAL:
            return (kv.create_revision if kv else 0) == cmp.create_revision
        if cmp.target == pb.Compare.MOD and cmp.result == pb.Compare.EQUAL:
            return (kv.mod_revision if kv else 0) == cmp.mod_revision
        if cmp.target == pb.Compare.VALUE and cmp.result == pb.Compare.EQUAL:
            return kv is not None and kv.value == cmp.value
        raise ValueError(f"FakeEtcd cannot evaluate {cmp}")

    async def txn(self, compare: Sequence[Any], success: Sequence[Any],
                  failure: Sequence[Any] = (), *, label: str = "Txn") -> tuple[bool, int, list]:
        compare, success, failure = list(compare), list(success), list(failure)
        check_txn_size(compare, success, failure)
        self.round_trips += 1
        await asyncio.sleep(0)  # a round trip: others run meanwhile
        ok = all(self._holds(c) for c in compare)
        ops = success if ok else failure
        writes = any(op.WhichOneof("request") in ("request_put", "request_delete_range")
                     for op in ops)
        if writes:
            self.revision += 1
        events: list[Any] = []
        responses = []
        for op in ops:
            kind = op.WhichOneof("request")
            if kind == "request_put":
                self._put(op.request_put.key, op.request_put.value, op.request_put.lease, events)
                responses.append(pb.ResponseOp(response_put=pb.PutResponse()))
            elif kind == "request_delete_range":
                gone = self._delete(op.request_delete_range.key, events)
                responses.append(pb.ResponseOp(response_delete_range=pb.DeleteRangeResponse(
                    deleted=int(gone))))
            elif kind == "request_range":
                kv = self.data.get(op.request_range.key)
                rr = pb.RangeResponse()
                if kv is not None:
                    rr.kvs.add(key=kv.key, value=kv.value, create_revision=kv.create_revision,
                               mod_revision=kv.mod_revision, lease=kv.lease)
                responses.append(pb.ResponseOp(response_range=rr))
            else:
                raise ValueError(f"FakeEtcd cannot run {op}")
        self._notify(events)
        return ok, self.revision, responses

    # -- leases ----------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        lease = next(self._lease_ids)
        self.leases[lease] = ttl
        return lease

    async def revoke(self, lease_id: int) -> None:
        self.expire(lease_id)

    async def keepalive_once(self, lease_id: int) -> int:
        return self.leases.get(lease_id, 0)

    def expire(self, lease_id: int) -> None:
        """The lease lapses: its keys go, as etcd deletes them."""
        self.leases.pop(lease_id, None)
        doomed = [k for k, kv in self.data.items() if kv.lease == lease_id]
        if doomed:
            self.revision += 1
            events: list[Any] = []
            for k in doomed:
                self._delete(k, events)
            self._notify(events)

    async def health(self) -> tuple[bool, str]:
        return True, "fake"

    async def close(self) -> None:
        pass

    # -- the watch -------------------------------------------------------------
    async def watch_prefix(self, prefix: bytes, start_revision: int
                           ) -> AsyncIterator[tuple[int, list[Any]]]:
        queue: asyncio.Queue = asyncio.Queue()
        entry = (prefix, queue)
        self._watchers.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.remove(entry)

