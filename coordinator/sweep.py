"""Index sweeps: etcd's records shrink with the store.

A bounded store evicts artifacts, but their index entries (P/a) stay in
etcd until a decision meets one and drops it: keys nobody asks for again
keep theirs forever. Every key's record (P/k and its program-name entry
P/n: what the key was made of, for explaining misses) stays as well. etcd's
database has a quota (4 GiB in the chart) past which every write fails, and
then every process compiles locally. So every `index_sweep_s` a replica
reads the index a page at a time and drops:

- index entries whose blob the store no longer holds;
- key records first seen more than `key_record_days` ago whose key has
  neither an artifact nor a compile in progress, with their program-name
  entries.

Every delete is guarded by the record's revision (and a record's by the
absence of the key's artifact and claim), so whatever was written since the
read stays. Replicas that sweep at once make the same deletes; the guards
make the second a no-op.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from compilecast.validate import DIGEST_RE

from .etcd import KV, cmp_absent, cmp_mod_revision, op_delete
from .records import json_dict

if TYPE_CHECKING:
    from collections.abc import Callable

    from .etcd import EtcdClient
    from .metrics import CoordinatorMetrics
    from .presence import Presence
    from .records import KeyRecords

log = logging.getLogger(__name__)

PAGE = 500  # records read (and stat'ed) at a time
GUARDED_PER_TXN = 25  # 3 compares and 2 deletes each: within etcd's 128 ops per txn


class IndexSweeper:
    def __init__(self, etcd: EtcdClient, prefix: bytes, presence: Presence,
                 records: KeyRecords, metrics: CoordinatorMetrics, *,
                 record_max_age_s: float, forget: Callable[[str, int], None]) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.presence = presence  # whether a blob is stored
        self.records = records
        self.metrics = metrics
        self.record_max_age_s = record_max_age_s  # 0: key records are kept forever
        self.forget = forget  # (scoped key, revision): the index entry is gone

    async def sweep(self) -> tuple[int, int]:
        """One sweep: (index entries dropped, key records dropped)."""
        entries = await self._in_pages(b"a", self._drop_missing)
        records = (await self._in_pages(b"k", self._drop_old)
                   if self.record_max_age_s > 0 else 0)
        if entries or records:
            log.info("index sweep: dropped %d index entries whose artifacts the store no "
                     "longer holds, %d key records older than %.0f days", entries, records,
                     self.record_max_age_s / 86400)
        return entries, records

    async def _in_pages(self, kind: bytes, drop) -> int:
        head = self.prefix + b"/" + kind + b"/"
        dropped, page = 0, []
        async for kv in self.etcd.scan_prefix(head, page=PAGE):
            page.append(kv)
            if len(page) == PAGE:
                dropped += await drop(head, page)
                page = []
        return dropped + (await drop(head, page) if page else 0)

    async def _drop_missing(self, head: bytes, kvs: list[KV]) -> int:
        """Drop the entries of `kvs` whose blob is not in the store."""
        digests = [_json(kv).get("digest") for kv in kvs]
        # A stat each (a bucket's HEAD off the loop, within a deadline). An
        # entry that names no valid digest is left alone: the decision that
        # meets it reports it; so is one whose blob the store cannot tell of now.
        present = [True if not (isinstance(d, str) and DIGEST_RE.match(d))
                   else await self.presence.check(d) for d in digests]
        gone = [kv for kv, here in zip(kvs, present, strict=True) if here is False]
        dropped = await self._guarded([([cmp_mod_revision(kv.key, kv.mod_revision)],
                                        [op_delete(kv.key)]) for kv in gone])
        for kv, revision in zip(gone, dropped, strict=True):
            if revision:
                self.forget(kv.key[len(head):].decode(), revision)
                self.metrics.swept.labels("index_entry").inc()
        return sum(1 for r in dropped if r)

    async def _drop_old(self, head: bytes, kvs: list[KV]) -> int:
        """Drop the key records of `kvs` first seen before the cutoff whose
        key has no artifact and no claim, with their program-name entries."""
        cutoff = time.time() - self.record_max_age_s
        # The keys of this page's span that have an artifact or a claim: two
        # key-only ranges (both kinds sort by scoped key, as the records do).
        lo, hi = kvs[0].key[len(head):], kvs[-1].key[len(head):] + b"\0"
        busy: set[bytes] = set()
        for kind in (b"/a/", b"/l/"):
            base = self.prefix + kind
            busy |= {k[len(base):] for k in await self.etcd.keys_between(base + lo, base + hi)}
        items = []
        for kv in kvs:
            if kv.key[len(head):] in busy:
                continue
            record = _json(kv)
            first_seen = record.get("first_seen")
            if not isinstance(first_seen, (int, float)) or first_seen >= cutoff:
                continue
            sk = kv.key[len(head):].decode()
            tenant, key = sk.split("/", 1)
            name = record.get("program_name")
            items.append((
                [cmp_mod_revision(kv.key, kv.mod_revision),
                 cmp_absent(self.prefix + b"/a/" + sk.encode()),
                 cmp_absent(self.prefix + b"/l/" + sk.encode())],
                [op_delete(kv.key), op_delete(self.records.name_prefix(
                    tenant, name if isinstance(name, str) else "") + key.encode())]))
        dropped = sum(1 for r in await self._guarded(items) if r)
        self.metrics.swept.labels("key_record").inc(dropped)
        return dropped

    async def _guarded(self, items: list[tuple[list, list]]) -> list[int]:
        """Apply each item's deletes if its compares hold, GUARDED_PER_TXN to a
        txn; a txn whose compares fail is retried an item at a time. Per
        item: the revision of its deletes, or 0 where its compares failed."""
        done: list[int] = []
        for start in range(0, len(items), GUARDED_PER_TXN):
            batch = items[start:start + GUARDED_PER_TXN]
            ok, revision, _ = await self.etcd.txn([c for cmp, _ in batch for c in cmp],
                                                  [op for _, ops in batch for op in ops])
            if ok:
                done += [revision] * len(batch)
            elif len(batch) == 1:
                done.append(0)
            else:  # someone wrote one of them meanwhile: find which
                for cmp, ops in batch:
                    ok, revision, _ = await self.etcd.txn(cmp, ops)
                    done.append(revision if ok else 0)
        return done


def _json(kv: KV) -> dict:
    """A record's JSON object; {} for anything else (left alone)."""
    return json_dict(kv.value) or {}
