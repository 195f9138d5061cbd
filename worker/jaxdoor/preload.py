"""A restart's executables, loaded while the program starts (docs/jax.md, "The preload").

A restarted job asks again for the programs it ran before, and on a TPU
loading one (reading and deserializing it) costs a quarter of compiling
it, on the critical path of every restart. The job's recipes (recorded
where each artifact was published: the key, the compile options, the
devices, the platform; `compilecast precompile` records the same) say what
the job will ask for. Once the devices are open, background threads fetch
each of this process's programs through the worker (every byte verified
against its digest, as any read) and load it, in the order the programs
were first published, while the program does its own start-up (restoring
a checkpoint, opening its data). When JAX asks for a key, a loaded
executable of exactly that key is taken, and JAX neither reads nor loads.

- The key decides, as it does for every read: another program, the same
  program with other compile options or on other devices, is another key,
  and never takes a preload.
- A preload that fails (the worker slow or gone, a digest that does not
  match, devices that are not this process's, a load XLA refuses) is
  dropped with a log line; the program reads and loads as without one.
- The program never waits for a preload longer than its own load would
  take: one still fetching (or queued) when JAX asks is dropped, and only
  one already loading (local work on bytes in hand) is waited for.
- Bounds: `programs` preloads (the job's newest), `max_bytes` of their
  entries, `threads` loading at once; a loaded executable that JAX has not asked for within
  `unused_s` is freed (its device memory with it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from compilecast.v1 import cache_pb2 as pb

log = logging.getLogger("compilecast.jax")

ENV = "COMPILECAST_PRELOAD"  # "0" (or "false", "off"): no preload
PROGRAMS = 32  # preloads a process holds at most
MAX_BYTES = 8 << 30  # and at most these bytes of their entries
THREADS = 2  # fetching and loading at once
UNUSED_S = 600.0  # a loaded executable JAX has not asked for this long is freed

QUEUED, FETCHING, LOADING, READY, DONE = "queued", "fetching", "loading", "ready", "done"


class Source(Protocol):
    """Where a process's preloads come from (its worker)."""

    def recipes(self, job: str) -> Sequence[pb.Recipe]: ...

    def fetch(self, key: str) -> bytes: ...  # verified against the artifact's digest


# (entry, compile options, device ids, platform) -> (loaded executable, compile time)
Load = Callable[[bytes, bytes, list[int], str], tuple[Any, int]]


@dataclass
class PreloadStats:
    listed: int = 0  # the job's programs this process runs, as recorded
    loaded: int = 0
    used: int = 0  # taken by JAX in place of a read and a load
    freed: int = 0  # loaded, never asked for within unused_s
    dropped: int = 0  # failed, or asked for before they were loaded
    seconds_saved: float = 0.0  # the loads the program did not wait for


@dataclass(eq=False)
class _Slot:
    recipe: pb.Recipe
    state: str = QUEUED
    loaded: tuple[Any, int] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    load_s: float = 0.0
    size: int = 0


class Preloads:
    """The preloads of one process. `source`: its worker; `load`: JAX's load
    of an entry (jax_adapter.load_executable); `ours`: whether a program on
    these device ids of this platform runs in this process."""

    def __init__(self, source: Source, load: Load, ours: Callable[[list[int], str], bool], *,
                 programs: int = PROGRAMS, max_bytes: int = MAX_BYTES, threads: int = THREADS,
                 unused_s: float = UNUSED_S) -> None:
        self.source = source
        self.load = load
        self.ours = ours
        self.programs = programs
        self.max_bytes = max_bytes
        self.threads = threads
        self.unused_s = unused_s
        self.stats = PreloadStats()
        self._slots: dict[str, _Slot] = {}
        self._queue: list[_Slot] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self.listed = threading.Event()  # the job's programs were listed (or could not be)

    # -- what the program's start does -----------------------------------------------
    def start(self, job: str) -> None:
        """List the job's programs and load this process's (on this thread,
        which the door starts once the devices are open; never raises)."""
        try:
            self._list(job)
        except Exception as exc:  # (the worker slow or gone): no preload, nothing else lost
            log.info("compilecast: no preload for job %s: %s: %s", job, type(exc).__name__, exc)
        finally:
            self.listed.set()
        workers = [threading.Thread(target=self._work, name=f"compilecast-preload-{i}",
                                    daemon=True) for i in range(max(0, self.threads - 1))]
        for w in workers:
            w.start()
        self._work()

    def _list(self, job: str) -> None:
        seen: set[str] = set()
        mine = []
        for r in sorted(self.source.recipes(job), key=lambda r: r.created_unix):
            if not r.key or r.key in seen or not r.compile_options or not r.device_ids:
                continue
            seen.add(r.key)
            if self.ours(list(r.device_ids), r.target.platform):
                mine.append(r)
        with self._lock:
            self.stats.listed = len(mine)
            for r in mine[-self.programs:] if self.programs > 0 else ():  # the newest, in order
                slot = self._slots[r.key] = _Slot(r)
                self._queue.append(slot)
        log.info("compilecast: preloading %d of job %s's %d programs here", len(self._queue),
                 job, len(mine))

    def _next(self) -> _Slot | None:
        with self._lock:
            while self._queue:
                slot = self._queue.pop(0)
                if slot.state == QUEUED:
                    slot.state = FETCHING
                    return slot
        return None

    def _work(self) -> None:
        while (slot := self._next()) is not None:
            self._one(slot)

    def _one(self, slot: _Slot) -> None:
        r = slot.recipe
        try:
            entry = self.source.fetch(r.key)
            with self._lock:
                if slot.state != FETCHING:  # asked for meanwhile: JAX reads it itself
                    return
                if self._bytes + len(entry) > self.max_bytes:
                    raise MemoryError(f"past the preloads' bound of {self.max_bytes} bytes")
                self._bytes += len(entry)
                slot.size, slot.state = len(entry), LOADING
            began = time.monotonic()
            loaded = self.load(entry, r.compile_options, list(r.device_ids), r.target.platform)
            with self._lock:
                slot.loaded, slot.load_s, slot.state = loaded, time.monotonic() - began, READY
                self.stats.loaded += 1
            timer = threading.Timer(self.unused_s, self._free, (r.key, slot))
            timer.daemon = True
            timer.start()
        except Exception as exc:  # any failure: dropped, JAX reads and loads as always
            log.info("compilecast: the preload of %s dropped: %s: %s", r.key,
                     type(exc).__name__, exc, extra={"key": r.key})
            self._drop(slot)
        finally:
            slot.done.set()

    def _drop(self, slot: _Slot) -> None:
        with self._lock:
            if slot.state not in (DONE,):
                self.stats.dropped += 1
                self._bytes -= slot.size
                slot.state, slot.loaded, slot.size = DONE, None, 0

    def _free(self, key: str, slot: _Slot) -> None:
        with self._lock:
            if slot.state != READY:
                return
            slot.state, slot.loaded = DONE, None
            self._bytes -= slot.size
            self.stats.freed += 1
        log.info("compilecast: a preload never asked for in %.0fs freed (%s)", self.unused_s,
                 key, extra={"key": key})

    # -- what JAX asks ------------------------------------------------------------------
    def take(self, key: str) -> tuple[Any, int] | None:
        """The loaded executable of exactly `key` (and its compile time), or
        None: JAX reads and loads it as always. Waits only for a load under
        way (bytes in hand), never for a fetch."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            if slot.state in (QUEUED, FETCHING):  # (not loading yet: no wait for the worker)
                slot.state = DONE
                self.stats.dropped += 1
                return None
        if slot.state == LOADING:
            slot.done.wait()
        with self._lock:
            if slot.state != READY:
                return None
            loaded, slot.loaded, slot.state = slot.loaded, None, DONE
            self._bytes -= slot.size
            self.stats.used += 1
            self.stats.seconds_saved += slot.load_s
        return loaded

    def held(self) -> dict[str, str]:
        """Each preload's state (status, tests)."""
        with self._lock:
            return {k: s.state for k, s in self._slots.items()}
