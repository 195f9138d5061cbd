"""One etcd prefix watch per coordinator replica, fanned out to waiters.

Waiters subscribe to a cache key *before* reading its state, so an event
after that read always wakes them. When the watch breaks (etcd member lost,
compaction), every subscriber is woken to re-read state, and the watch
resumes from the last revision seen (or from now after a compaction).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from compilecast.errors import Unavailable

from .etcd import EtcdClient

log = logging.getLogger(__name__)


class Subscription:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def clear(self) -> None:
        self._event.clear()

    def set(self) -> None:
        self._event.set()

    async def wait(self, seconds: float) -> bool:
        """True if woken, False if `seconds` passed first."""
        try:
            await asyncio.wait_for(self._event.wait(), seconds)
            return True
        except TimeoutError:
            return False


class WatchHub:
    def __init__(self, etcd: EtcdClient, prefix: bytes) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self._subs: dict[str, set[Subscription]] = defaultdict(set)
        self.ready = asyncio.Event()
        # Events on keys' state (a, l, x, h: what wakes a subscription) and
        # gaps, ever: a read that started when this was n has seen every event
        # a subscription cleared since then could miss. Waiter records and
        # the rest do not count: they never wake anyone.
        self.events = 0
        # Called with (scoped key, value, revision) when an artifact index
        # entry is put; with (scoped key, revision) when one is deleted; with
        # (scoped key, value or None) when a compile lease record is put or
        # deleted; with no arguments when the watch broke (events may be lost).
        self.on_artifact: list = []
        self.on_artifact_deleted: list = []
        self.on_claim: list = []
        self.on_gap: list = []

    def subscribe(self, key: str) -> Subscription:
        sub = Subscription()
        self._subs[key].add(sub)
        return sub

    def unsubscribe(self, key: str, sub: Subscription) -> None:
        subs = self._subs.get(key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[key]

    def wake(self, key: str) -> None:
        """Wake the key's waiters to re-read its state (a change etcd does not see)."""
        for s in self._subs.get(key, ()):
            s.set()

    def _wake_all(self) -> None:
        for subs in self._subs.values():
            for s in subs:
                s.set()

    def _dispatch(self, events: list) -> None:
        skip = len(self.prefix) + 1  # "P/"
        for ev in events:
            rest = ev.kv.key[skip:]
            kind, _, tail = rest.partition(b"/")
            if kind not in (b"a", b"l", b"x", b"h"):
                continue
            self.events += 1
            sk = tail.decode(errors="replace")
            if kind == b"a":
                if ev.type == ev.DELETE:
                    for fn in self.on_artifact_deleted:
                        fn(sk, ev.kv.mod_revision)
                else:
                    for fn in self.on_artifact:
                        fn(sk, ev.kv.value, ev.kv.mod_revision)
            elif kind == b"l":
                for fn in self.on_claim:
                    fn(sk, None if ev.type == ev.DELETE else ev.kv.value)
            for s in self._subs.get(sk, ()):
                s.set()

    async def run(self) -> None:
        start = 0
        backoff = 0.1
        while True:
            try:
                if start == 0:
                    # Resume "from now": state is re-read by every woken waiter.
                    _, revision, _ = await self.etcd.txn([], [], label="Txn/read")
                    start = revision + 1
                self.ready.set()
                async for _revision, events in self.etcd.watch_prefix(self.prefix + b"/", start):
                    backoff = 0.1
                    if events:
                        self._dispatch(events)
                        start = max(ev.kv.mod_revision for ev in events) + 1
            except asyncio.CancelledError:
                raise
            except Unavailable as exc:
                log.warning("etcd watch interrupted (%s); resuming", exc)
                if "compacted" in str(exc):
                    start = 0
            except Exception:
                log.exception("etcd watch failed; resuming")
            self.events += 1
            for fn in self.on_gap:
                fn()
            self._wake_all()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
