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
A route that fails in a way that will fail again (an address that cannot be
connected to, a server that offers no tickets, a file this process cannot
read) is switched off for the end's life, or toward one peer (`where`); a
failure of one transfer (a connection cut midway) only sends that transfer
down the ladder, and the route is tried again next time.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable, Mapping

log = logging.getLogger("compilecast.routes")

MAX_PLACES_NOTED = 4096  # peers a route is noted off toward (more: tried again)


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


class Routes:
    """The routes one end may still take (see the module's docstring)."""

    def __init__(self, offered: Iterable[Route],
                 env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._on = {r for r in offered if env.get(r.env, "1") != "0"}
        self._off_toward: dict[tuple[Route, str], str] = {}  # (route, place) -> why

    def on(self, route: Route, where: str = "") -> bool:
        """Whether this end may take `route` (toward `where`, a peer)."""
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
