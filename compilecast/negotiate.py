"""The routes an artifact's bytes may take besides the gRPC stream, and the
one place that says which of them an end may still take.

The gRPC stream (Fetch, Publish) is always there and always the last rung.
Each route below exists for one case and is measured against the stream on
that case (docs/architecture/transfers.md, "Routes"):

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

Each end (a CacheClient, a worker) builds a `RouteEnd` for each route it
offers: what that end does on the route (how it takes a fetch's answer from
there, how it sends a publish there, whether it suits a transfer) and what
its failures are. The end's `Routes` are those of its RouteEnds (`Routes.of`),
less those an operator switched off (COMPILECAST_<NAME>=0 where a route has
a variable); a transfer finds the RouteEnd of the way it takes in its end's
`Ends` (the takers, the senders).

Each transfer (a fetch, a publish, a fill) takes a `Ladder`: the routes of
its end's order that are on, and what a failure means, decided in one place
(`Ladder.failed`), and one loop (`carry`, `acarry`) around the transfer's
attempt, which also tries an attempt cut off again (its retry policy, within
its deadline) on the same ladder. A route's end raises `RouteFailed`; then:
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
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from compilecast.deadline import Deadline
from compilecast.retry import Retry, aattempts, attempts

log = logging.getLogger("compilecast.routes")

MAX_PLACES_NOTED = 4096  # places a route is noted off toward (more: tried again)
MAX_FAILURES = 16  # route failures of one transfer; past them, it takes the gRPC stream

T = TypeVar("T")
M = TypeVar("M")


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


# Smaller publishes go over gRPC: below this an upload's extra round trips (the
# ticket, the connection, the go) cost more than its cheaper bytes save
# (bench/publish.py: 0.1 MB 1.42x and 4 MB 1.22x the time, 16 MB 0.95x).
UPLOAD_FROM = 16 << 20


@dataclass(frozen=True)
class Way:
    """A route as one kind of transfer takes it: the request's field that
    offers it (`offers`), the routes it needs on as well (`needs`), the
    answer's field that says the far end took it (`answer`), and whether it
    is an upload (`upload`: it suits UPLOAD_FROM bytes and more)."""

    route: Route
    offers: str = ""
    needs: tuple[Route, ...] = ()
    answer: str = ""
    upload: bool = False

    def suits(self, size: int) -> bool:
        return not self.upload or size >= max(UPLOAD_FROM, 1)


# Each transfer's ways, in its order: the first on that the far end takes
# carries it (a fetch offers the routes it takes and its server picks among
# them; a publish takes the first that suits it). The tables build both the
# offer (`Ladder.offer`) and the dispatch of the answer (`Ladder.taken`).
HOST_FILE = Way(Route.LOCAL_FILE, "accept_local_file", answer="local_path")
GROWING_HOST_FILE = Way(Route.GROWING_FILE, "accept_growing_file", needs=(Route.LOCAL_FILE,))
PROCESS_FETCH = (HOST_FILE, GROWING_HOST_FILE,
                 Way(Route.DATA_PLANE, "accept_data_ticket", answer="data_ticket"))
WAIT = (Way(Route.DATA_WAIT, "accept_data_wait", needs=(Route.DATA_PLANE,),
            answer="data_ticket"),)
PROCESS_PUBLISH = (Way(Route.HANDOFF, needs=(Route.UPLOAD_TICKET,), upload=True),
                   Way(Route.DATA_PLANE, needs=(Route.UPLOAD_TICKET,), upload=True))
WORKER_FILL = (Way(Route.RELAY_PLANE, "accept_data_ticket", answer="data_ticket"),
               Way(Route.DATA_PLANE, "accept_data_ticket", answer="data_ticket"),
               Way(Route.BUCKET_URL, "accept_url", answer="url"))
WORKER_PUBLISH = (Way(Route.DATA_PLANE, needs=(Route.UPLOAD_TICKET,), upload=True),)


class RouteEnd:
    """What one end does on one route: the route (`route`, and the routes it
    brings along, `also`), whether it suits a transfer of so many bytes
    (`suits`), and how it takes or sends there (its kind's methods: a fetch's
    taker, a publish's sender); its failures are raised as its route's
    (`failed`)."""

    route: ClassVar[Route]
    also: ClassVar[tuple[Route, ...]] = ()

    def suits(self, size: int) -> bool:
        return True

    def failed(self, why: str, *, lasting: bool = False, where: str = "") -> RouteFailed:
        """This route's failure (see RouteFailed)."""
        return RouteFailed(self.route, why, lasting=lasting, where=where)


E = TypeVar("E", bound=RouteEnd)


class Ends(Generic[E]):
    """One end's RouteEnds of one kind (those that take a fetch's answer,
    those that send a publish), found by the way a transfer takes."""

    def __init__(self, ends: Iterable[E | None]) -> None:
        self._by_route = {r: e for e in ends if e is not None for r in (e.route, *e.also)}

    def of(self, way: Way) -> E:
        return self._by_route[way.route]

    def first(self, ladder: Ladder, size: int, where: str = "") -> E | None:
        """The end of the first way still open on `ladder` (toward `where`)
        that suits a transfer of `size` bytes, as the way and its end say."""

        def suits(way: Way) -> bool:
            end = self._by_route.get(way.route)
            return end is not None and end.suits(size)

        way = ladder.first(size, where, also=suits)
        return None if way is None else self._by_route[way.route]


class Routes:
    """The routes one end may still take (see the module's docstring)."""

    @classmethod
    def of(cls, ends: Iterable[RouteEnd | type[RouteEnd] | None],
           env: Mapping[str, str] | None = None) -> Routes:
        """The routes of `ends` (what this end built, or the kinds it
        offers; None: one it did not)."""
        return cls((r for e in ends if e is not None for r in (e.route, *e.also)), env)

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

    def answers(self, request: object, way: Way) -> bool:
        """Whether this end, the far end of a transfer, may answer `request`
        by `way`: the request offers it, and the route is on here."""
        return bool(getattr(request, way.offers, False)) and self.on(way.route)

    def taken(self) -> list[str]:
        """The routes on, by name (for status and logs)."""
        return sorted(r.name.lower() for r in self._on)

    def ladder(self, ways: Sequence[Way], *, key: str = "") -> Ladder:
        """A transfer's ladder: the ways of `ways` this end may take, in
        that order (of `key`, for the logs)."""
        return Ladder(self, ways, key=key)


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

    def __init__(self, routes: Routes, ways: Sequence[Way], *, key: str = "") -> None:
        self.routes = routes
        self.key = key
        self.ways = tuple(ways)
        needed = {r for w in self.ways for r in (w.route, *w.needs)}
        self._left = [r for r in Route if r in needed and routes.on(r)]
        self.failures: list[RouteFailed] = []

    def _has(self, route: Route, where: str = "") -> bool:
        return route in self._left and self.routes.on(route, where)

    def open(self, way: Way, where: str = "") -> bool:
        """Whether this transfer may still take `way` (toward `where`)."""
        return all(self._has(r, where if r is way.route else "")
                   for r in (way.route, *way.needs))

    def offer(self, request: M, where: str = "", *, only: Sequence[Route] = ()) -> M:
        """`request` (a message) with the fields set that offer the ways
        still open (of the `only` routes, when named)."""
        for way in self.ways:
            if way.offers and (not only or way.route in only) and self.open(way, where):
                setattr(request, way.offers, True)
        return request

    def taken(self, answer: object, request: object) -> Way | None:
        """The way the far end took in `answer` (a message whose field of
        that way is set, for a way `request` offered); None: none."""
        for way in self.ways:
            if way.answer and getattr(request, way.offers, False) and _set(answer, way.answer):
                return way
        return None

    def offered(self, request: object, route: Route) -> bool:
        """Whether `request` offers a way of `route` (its field is set)."""
        return any(w.route is route and w.offers and getattr(request, w.offers, False)
                   for w in self.ways)

    def first(self, size: int, where: str = "", *,
              also: Callable[[Way], bool] = lambda way: True) -> Way | None:
        """The first way still open that suits a transfer of `size` bytes (and
        that `also` says suits it)."""
        return next((w for w in self.ways if w.suits(size) and self.open(w, where) and also(w)),
                    None)

    def handled(self, exc: Exception) -> bool:
        """Whether `exc` is a route's failure, taken (`failed`): the
        transfer goes on down the ladder."""
        if not isinstance(exc, RouteFailed):
            return False
        self.failed(exc)
        return True

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


def _set(message: object, name: str) -> bool:
    """Whether a message's field `name` is set (a sub-message's presence, or
    a scalar's value)."""
    try:
        return bool(message.HasField(name))  # type: ignore[attr-defined]
    except ValueError:  # a scalar field: set when not empty
        return bool(getattr(message, name))


def carry(ladder: Ladder, attempt: Callable[[Ladder], T], *, again: Retry | None = None,
          what: str = "a transfer", deadline: Deadline | None = None,
          sleep: Callable[[float], None] = time.sleep) -> T:
    """Run a transfer's `attempt` on its ladder, in one loop: a route that
    fails sends it down the ladder (`Ladder.failed`); an attempt cut off as
    `again` says (a worker restarting, a replica that went away) is tried
    again on the same ladder after its pause, before `deadline`; anything
    else is the transfer's error (as is the last rung's)."""
    return attempts(lambda: attempt(ladder), again, what=what, deadline=deadline, sleep=sleep,
                    handled=ladder.handled)


async def acarry(ladder: Ladder, attempt: Callable[[Ladder], Awaitable[T]], *,
                 again: Retry | None = None, what: str = "a transfer",
                 deadline: Deadline | None = None) -> T:
    """`carry` for an asynchronous attempt."""
    return await aattempts(lambda: attempt(ladder), again, what=what, deadline=deadline,
                           handled=ladder.handled)
