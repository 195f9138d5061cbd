"""Whether a blob is in the store, asked from the event loop without ever
waiting on the network there.

A disk store answers at once (a stat). A bucket-backed store answers at once
for what its local cache holds or it has seen in the bucket; anything else
takes a HEAD request, which runs on a few threads of its own (one request per
digest however many decisions ask), each awaited for at most `deadline_s`.
Past it, or with the bucket unreachable, the answer is None: "cannot tell
now", and the caller goes on without it (a slow or hung bucket slows only
the requests that need its objects; the replica keeps deciding and renewing
leases). Each check that passed its deadline is counted
(compilecast_coordinator_bucket_stalls), which the chart's alert watches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from compilecast.errors import Unavailable
from compilecast.store import ArtifactStore

log = logging.getLogger(__name__)

DEADLINE_S = 2.0  # a bucket's answer to a HEAD, awaited this long (within clients' call deadlines)
THREADS = 8  # HEAD requests in flight at once
MAX_PENDING = 1024  # digests being asked about; past it: "cannot tell now" at once


class Presence:
    def __init__(self, store: ArtifactStore, stalled, *, deadline_s: float = DEADLINE_S) -> None:
        self.store = store
        self.stalled = stalled  # a counter: checks that passed their deadline
        self.deadline_s = deadline_s
        self._threads: ThreadPoolExecutor | None = None
        self._pending: dict[str, asyncio.Future[bool]] = {}
        self._said = 0.0

    @property
    def waiting(self) -> int:
        """Checks waiting on the store now (a stopped bucket: they pile up)."""
        return len(self._pending)

    def known(self, digest: str) -> bool | None:
        """The answer when no request is needed, else None."""
        return self.store.known(digest)

    async def check(self, digest: str) -> bool | None:
        """Whether `digest` is stored; None when the store cannot tell within
        the deadline."""
        known = self.store.known(digest)
        if known is not None:
            return known
        asked = self._pending.get(digest)
        if asked is None:
            if len(self._pending) >= MAX_PENDING:
                self._stall(f"{len(self._pending)} checks already waiting on the bucket")
                return None
            if self._threads is None:
                self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="presence")
            asked = asyncio.get_running_loop().run_in_executor(self._threads, self.store.has,
                                                               digest)
            self._pending[digest] = asked
            asked.add_done_callback(lambda _: self._pending.pop(digest, None))
        try:
            return await asyncio.wait_for(asyncio.shield(asked), self.deadline_s)
        except TimeoutError:
            self._stall(f"no answer within {self.deadline_s:g}s")
            return None
        except Unavailable as exc:
            self._stall(str(exc))
            return None

    def _stall(self, why: str) -> None:
        self.stalled.inc()
        now = time.monotonic()
        if now - self._said >= 60:
            self._said = now
            log.warning("the store cannot tell whether a blob is there (%s): decisions go on "
                        "without it", why)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
