"""The routes an artifact's bytes may take besides the gRPC stream, and the
one place that says which of them an end may still take.

The gRPC stream (Fetch, Publish) is always there and always the last rung.
Each route below exists for one case and is measured against the stream on
that case (docs/architecture.md, "Routes"):

    fetch, a process from its host's worker:
        LOCAL_FILE    the host cache's file, read and verified by the process
        GROWING_FILE  a download the worker is still writing, followed in its file
    fetch, a process or a worker from the coordinator:
        DATA_PLANE    whole artifacts over plain TCP (sendfile), for a ticket
        DATA_WAIT     a wait that wants the bytes goes on there when it ends
    fetch, a worker's fill:
        BUCKET_URL    the bucket itself, by a presigned URL
        RELAY_PLANE   a peer worker's relay, over its TCP data plane (per peer)
    publish:
        HANDOFF       a process hands the bytes to its host's worker as a sealed
                      memory file
        UPLOAD_TICKET the server hands out upload tickets (OpenUpload): the data
                      plane's upload, or with HANDOFF the handoff's ticket

Each end (a CacheClient, a worker) holds one `Routes`: the routes offered at
its start (what its settings, its channel and the host allow), less those
an operator switched off (COMPILECAST_<NAME>=0 where a route has a variable).

Each transfer (a fetch, a publish, a fill) takes a `Ladder`: the routes of
its end's order that are on, and what a failure means, decided in one place
(`Ladder.failed`), and one loop (`carry`, `acarry`) around the transfer's
attempt. A route's end raises `RouteFailed`; then:
  - the transfer goes on without that route (down the ladder, at last the
    gRPC stream), and a later transfer tries it again;
  - a failure that will fail again (`lasting`: an address that cannot be
    connected to, a server that offers no tickets, a file this process
    cannot read) also switches the route off for the end's life, or toward
    one place only (`where`: a peer, an artifact).
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

log = logging.getLogger("compilecast.routes")

MAX_PLACES_NOTED = 4096  # places a route is noted off toward (more: tried again)
MAX_FAILURES = 16  # route failures of one transfer; past them, it takes the gRPC stream

T = TypeVar("T")


class Route(enum.Enum):
    LOCAL_FILE = "COMPILECAST_LOCAL_FILES"
    GROWING_FILE = "COMPILECAST_GROWING_FILES"
    DATA_PLANE = "COMPILECAST_DATA_PLANE"
    DATA_WAIT = "COMPILECAST_DATA_WAITS"
    BUCKET_URL = "COMPILECAST_BUCKET_URLS"
    RELAY_PLANE = "COMPILECAST_RELAY_PLANE"
    HANDOFF = "COMPILECAST_HANDOFF"
    UPLOAD_TICKET = "COMPILECAST_UPLOAD_TICKETS"

    @property
    def env(self) -> str:
        """The environment variable that switches the route off (=0)."""
        return self.value


# Each transfer's order: the first route on that the far end takes carries it
# (a fetch names the routes it takes and its server picks among them).
PROCESS_FETCH = (Route.LOCAL_FILE, Route.GROWING_FILE, Route.DATA_PLANE)
WAIT = (Route.DATA_WAIT, Route.DATA_PLANE)
PROCESS_PUBLISH = (Route.UPLOAD_TICKET, Route.HANDOFF, Route.DATA_PLANE)
WORKER_FILL = (Route.RELAY_PLANE, Route.DATA_PLANE, Route.BUCKET_URL)
WORKER_PUBLISH = (Route.UPLOAD_TICKET, Route.DATA_PLANE)


class Routes:
    """The routes one end may still take (see the module's docstring)."""

    def __init__(self, offered: Iterable[Route],
                 env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._on = {r for r in offered if env.get(r.env, "1") != "0"}
        self._off_toward: dict[tuple[Route, str], str] = {}  # (route, place) -> why

    def on(self, route: Route, where: str = "") -> bool:
        """Whether this end may take `route` (toward `where`: a peer, an artifact)."""
        return route in self._on and (not where or (route, where) not in self._off_toward)

    def off(self, route: Route, why: str, *, where: str = "") -> bool:
        """Switch `route` off for good (toward `where` only, when given):
        whether it was on until now."""
        was = self.on(route, where)
        if where:
            if was and len(self._off_toward) < MAX_PLACES_NOTED:
                self._off_toward[(route, where)] = why
        else:
            self._on.discard(route)
        if was:
            log.info("route %s off%s: %s", route.name.lower(),
                     f" toward {where}" if where else "", why)
        return was

    def taken(self) -> list[str]:
        """The routes on, by name (for status and logs)."""
        return sorted(r.name.lower() for r in self._on)

    def ladder(self, order: Sequence[Route], *, key: str = "") -> Ladder:
        """A transfer's ladder: the routes of `order` this end may take, in
        that order (of `key`, for the logs)."""
        return Ladder(self, order, key=key)


class RouteFailed(Exception):
    """A route could not carry a transfer (raised by the route's end). With
    `lasting`, it will fail again: the route goes off for the end's life, or
    toward `where` only."""

    def __init__(self, route: Route, why: str, *, lasting: bool = False,
                 where: str = "") -> None:
        super().__init__(why)
        self.route = route
        self.why = why
        self.lasting = lasting
        self.where = where


class Ladder:
    """The routes one transfer may still take, in its end's order; the gRPC
    stream, never in it, is the last rung."""

    def __init__(self, routes: Routes, order: Sequence[Route], *, key: str = "") -> None:
        self.routes = routes
        self.key = key
        self._left = [r for r in order if routes.on(r)]
        self.failures: list[RouteFailed] = []

    def has(self, route: Route, where: str = "") -> bool:
        """Whether this transfer may still take `route` (toward `where`)."""
        return route in self._left and self.routes.on(route, where)

    def failed(self, failure: RouteFailed) -> None:
        """What a failure means: the transfer goes on without the route
        (toward `where` only, when a place is named); a lasting failure also
        switches it off for the end (toward `where` only), which says so."""
        self.failures.append(failure)
        log.info("%s: route %s failed (%s)", self.key or "a transfer",
                 failure.route.name.lower(), failure.why,
                 extra={"key": self.key} if self.key else None)
        if failure.lasting:
            self.routes.off(failure.route, failure.why, where=failure.where)
        if not failure.where and failure.route in self._left:
            self._left.remove(failure.route)
        if len(self.failures) >= MAX_FAILURES:  # however its routes fail: the stream
            self._left.clear()


def carry(ladder: Ladder, attempt: Callable[[Ladder], T]) -> T:
    """Run a transfer's `attempt` on its ladder until it no longer fails on
    a route: its result, or the error of its last rung."""
    while True:
        try:
            return attempt(ladder)
        except RouteFailed as failure:
            ladder.failed(failure)


async def acarry(ladder: Ladder, attempt: Callable[[Ladder], Awaitable[T]]) -> T:
    """`carry` for an asynchronous attempt."""
    while True:
        try:
            return await attempt(ladder)
        except RouteFailed as failure:
            ladder.failed(failure)
