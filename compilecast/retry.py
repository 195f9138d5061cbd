"""When a client sends a call again: one policy per kind of call, applied
where the call is made (a client's edge), as etcd's client applies its retry
interceptor, never as loops of their own around a transfer's route ladder.

A call is sent again only where another try can end otherwise: a server
restarting or gone (a rolling update) under a call that was cut off, never a
refusal. Each policy names the pauses between tries; a deadline (a wait's
share-binary timeout) ends them sooner.

    ACQUIRE  a decision asked of a worker that does not answer (restarting:
             a DaemonSet rollout takes a second or two)
    WAIT     a process's wait cut off after it ran: sent again, on a new
             stream, within its deadline (one refused at once is not: nobody
             there, compile locally)
    RELAYED_WAIT  a worker's wait upstream, for its host's processes: sent
             again while the coordinator does not answer (a replica stopping
             in a rolling update ends its waits), within the deadline
    FETCH    a fetch cut off after its first message (CutOff)
    PUBLISH  a publish cut off: the lease still holds and the bytes are here
    RESUME   a worker's download the coordinator cut off (UNAVAILABLE): it goes
             on from the byte it had, at the replica that took the address
    JOB_STREAM  a host's stream for its job's waits, ended or refused: opened
             again after each pause in turn, the last for ever after (its
             waits go upstream key by key meanwhile)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from compilecast.deadline import Deadline
from compilecast.errors import CompilecastError, CutOff, Status
from compilecast.wire import WAIT_RETRY_S

log = logging.getLogger("compilecast.retry")

T = TypeVar("T")

DEGRADED = frozenset({Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED})


def unavailable(exc: BaseException) -> bool:
    return isinstance(exc, CompilecastError) and exc.status == Status.UNAVAILABLE


def degraded(exc: BaseException) -> bool:
    """A server that did not answer in time or at all (not one that refused)."""
    return isinstance(exc, CompilecastError) and exc.status in DEGRADED


def cut_off(exc: BaseException) -> bool:
    return isinstance(exc, CutOff)


@dataclass(frozen=True)
class Retry:
    """One kind of call's policy: the pauses before each try again, which
    errors earn one (`when`), and how long a try must have run to count as
    cut off rather than refused (`ran_s`)."""

    name: str
    pauses: tuple[float, ...]
    when: Callable[[BaseException], bool]
    ran_s: float = 0.0

    def pause(self, tries: int) -> float:
        """The pause before try `tries` (from 0) again; the last one past the end."""
        return self.pauses[min(tries, len(self.pauses) - 1)]

    def _again(self, exc: BaseException, pause: float | None, began: float,
               deadline: Deadline | None) -> bool:
        now = time.monotonic()
        if pause is None or not self.when(exc) or now - began < self.ran_s:
            return False
        return deadline is None or deadline.left_s() > pause

    def run(self, attempt: Callable[[], T], *, what: str, deadline: Deadline | None = None,
            sleep: Callable[[float], None] = time.sleep) -> T:
        """`attempt()`, tried again by this policy: its result, or the last error."""
        for pause in (*self.pauses, None):
            began = time.monotonic()
            try:
                return attempt()
            except Exception as exc:
                if not self._again(exc, pause, began, deadline):
                    raise
                assert pause is not None
                log.warning("%s was cut off (%s); trying again in %.1fs", what, exc, pause)
                sleep(pause)
        raise AssertionError("unreachable")

    async def arun(self, attempt: Callable[[], Awaitable[T]], *, what: str,
                   deadline: Deadline | None = None) -> T:
        """`run` for an asynchronous attempt."""
        for pause in (*self.pauses, None):
            began = time.monotonic()
            try:
                return await attempt()
            except Exception as exc:
                if not self._again(exc, pause, began, deadline):
                    raise
                assert pause is not None
                log.warning("%s was cut off (%s); trying again in %.1fs", what, exc, pause)
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")


CUT_AFTER_S = 0.5  # a call that failed later than this had been running: cut off, not refused

ACQUIRE = Retry("acquire", (1.0, 2.0), unavailable)
WAIT = Retry("wait", WAIT_RETRY_S, degraded, ran_s=CUT_AFTER_S)
FETCH = Retry("fetch", (1.0, 4.0), cut_off)
PUBLISH = Retry("publish", (1.0, 4.0), unavailable)
RESUME = Retry("resume", (1.0, 4.0), unavailable)
RELAYED_WAIT = Retry("wait upstream", WAIT_RETRY_S, degraded)
JOB_STREAM = Retry("job stream", (1.0, 2.0, 5.0, 10.0, 30.0), degraded)
