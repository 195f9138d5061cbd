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

    def after(self, exc: BaseException, tries: int, began: float,
              deadline: Deadline | None = None) -> float | None:
        """The pause before a try again, after `exc` ended try `tries` (from
        0, begun at `began`); None: not again (not this policy's error, a
        refusal at once, no tries left, or no time left before `deadline`)."""
        if tries >= len(self.pauses) or not self.when(exc) \
                or time.monotonic() - began < self.ran_s:
            return None
        pause = self.pauses[tries]
        return pause if deadline is None or deadline.left_s() > pause else None

    def run(self, attempt: Callable[[], T], *, what: str, deadline: Deadline | None = None,
            sleep: Callable[[float], None] = time.sleep) -> T:
        """`attempt()`, tried again by this policy: its result, or the last error."""
        return attempts(attempt, self, what=what, deadline=deadline, sleep=sleep)

    async def arun(self, attempt: Callable[[], Awaitable[T]], *, what: str,
                   deadline: Deadline | None = None) -> T:
        """`run` for an asynchronous attempt."""
        return await aattempts(attempt, self, what=what, deadline=deadline)


def _never(exc: Exception) -> bool:
    return False


def _pause(exc: Exception, again: Retry | None, tries: int, began: float,
           deadline: Deadline | None, what: str) -> float | None:
    """The pause before trying again after `exc` (said in the log), or None: raised."""
    pause = None if again is None else again.after(exc, tries, began, deadline)
    if pause is not None:
        log.warning("%s was cut off (%s); trying again in %.1fs", what, exc, pause)
    return pause


def attempts(attempt: Callable[[], T], again: Retry | None, *, what: str,
             deadline: Deadline | None = None, sleep: Callable[[float], None] = time.sleep,
             handled: Callable[[Exception], bool] = _never) -> T:
    """`attempt()` until it returns: an error `handled` takes (True: a
    transfer's route failed, and its ladder goes on without it) is tried
    again at once; one that cut it off, as `again` says (Retry.after), after
    that policy's pause; any other is raised."""
    tries = 0
    while True:
        began = time.monotonic()
        try:
            return attempt()
        except Exception as exc:
            if handled(exc):
                continue
            pause = _pause(exc, again, tries, began, deadline, what)
            if pause is None:
                raise
            sleep(pause)
        tries += 1


async def aattempts(attempt: Callable[[], Awaitable[T]], again: Retry | None, *, what: str,
                    deadline: Deadline | None = None,
                    handled: Callable[[Exception], bool] = _never) -> T:
    """`attempts` for an asynchronous attempt."""
    tries = 0
    while True:
        began = time.monotonic()
        try:
            return await attempt()
        except Exception as exc:
            if handled(exc):
                continue
            pause = _pause(exc, again, tries, began, deadline, what)
            if pause is None:
                raise
            await asyncio.sleep(pause)
        tries += 1


CUT_AFTER_S = 0.5  # a call that failed later than this had been running: cut off, not refused

ACQUIRE = Retry("acquire", (1.0, 2.0), unavailable)
WAIT = Retry("wait", WAIT_RETRY_S, degraded, ran_s=CUT_AFTER_S)
FETCH = Retry("fetch", (1.0, 4.0), cut_off)
PUBLISH = Retry("publish", (1.0, 4.0), unavailable)
RESUME = Retry("resume", (1.0, 4.0), unavailable)
RELAYED_WAIT = Retry("wait upstream", WAIT_RETRY_S, degraded)
JOB_STREAM = Retry("job stream", (1.0, 2.0, 5.0, 10.0, 30.0), degraded)
