"""Routes JAX's persistent compilation cache through the local worker.

Runs inside the user's JAX process, so it never raises into JAX and never
blocks past the share-binary timeout: every failure ends in "compile
locally", with a warning that says why. When the worker is unreachable the
integration stops asking for a short backoff, so a dead worker costs one
failed connection, not one per compile.

The decision read before a compile (see jax_adapter) goes:
  HIT             -> fetch, verify the digest, hand the bytes to JAX
  COMPILE         -> return a miss; JAX compiles; the compile hook publishes
  WAIT            -> wait (HIT: load; promoted: compile and publish;
                     timeout or error: compile locally)
  COMPILE_LOCALLY -> return a miss and publish nothing (a warning says why,
                     unless the entry is under JAX's caching thresholds:
                     that is logged at INFO, as nothing is wrong)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from compilecast import tracing
from compilecast.config import default_worker_target
from compilecast.deadline import Deadline
from compilecast.errors import (
    CompilecastError,
    CorruptBlob,
    DeadlineExceeded,
    NotFound,
    Unavailable,
)
from compilecast.grpcutil import unreachable
from compilecast.v1 import cache_pb2 as pb

from ..inprocess import policy
from ..inprocess.client import CacheClient, ClientShell, Identity
from ..keylib import keys
from ..xla import jax_adapter
from .preload import ENV as PRELOAD_ENV
from .preload import Preloads
from .releases import Releases

log = logging.getLogger("compilecast.jax")

UNREACHABLE_BACKOFF_S = 30.0
REASONS_KEPT = 100
# XLA's GPU autotune results: a synced directory of this kind per namespace,
# brought up to date before a process's first GPU compile for this long at most.
AUTOTUNE_KIND = "xla-autotune"
AUTOTUNE_SYNC_S = 10.0


@dataclass
class Stats:
    """What this process did; `compilecast.jax.stats()` returns a copy."""

    hits: int = 0
    compiles: int = 0  # compiles under a lease (the fleet's one compile)
    published: int = 0
    waits: int = 0
    promotions: int = 0
    local_compiles: int = 0  # compiles without sharing (fallbacks, thresholds)
    fallbacks: int = 0  # errors that ended in compiling locally
    released: int = 0
    profiles_published: int = 0  # FDO/PGLE profiles this process shared
    profiles_received: int = 0  # profiles taken from the store (another process's, or stored)
    # Why each local compile or fallback happened: the latest REASONS_KEPT (a
    # process that runs for days keeps compiling new shapes).
    reasons: deque[str] = field(default_factory=lambda: deque(maxlen=REASONS_KEPT))

    preloads: dict[str, Any] = field(default_factory=dict)  # (preload.PreloadStats, as a dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, reasons=list(self.reasons), preloads=dict(self.preloads))


@dataclass
class _Held:
    lease: pb.Lease
    started: float
    identity: Identity
    # (module, devices, compile_options, backend, Key.program_bytes), for the recipe
    inputs: tuple = ()
    trace: dict = field(default_factory=dict)  # the decision's span (W3C), for the release


MAX_DESCRIBED = 256


class CompilecastCache(jax_adapter.CacheInterface):
    def __init__(self, target: str, *, timeout_ms: int | None = None, job: str | None = None,
                 rpc_timeout_s: float = 5.0) -> None:
        self.target = target
        self.timeout_ms = timeout_ms
        self.job = job
        self.client = CacheClient(target, timeout_s=rpc_timeout_s,
                                  token=os.environ.get("COMPILECAST_TOKEN", ""))
        # The client policy's shell (worker/inprocess/policy.py), as the PJRT gate's is.
        self._shell = ClientShell(self.client)
        self.stats = Stats()
        self.key_config = keys.KeyConfig.from_env()
        self._held: dict[str, _Held] = {}
        self._described: dict[str, tuple[str, dict[str, str], float, tuple]] = {}
        self._profiles: dict[str, bytes] = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._releases = Releases()
        self._autotune_dirs: dict[tuple, str] = {}
        self.preloads: Preloads | None = None  # (preload_job: once the devices are open)

    # -- the preload (worker/jaxdoor/preload.py) ----------------------------
    def preload_job(self, job: str) -> Preloads:
        """Load the job's programs this process ran before on background
        threads, from when the devices open (never opens them itself)."""
        self.preloads = Preloads(_WorkerSource(self.client), jax_adapter.load_executable,
                                 jax_adapter.ours)
        preloads = self.preloads
        jax_adapter.when_devices_open(lambda: preloads.start(job))
        return preloads

    def preloaded(self, key: str) -> tuple[Any, int] | None:
        """The executable of `key` loaded ahead (jax_adapter's hook), or None."""
        if self.preloads is None:
            return None
        loaded = self.preloads.take(key)
        if loaded is not None:
            self.stats.hits += 1
            log.info("compilecast: %s taken preloaded", key, extra={"key": key})
        return loaded

    # -- identity and settings --------------------------------------------
    def _identity(self, program: jax_adapter.Program | None) -> Identity:
        """Who asks for `program`. Only a program whose devices span several
        processes of a jax.distributed job is asked for as the job's: its
        designated process (the owner of its lowest device id) compiles and
        the other members wait. Any other program waits for no process of the
        job: it is asked for first come, first served, as outside any job
        (it hits, or this process compiles it, or it waits only for a
        compile another holder really runs)."""
        ident = jax_adapter.process_identity()
        if ident is None or program is None or not program.shared_in_flight:
            return Identity()
        return Identity(job=self._job(), process_id=ident[0],
                        designated_process=program.designated)

    def _job(self) -> str:
        """The job's name, for its recipes and shared programs."""
        job = self.job or (f"jaxdist-{jax_adapter.coordinator_address()}"
                           if jax_adapter.process_identity() is not None else "")
        return job[:128]

    def _deadline(self) -> Deadline:
        """A wait's share-binary deadline, made where a decision begins."""
        return Deadline.after_ms(
            self.timeout_ms or jax_adapter.settings()["share_binary_between_hosts_timeout_ms"])

    # -- failure handling -------------------------------------------------
    def _fallback(self, key: str, why: str, *, compiled: bool = False) -> None:
        self.stats.fallbacks += 1
        self.stats.reasons.append(why)
        if compiled:
            log.warning("compilecast: not sharing the executable of %s: %s", key, why,
                        extra={"key": key})
        else:
            log.warning("compilecast: compiling %s locally: %s", key, why, extra={"key": key})

    def failed(self, where: str, exc: BaseException, key: str = "?", *,
               compiled: bool = False) -> None:
        """An error of compilecast's own work: raised where the user asked
        for cache errors to be (`jax_raise_persistent_cache_errors`), else a
        warning, and the program is compiled (or kept) locally."""
        if jax_adapter.raise_cache_errors():
            raise exc
        self._fallback(key, f"{where} failed: {type(exc).__name__}: {exc}", compiled=compiled)

    def _unreachable(self, key: str, exc: CompilecastError) -> None:
        self._down_until = time.monotonic() + UNREACHABLE_BACKOFF_S
        self._fallback(key, f"worker {self.target} {unreachable(exc)}; "
                            f"not asking again for {UNREACHABLE_BACKOFF_S:.0f}s")

    # -- CacheInterface ----------------------------------------------------
    def get(self, key: str) -> bytes | None:
        if time.monotonic() < self._down_until:
            return None
        try:
            asking = getattr(self._local, "acquiring", None)
            if asking is not None and asking[0] == key:
                return self._decide(key, asking[1])
            return self._lookup(key)
        except CorruptBlob as exc:  # (verified here, not a call's status)
            self.failed("the cache read", exc, key)
        except CompilecastError as exc:
            # (a worker restarting was asked again: compilecast/retry.py)
            if jax_adapter.raise_cache_errors():
                raise
            if isinstance(exc, Unavailable | DeadlineExceeded):
                self._unreachable(key, exc)
            else:
                self._fallback(key, f"{exc.status.name}: {exc}")
        except Exception as exc:  # never raise into JAX, unless asked to
            self.failed("the cache read", exc, key)
        return None

    def put(self, key: str, value: bytes) -> None:
        # JAX calls this on process 0 after its own thresholds passed.
        self._settle_publish(key, value)

    # -- decisions --------------------------------------------------------
    def _lookup(self, key: str) -> bytes | None:
        try:
            _, data = self.client.fetch(key)
        except NotFound:
            return None
        return data

    def _decide(self, key: str, program: jax_adapter.Program | None) -> bytes | None:
        with tracing.span("compilecast.decide", key=key):
            return self._decide_traced(key, program)

    def _decide_traced(self, key: str, program: jax_adapter.Program | None) -> bytes | None:
        with self._lock:
            name, components, key_s, inputs = self._described.pop(key, ("", {}, 0.0, ()))
        if program is not None and program.host_callbacks:
            # Never shared (JAX bakes the callbacks into the executable): no ask, no wait.
            self._compile_locally(key, "the program uses host callbacks",
                                  pb.LOCAL_CAUSE_BELOW_THRESHOLD)
            return None
        ident = self._identity(program)
        request = policy.acquire_request(key, ident, components=components, program_name=name,
                                         key_seconds=key_s)
        decided = policy.drive(policy.decide(request, ident, self._deadline()),
                               self._shell)
        if decided.waited:
            self.stats.waits += 1
        if decided.kind == "HIT":
            self.stats.hits += 1
            return decided.data
        if decided.kind == "COMPILE":
            assert decided.lease is not None
            if decided.promoted:
                self.stats.promotions += 1
            self._hold(key, decided.lease, ident, inputs)
            return None
        self._compile_locally(key, decided.reason, decided.cause)
        return None

    def _compile_locally(self, key: str, reason: str, cause: int) -> None:
        self.stats.local_compiles += 1
        self.stats.reasons.append(reason)
        # An entry under JAX's caching thresholds is compiled locally by design
        # (a job has many such small programs): not a warning.
        level = logging.INFO if cause == pb.LOCAL_CAUSE_BELOW_THRESHOLD else logging.WARNING
        log.log(level, "compilecast: compiling %s locally: %s", key, reason, extra={"key": key})

    def _hold(self, key: str, lease: pb.Lease, identity: Identity, inputs: tuple = ()) -> None:
        with self._lock:
            self._held[key] = _Held(lease, time.monotonic(), identity, inputs,
                                    dict(tracing.inject({})))
        self.client.keep_lease(key, lease)
        self.stats.compiles += 1

    def _take(self, key: str) -> _Held | None:
        with self._lock:
            held = self._held.pop(key, None)
        if held is not None:
            self.client.stop_lease(key, held.lease)
        return held

    # -- settling a lease ---------------------------------------------------
    def _settle_publish(self, key: str, value: bytes) -> None:
        held = self._take(key)
        if held is None:
            return  # compiled without the lease: nothing to share
        try:
            settled = policy.drive(policy.settle(policy.Publish(
                key, held.lease, value, time.monotonic() - held.started, held.identity,
                self._recipe(key, held)), trace=held.trace), self._shell)
        except Exception as exc:  # the executable is compiled: the user's program goes on
            self._release(key, held, pb.ABANDONED, f"{type(exc).__name__}: {exc}")
            self.failed("the publish", exc, key, compiled=True)
            return
        if settled.published:
            self.stats.published += 1
            return
        self._fallback(key, f"publish failed: {settled.problem}", compiled=True)
        if settled.released:
            with self._lock:
                self.stats.released += 1

    def _recipe(self, key: str, held: _Held) -> pb.Recipe | None:
        """How to compile the program again (for replays onto other targets)."""
        if not held.inputs:
            return None
        try:
            from .aot import fill_recipe

            recipe = fill_recipe(pb.Recipe(key=key, job=self._job()), *held.inputs)
        except Exception as exc:  # the artifact matters more than its recipe
            log.info("compilecast: no recipe for %s: %s: %s", key, type(exc).__name__, exc)
            return None
        return recipe if recipe.program else None

    def _release(self, key: str, held: _Held, reason: pb.ReleaseReason.ValueType, detail: str) -> None:
        try:
            with tracing.resumed(held.trace):  # in the trace of the decision that granted it
                self.client.release(key, held.lease, reason, detail)
            with self._lock:
                self.stats.released += 1
        except Exception as exc:  # (a release runs after the compile: never raise)
            why = exc.status.name if isinstance(exc, CompilecastError) else type(exc).__name__
            log.warning("compilecast: release of %s failed (%s); the lease lapses in %ss",
                        key, why, held.lease.ttl_seconds)

    # -- FDO / PGLE profiles --------------------------------------------------
    def share_profile(self, key: str, profile: bytes, designated: int) -> bytes | None:
        """The profile every process of the program compiles with: the first
        one stored under `key` (a restarted job finds the stored one), else
        the one of `designated`, the process that compiles the program. None:
        use JAX's own exchange."""
        if time.monotonic() < self._down_until:
            return None
        ident = jax_adapter.process_identity()
        me = Identity(job=self._job(), process_id=ident[0], designated_process=designated) \
            if ident is not None else Identity()
        try:
            with self._lock:
                if key in self._profiles:
                    return self._profiles[key]
            resp = self.client.acquire(key, program_name="fdo_profile", identity=me)
            decision, artifact, lease = resp.decision, resp.artifact, resp.lease
            if decision == pb.WAIT:
                event = self.client.wait(key, self._deadline(), identity=me)
                decision, artifact, lease = event.decision, event.artifact, event.lease
            if decision == pb.HIT:
                _, got = self.client.fetch(key, artifact.digest)  # verified
                self.stats.profiles_received += 1
            elif decision == pb.COMPILE and (ident is None or ident[0] == designated):
                self.client.publish(key, lease, profile, 0.0, identity=me)
                self.stats.profiles_published += 1
                got = profile
            else:
                if decision == pb.COMPILE:
                    # Promoted: the designated process never came through
                    # compilecast. Only its profile may be used (JAX's rule:
                    # different profiles, different executables), so this
                    # process takes it from JAX's exchange, as JAX would.
                    self.client.release(key, lease, pb.ABANDONED, "not the profile's writer")
                self._fallback(key, f"profile not shared through compilecast "
                                    f"({pb.Decision.Name(decision)}); using JAX's exchange")
                return None
        except CompilecastError as exc:
            self._fallback(key, f"profile exchange failed ({exc.status.name}); using JAX's")
            return None
        except Exception as exc:  # never raise into JAX, unless asked to
            self.failed("the profile exchange", exc, key)
            return None
        with self._lock:
            self._profiles[key] = got
        log.info("compilecast: FDO profile %s %s (%d bytes)", key,
                 "published" if got is profile else "received", len(got), extra={"key": key})
        return got

    # -- hooks called by jax_adapter ---------------------------------------
    def cache_key(self, module: Any, devices: Any, compile_options: Any,
                  backend: Any) -> str | None:
        """compilecast's canonical key (None: skip the cache, compile locally)."""
        start = time.monotonic()
        try:
            key = keys.jax_key(module, devices, compile_options, backend, self.key_config)
        except Exception as exc:  # never raise into JAX, unless asked to
            self.failed("the cache key", exc)
            return None
        name = str(jax_adapter.ir.StringAttr(module.operation.attributes["sym_name"]).value) \
            if "sym_name" in module.operation.attributes else ""
        with self._lock:
            if len(self._described) >= MAX_DESCRIBED:  # keys only ever looked up
                self._described.pop(next(iter(self._described)))
            self._described[key.value] = (name[:200], key.components, time.monotonic() - start,
                                          (module, devices, compile_options, backend,
                                           key.program_bytes))
        log.debug("compilecast key %s of %s components %s", key.value, name, key.components,
                  extra={"key": key.value})
        return key.value

    def autotune_dir(self, namespace: dict[str, str]) -> str:
        """The host's synced directory of XLA's GPU autotune results for
        `namespace` (worker/daemon/dirsync.py), opened once per process: the first
        time, the entries other hosts published are installed before the
        compile ("" : none, the worker could not be asked)."""
        ident = tuple(sorted(namespace.items()))
        with self._lock:
            if ident in self._autotune_dirs:
                return self._autotune_dirs[ident]
            self._autotune_dirs[ident] = ""  # asked once, whatever the answer
        d = self.client.open_directory(AUTOTUNE_KIND, namespace)
        try:
            d = self.client.sync_directory(AUTOTUNE_KIND, d.namespace_id,
                                           timeout_s=AUTOTUNE_SYNC_S).directory
        except CompilecastError as exc:  # the entries come with the worker's next pass
            log.info("compilecast: autotune entries not installed before this compile: %s",
                     unreachable(exc))
        log.info("compilecast: XLA autotune results in %s (%d entries)", d.path, d.entries)
        with self._lock:
            self._autotune_dirs[ident] = d.path
        return d.path

    @contextlib.contextmanager
    def acquiring(self, key: str,
                  program: jax_adapter.Program | None = None) -> Iterator[None]:
        self._local.acquiring = (key, program)
        try:
            yield
        finally:
            self._local.acquiring = None

    def compile(self, key: str, module_name: str, has_host_callbacks: bool,
                run: Callable[[], Any], serialize: Callable[[Any, float], bytes]) -> Any:
        start = time.monotonic()
        try:
            executable = run()
        except BaseException as exc:
            held = self._take(key)
            if held is not None:
                self._release(key, held, pb.COMPILE_FAILED, f"{type(exc).__name__}: {exc}")
            raise
        with self._lock:
            still_held = key in self._held
        if still_held:  # JAX did not call put: not process 0, or under a threshold
            try:
                self._settle_after_compile(key, module_name, has_host_callbacks, executable,
                                           time.monotonic() - start, serialize)
            except Exception as exc:  # the executable is the user's, whatever happened here
                held = self._take(key)
                if held is not None:
                    self._release(key, held, pb.ABANDONED, f"{type(exc).__name__}: {exc}")
                self.failed("settling the compile lease", exc, key, compiled=True)
        return executable

    def _settle_after_compile(self, key: str, module_name: str, has_host_callbacks: bool,
                              executable: Any, compile_time_s: float,
                              serialize: Callable[[Any, float], bytes]) -> None:
        limits = jax_adapter.settings()
        why = None
        if has_host_callbacks:
            why = "the program uses host callbacks"
        elif compile_time_s < limits["min_compile_time_s"]:
            why = (f"compile took {compile_time_s:.2f}s < "
                   f"min_compile_time {limits['min_compile_time_s']}s")
        value = None
        if why is None:
            try:
                value = serialize(executable, compile_time_s)
            except Exception as exc:
                why = f"cannot serialize the executable: {exc}"
        if value is not None and len(value) < limits["min_entry_size_bytes"]:
            why = f"entry of {len(value)} bytes < min_entry_size {limits['min_entry_size_bytes']}"
        if why is None and value is not None:
            self._settle_publish(key, value)
            return
        held = self._take(key)
        if held is not None:
            log.info("compilecast: not caching %s (%s)", module_name, why)
            self._releases.submit(functools.partial(self._release, key, held,
                                                    pb.BELOW_THRESHOLD, why or ""))


class _WorkerSource:
    """A process's preloads from its worker: the job's recipes, and each
    artifact's bytes (verified against its digest, as any read)."""

    def __init__(self, client: CacheClient) -> None:
        self.client = client

    def recipes(self, job: str) -> list[pb.Recipe]:
        return self.client.list_recipes(job)

    def fetch(self, key: str) -> bytes:
        return self.client.fetch(key)[1]


def preload_wanted() -> bool:
    return os.environ.get(PRELOAD_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


active_cache: CompilecastCache | None = None


def enable(target: str | None = None, *, timeout_ms: int | None = None,
           job: str | None = None) -> CompilecastCache | None:
    """Route JAX's persistent compilation cache through the compilecast worker.

    `target` defaults to $COMPILECAST_WORKER, else the socket `compilecast up`
    serves. Returns None (and warns) if this JAX release cannot be hooked;
    JAX then compiles as usual.
    """
    global active_cache
    target = target or os.environ.get("COMPILECAST_WORKER") or default_worker_target()
    job = job or os.environ.get("COMPILECAST_JOB") or None
    try:
        if timeout_ms is None and os.environ.get(
                "COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS"):
            timeout_ms = int(os.environ["COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS"])
        if not tracing.on():  # (COMPILECAST_OTLP_ENDPOINT: off when unset)
            tracing.configure(os.environ.get(tracing.ENV, ""), "compilecast-jax")
        cache = CompilecastCache(target, timeout_ms=timeout_ms, job=job)
        jax_adapter.install(cache, cache)
        if job and preload_wanted():
            try:
                cache.preload_job(job[:128])
            except Exception as exc:  # (a JAX whose backends moved): no preload, nothing else
                log.warning("compilecast: no preload: %s: %s", type(exc).__name__, exc)
        try:
            keys.prepare()  # the first key's once-per-process work, off the compile's path
        except Exception as exc:  # the first key tries again (and falls back) itself
            log.warning("compilecast: could not prepare keys at start: %s", exc)
    except (jax_adapter.AdapterError, ValueError, CompilecastError) as exc:  # bad configuration
        log.warning("compilecast disabled: %s", exc)
        return None
    active_cache = cache
    log.info("compilecast enabled (worker %s)", target)
    return cache


def disable() -> None:
    global active_cache
    jax_adapter.uninstall()
    if active_cache is not None:
        active_cache._releases.flush()
        active_cache.client.close()
    active_cache = None


def stats() -> dict[str, Any]:
    """This process's counts, with the releases still queued sent first
    (waiting for them at most RELEASE_FLUSH_S)."""
    if active_cache is None:
        return {}
    active_cache._releases.flush()
    if active_cache.preloads is not None:
        active_cache.stats.preloads = dict(active_cache.preloads.stats.__dict__)
    return active_cache.stats.as_dict()


@atexit.register
def _flush_at_exit() -> None:
    if active_cache is not None:
        active_cache._releases.flush()
