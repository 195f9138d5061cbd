"""Lease releases sent behind a JAX process's compile (worker/jaxdoor/jax_integration.py)."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

log = logging.getLogger("compilecast.jax")

# Releases still queued when the process exits (or compilecast is disabled)
# are sent for at most this long; a lease not released lapses in its TTL.
RELEASE_FLUSH_S = 2.0


class Releases:
    """Releases nobody in this process waits for (a program under JAX's
    caching thresholds), sent in order by a daemon thread of their own: the
    compile returns to JAX without a round trip to the worker. Every JAX op
    run outside jit compiles such a program, and each release cost it ~5 ms
    here (bench/small_compiles.py: compilecast added 11.4 ms a small program
    with the release on the compile's path, 7.2 ms without). `flush` waits
    for those queued, bounded."""

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            me = weakref.ref(self)

            def in_the_child() -> None:
                releases = me()
                if releases is not None:
                    releases._reset()

            os.register_at_fork(after_in_child=in_the_child)

    def _reset(self) -> None:
        # Also in a forked child (the only thread there): the parent's thread,
        # any lock it held and the releases it had queued are not this process's.
        self._cond = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._busy = False
        self._started = False  # its thread starts with the first release

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, args=(self._cond, self._jobs),
                                 name="compilecast-release", daemon=True).start()
            self._cond.notify_all()

    def _run(self, cond: threading.Condition, jobs: deque[Callable[[], None]]) -> None:
        while True:
            with cond:
                while not jobs:
                    cond.wait()
                job = jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception:  # (a release logs its own RPC errors)
                log.exception("compilecast: a release failed")
            finally:
                with cond:
                    self._busy = False
                    cond.notify_all()

    def flush(self, timeout_s: float = RELEASE_FLUSH_S) -> bool:
        """Wait until every release queued has been sent, for at most
        `timeout_s`; whether they all were."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True
