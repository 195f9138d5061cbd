"""Lifecycle shared by the coordinator and worker servers: a grpc.aio server
with health checking and reflection, a Prometheus endpoint, and graceful
shutdown on SIGINT/SIGTERM with a deadline (previous handlers restored)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from compilecast.decideserve import Streams
from compilecast.grpcutil import MESSAGE_OPTIONS, PING_EVERY_MS, add_service
from compilecast.v1 import cache_pb2

log = logging.getLogger(__name__)

# gRPC sets SO_REUSEPORT on Linux by default: a second server on a port that
# one of ours already serves would bind it too and silently take half of its
# connections (a leftover coordinator answering for a new one). Ours bind
# alone, so a taken port is a ListenError.
#
# gRPC core keeps the calls that arrived before the application picked them up
# (grpc.aio picks them up one at a time); past its soft limit (1,000 by
# default) it cancels new ones at random, and grpc.aio reports that to the
# client as INTERNAL. A pod's start opens a stream per host at once, so the
# backlog is set above every bound of ours (jobwatch.MAX_STREAMS job streams,
# a replica's Decide streams and waits): a call past one of those is answered
# by us, RESOURCE_EXHAUSTED with why, never cancelled by the transport.
MAX_PENDING_CALLS = 32_768  # calls arrived and not yet picked up (gRPC core's soft limit)
MAX_PENDING_CALLS_HARD = 40_960  # past it gRPC core refuses every new call
SERVER_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0),
                  ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                  ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS_HARD),
                  ("grpc.http2.min_recv_ping_interval_without_data_ms", PING_EVERY_MS)]

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CompileCache"].full_name


def make_server(servicer, **more) -> tuple[grpc.aio.Server, HealthServicer]:
    """A grpc.aio server with the CompileCache `servicer`, the servicers of
    `more` (service name: servicer), health and reflection."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    classes = {d.full_name: getattr(cache_pb2, d.name)
               for d in cache_pb2.DESCRIPTOR.message_types_by_name.values()}
    for name, impl in {"CompileCache": servicer, **more}.items():
        add_service(server, impl, cache_pb2.DESCRIPTOR.services_by_name[name], classes)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server, health_servicer


async def set_serving(health_servicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)


_TAKEN = " (another process has it, or it is not this machine's)"


class ListenError(RuntimeError):
    """A server cannot listen where it was told to (the address is taken, or
    not this machine's); the message names the address and the setting."""


def listen(server: grpc.aio.Server, address: str, creds=None, *, setting: str) -> int:
    """`server` listens on `address` (TLS with `creds`); the port. Raises
    ListenError, naming `setting`, when it cannot. A unix socket's file is
    taken over only when nothing serves it (a stale one of a crashed run)."""
    if address.startswith("unix://"):
        _claim_socket(address, setting)
    try:
        return (server.add_secure_port(address, creds) if creds is not None
                else server.add_insecure_port(address))
    except RuntimeError as exc:
        raise ListenError(f"cannot listen on {address} ({setting}): gRPC could not bind it"
                          f"{_TAKEN}") from exc


def _claim_socket(address: str, setting: str) -> None:
    """Make room for a unix socket at `address`: its directory, and no stale
    file. A socket some process still accepts on is refused (unlinking it
    would orphan that process: a second worker on a host taking over the
    first's socket)."""
    path = address.removeprefix("unix://")
    directory = os.path.dirname(path) or "."
    try:  # its own directory at most (0700), never a tree of them
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ListenError(f"cannot listen on {address} ({setting}): cannot make its "
                          f"directory {directory}: {exc.strerror or exc}"
                          f"{' (make its parent first)' if isinstance(exc, FileNotFoundError) else ''}"
                          ) from None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except FileNotFoundError:
        return
    except ConnectionRefusedError:  # nobody accepts on it: a previous run's
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError:
        return  # not a socket, or not ours to probe: the bind says why
    finally:
        probe.close()
    raise ListenError(f"cannot listen on {address} ({setting}): another process serves it "
                      f"(a compilecast worker already running on this host?)")


def start_metrics(registry: CollectorRegistry, host: str, port: int) -> object | None:
    if port <= 0:
        return None
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ListenError(f"cannot serve metrics on {host}:{port} (metrics_port): "
                          f"{exc.strerror or exc}{_TAKEN}") from None
    return server


class Background:
    """Tasks a component starts and does not await (cleanups, revokes,
    retirements): held until they end, so that none is collected mid-run;
    a failure is logged at debug, never raised."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.debug("background task failed: %s", task.exception())


async def cancel_all(tasks, *, every_s: float = 1.0) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again
    every `every_s` those that have not: Python 3.11's wait_for can swallow a
    cancel that lands as its inner future completes, and a loop that catches
    the error it got instead carries on (a stop then waited forever). Their
    errors are retrieved, not raised."""
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
    for t in tasks:
        if not t.cancelled():
            t.exception()


async def serve_until_signal(
    server: grpc.aio.Server,
    *,
    on_stop: Callable[[], Awaitable[None]],
    grace_s: float = 10.0,
    stop_event: asyncio.Event | None = None,
    on_drain: Callable[[], None] = lambda: None,
) -> None:
    """Run until SIGINT/SIGTERM (or `stop_event`), then stop gracefully:
    end long-lived streams cleanly (`on_drain`), refuse new calls, let
    in-flight calls (publishes) finish within `grace_s`, then run `on_stop`."""
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError):
            previous[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down (grace %.0fs)", grace_s)
        on_drain()
        await server.stop(grace_s)
        await on_stop()
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)


# A full collection walks every tracked object: 15-25 ms of a loaded
# coordinator's loop, whose start-up heap (modules, protobuf descriptors,
# grpc) is nearly all it walks (BENCHMARKS.md, "Decisions per second").
GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class HeapWatch:
    """A serving process's garbage collector, settled and watched. At
    start-up, once everything is imported and listening, what survives a
    collection is frozen (gc.freeze): it lives as long as the process, and
    later collections no longer walk it. Then every collection's pause is
    observed in `compilecast_<role>_gc_pause_seconds` (by generation) of
    each role's registry (`up` serves both roles in one process), until
    close(). Objects frozen that later become cyclic garbage are never
    collected; at start-up there are none to speak of."""

    def __init__(self, roles: dict[str, CollectorRegistry]) -> None:
        gc.collect()
        gc.freeze()
        self._pauses = []
        for role, registry in roles.items():
            pauses = Histogram(
                f"compilecast_{role}_gc_pause_seconds",
                "How long each garbage collection of this process held it (all of its "
                "threads), by generation", ["generation"], buckets=GC_PAUSE_BUCKETS,
                registry=registry)
            self._pauses.append([pauses.labels(str(g)) for g in range(3)])
            Gauge(f"compilecast_{role}_gc_frozen_objects",
                  "Objects frozen after start-up, which collections no longer walk",
                  registry=registry).set_function(gc.get_freeze_count)
        self._began = 0.0
        gc.callbacks.append(self._collected)

    def _collected(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        for by_generation in self._pauses:
            by_generation[info["generation"]].observe(took)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._collected)


class Role:
    """Lifecycle shared by the coordinator and the worker: subclasses build
    `server`, `health` and `_metrics_server` in start() and release their
    own resources in _release()."""

    ROLE: str  # its metrics' prefix: compilecast_<ROLE>_...
    registry: CollectorRegistry
    server: grpc.aio.Server
    server_streams: Streams | None = None  # the service's Decide streams
    health: HealthServicer
    _metrics_server: Any = None  # prometheus_client's HTTP server

    async def start(self) -> None:
        raise NotImplementedError

    async def _release(self) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        """End the Decide streams cleanly: each answers what it has read."""
        if self.server_streams is not None:
            self.server_streams.drain()

    async def _close(self) -> None:
        await self._release()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()  # (its listening socket)

    async def stop(self, grace_s: float = 10.0) -> None:
        await set_serving(self.health, False)
        self.drain()
        await self.server.stop(grace_s)
        await self._close()

    async def serve(self, stop_event: asyncio.Event | None = None) -> None:
        await self.start()
        heap = HeapWatch({self.ROLE: self.registry})
        try:
            await serve_until_signal(self.server, on_stop=self._close, stop_event=stop_event,
                                     on_drain=self.drain)
        finally:
            heap.close()
