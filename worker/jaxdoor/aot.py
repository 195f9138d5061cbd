"""Ahead-of-time compiles: `compilecast precompile`, the compile farm, pod checks.

A program is compiled here for a *target* (a platform plus, for TPUs, a
compile-only topology such as v5e:2x2, on whatever jaxlib/libtpu this process
runs) and published under the key the target's own processes will compute,
so that their first step is a hit.

The key is computed by the same code as in a user's process: JAX's compile
path runs with compilecast's hooks installed (jax_adapter), and the hook
computes keys.jax_key from exactly what JAX hands it. Here the hooks first
*probe* (compute the key, then stop JAX before it compiles), ask the
coordinator, and only compile when they get the lease. Publishing follows
the host protocol: lease, keepalive, fenced write-once publish, release on
failure. Every artifact is published with its recipe.

Programs come from a user entry point (`package.module:function`, called
with the target's devices, returning (jitted_function, abstract_args) pairs,
optionally with a kwargs dict as third element) or from recorded recipes
(replay).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from compilecast.errors import AlreadyPublished, CompilecastError, LeaseError, NotFound
from compilecast.grpcutil import rpc_problem
from compilecast.v1 import cache_pb2 as pb

from ..inprocess.client import CacheClient
from ..keylib import keys
from ..xla import jax_adapter
from . import tputopology

log = logging.getLogger("compilecast.aot")


class AotError(RuntimeError):
    """A program cannot be compiled ahead of time (bad entry point, target, recipe)."""


# -- the hooks: probe a key, or compile and capture the entry -----------------

class _Probed(Exception):
    pass


class _Box(threading.local):
    mode: str = ""
    key: keys.Key | None = None
    inputs: tuple | None = None
    data: bytes | None = None
    seconds: float = 0.0


class _AotHooks:
    def __init__(self) -> None:
        self.box = _Box()
        self.key_config = keys.KeyConfig.from_env()

    def cache_key(self, module: Any, devices: Any, compile_options: Any, backend: Any) -> str:
        key = keys.jax_key(module, devices, compile_options, backend, self.key_config)
        self.box.key = key
        self.box.inputs = (module, devices, compile_options, backend)
        if self.box.mode == "probe":
            raise _Probed()
        return key.value

    def acquiring(self, key: str,
                  program: jax_adapter.Program | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def failed(self, where: str, exc: BaseException) -> None:
        raise exc  # ahead of time, a failure is the command's to report

    def compile(self, key: str, module_name: str, has_host_callbacks: bool,
                run: Callable[[], Any], serialize: Callable[[Any, float], bytes]) -> Any:
        start = time.monotonic()
        self.box.data = None
        executable = run()  # JAX's compile, and its write of the entry (_NoCache.put)
        self.box.seconds = time.monotonic() - start
        if self.box.data is None:
            # JAX wrote no entry (not process 0, a compile under its time
            # threshold, host callbacks): serialize it here. Otherwise that
            # entry is the one: serializing again would cost as much again
            # (~0.8 s of the GIL for a 187 MB TPU executable).
            self.box.data = serialize(executable, self.box.seconds)
        return executable


class _NoCache(jax_adapter.CacheInterface):
    """JAX's cache while compiling ahead of time: always a miss. What JAX
    writes while compile_entry compiles is the entry it returns."""

    def __init__(self, box: _Box) -> None:
        self.box = box

    def get(self, key: str) -> bytes | None:
        return None

    def put(self, key: str, value: bytes) -> None:
        box = self.box
        if box.mode == "compile" and box.key is not None and box.key.value == key:
            box.data = value


_hooks: _AotHooks | None = None
_install_lock = threading.Lock()


def _installed() -> _AotHooks:
    global _hooks
    with _install_lock:
        if _hooks is None:
            hooks = _AotHooks()
            jax_adapter.install(_NoCache(hooks.box), hooks)
            _hooks = hooks
        return _hooks


def prepare() -> None:
    """What `compilecast.enable()` does before a process's first compile:
    JAX's hooks installed and the key path settled (keys.prepare), so that
    the first probe costs what a later one does."""
    _installed()
    keys.prepare()


@dataclass
class Probe:
    key: keys.Key
    module: Any
    devices: Any
    compile_options: Any
    backend: Any


def probe(trigger: Callable[[], Any]) -> Probe:
    """The key JAX's compile path computes for a program, without compiling it."""
    hooks = _installed()
    for attempt in range(2):
        hooks.box.mode, hooks.box.key = "probe", None
        try:
            trigger()
        except _Probed:
            break
        finally:
            hooks.box.mode = ""
        if attempt == 0:  # answered from JAX's in-memory cache: forget it, ask again
            import jax

            jax.clear_caches()
    if hooks.box.key is None:
        raise AotError("JAX compiled without consulting its persistent cache "
                       "(is the compilation cache disabled for this platform?)")
    assert hooks.box.inputs is not None  # (set with the key)
    return Probe(hooks.box.key, *hooks.box.inputs)


def compile_entry(trigger: Callable[[], Any]) -> tuple[str, bytes, float]:
    """Compile through JAX; returns (key, the entry in JAX's cache format, seconds)."""
    hooks = _installed()
    hooks.box.mode, hooks.box.data, hooks.box.key = "compile", None, None
    try:
        trigger()
    finally:
        hooks.box.mode = ""
    if hooks.box.data is None or hooks.box.key is None:
        raise AotError("JAX did not compile the program through the cache path")
    return hooks.box.key.value, hooks.box.data, hooks.box.seconds


# -- targets and programs -------------------------------------------------------

def parse_target(spec: str, platform: str = "tpu") -> pb.Target:
    """A compile-only topology of `platform` (for TPUs as users name them:
    v5litepod-16, v5e:4x4,num_slices=2; worker/jaxdoor/tputopology.py) or
    'local'. Raises AotError (one line) for a TPU topology nobody makes."""
    if spec in ("", "local"):
        import jax

        return pb.Target(platform=platform if platform != "tpu" else jax.default_backend())
    if platform == "tpu":
        try:
            spec = tputopology.resolve(spec).spec()
        except tputopology.TopologyError as exc:
            raise AotError(str(exc)) from None
    return pb.Target(platform=platform, topology=spec)


def describe_target(t: pb.Target) -> str:
    return f"{t.platform}:{t.topology or 'local'}"


def target_devices(target: pb.Target) -> list[Any]:
    import jax

    if target.topology:
        from jax.experimental import topologies

        # A compile-only client never owns the accelerator: let it load
        # libtpu next to other processes (libtpu's lockfile otherwise refuses).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

        name, kwargs, names = target.topology, {}, ""
        if target.platform == "tpu":
            try:
                tpu = tputopology.resolve(target.topology)
            except tputopology.TopologyError as exc:
                raise AotError(str(exc)) from None
            name, kwargs, names = tpu.name, tpu.kwargs(), f"; {tputopology.NAMES_HELP}"
        try:
            topo = topologies.get_topology_desc(topology_name=name, platform=target.platform,
                                                **kwargs)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise AotError(f"cannot make a compile-only {target.platform} topology "
                           f"{target.topology!r}: {first} (for TPUs: pip install libtpu)"
                           f"{names}") from None
        return list(topo.devices)
    return list(jax.devices(target.platform))


@dataclass
class Program:
    name: str
    trigger: Callable[[], Any]  # runs JAX's compile path for the target
    recipe: pb.Recipe  # entry or program, target, job; completed after the probe


def load_entry(spec: str) -> Callable[..., Any]:
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise AotError(f"entry point {spec!r} must look like package.module:function")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise AotError(f"cannot load entry point {spec}: {exc}") from exc
    if not callable(fn):
        raise AotError(f"entry point {spec} is not callable")
    return fn


def entry_programs(entry: str, target: pb.Target, job: str = "") -> list[Program]:
    """Lower every program an entry point returns for the target's devices."""
    fn = load_entry(entry)
    devices = target_devices(target)
    items = fn(devices)
    if isinstance(items, dict):
        items = list(items.values())
    programs = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) not in (2, 3):
            raise AotError(f"{entry} item {i}: expected (jitted_function, args[, kwargs])")
        jitted, args, kwargs = item[0], tuple(item[1]), dict(item[2]) if len(item) == 3 else {}
        traced = jitted.trace(*args, **kwargs)
        lowered = (traced.lower(lowering_platforms=(target.platform,)) if target.topology
                   else traced.lower())
        name = getattr(jitted, "__name__", f"program{i}")
        recipe = pb.Recipe(entry=entry, entry_index=i, job=job, target=target,
                           program_name=f"jit_{name}"[:200])
        programs.append(Program(name, lowered.compile, recipe))
    if not programs:
        raise AotError(f"entry point {entry} returned no programs")
    return programs


_entry_cache: dict[tuple[str, bytes, str], list[Program]] = {}
_entry_lock = threading.Lock()


def recipe_program(recipe: pb.Recipe) -> Program:
    """The program a recipe describes, for the recipe's target."""
    if recipe.entry:
        ident = (recipe.entry, recipe.target.SerializeToString(), recipe.job)
        with _entry_lock:
            if ident not in _entry_cache:
                _entry_cache[ident] = entry_programs(recipe.entry, recipe.target, recipe.job)
            programs = _entry_cache[ident]
        if recipe.entry_index >= len(programs):
            raise AotError(f"{recipe.entry} returns {len(programs)} programs, not "
                           f"{recipe.entry_index + 1}")
        return programs[recipe.entry_index]
    devices = target_devices(recipe.target)
    by_id = {int(d.id): d for d in devices}
    missing: list[int | str] = [i for i in recipe.device_ids if i not in by_id]
    if recipe.slice_devices and recipe.slice_devices != len(devices):
        missing = missing or [f"a slice of {recipe.slice_devices} devices, not {len(devices)}"]
    if missing or not recipe.device_ids:
        raise AotError(
            f"the recorded program of {recipe.program_name or recipe.key} is lowered for devices "
            f"{list(recipe.device_ids)[:8]}; target {describe_target(recipe.target)} lacks "
            f"{missing[:8] or 'them'}. A lowered program cannot be retargeted to another "
            "slice; record it with an entry point (compilecast precompile --entry)")
    chosen = [by_id[i] for i in recipe.device_ids]
    shape = tuple(recipe.device_shape) or (len(chosen),)
    out = pb.Recipe()
    out.CopyFrom(recipe)
    return Program(recipe.program_name or "program",
                   lambda: jax_adapter.compile_program(recipe.program, recipe.compile_options,
                                                       chosen, shape), out)


def complete_recipe(recipe: pb.Recipe, p: Probe) -> pb.Recipe:
    """Fill in what only JAX's compile path knows: the lowered program and its
    compile inputs, the versions of the compiler."""
    out = pb.Recipe()
    out.CopyFrom(recipe)
    fill_recipe(out, p.module, p.devices, p.compile_options, p.backend, p.key.program_bytes)
    out.key = p.key.value
    return out


def program_name(recipe: pb.Recipe, module: Any) -> str:
    """The recipe's program name, else the module's (JAX's jit_<function>)."""
    if recipe.program_name or "sym_name" not in module.operation.attributes:
        return recipe.program_name
    return str(jax_adapter.ir.StringAttr(module.operation.attributes["sym_name"]).value)[:200]


def _too_big_for_a_recipe(program_bytes: int) -> bool:
    """Whether a program whose canonical stream is this big has MLIR
    bytecode over the recipe limit (the stream is at most 1.21x the
    bytecode; the margin here is 2x). Such a program is not serialized
    just to be dropped: 2 GB of constants would cost its process 4 GB (the
    bytecode and the recipe's copy) and seconds, right after its compile,
    before its publish."""
    from compilecast import validate

    return program_bytes > 2 * validate.MAX_RECIPE_BYTES


def fill_recipe(out: pb.Recipe, module: Any, devices: Any, compile_options: Any,
                backend: Any, program_bytes: int = 0) -> pb.Recipe:
    """`out` filled from JAX's compile inputs. program_bytes: the key's
    Key.program_bytes (0: unknown; the program is serialized and measured)."""
    from compilecast import validate

    out.program_name = program_name(out, module)
    out.program = (b"" if _too_big_for_a_recipe(program_bytes)
                   else jax_adapter.module_bytecode(module))
    out.compile_options = jax_adapter.compile_options_proto(compile_options)
    del out.device_ids[:], out.device_shape[:], out.xla_flags[:]
    out.device_ids.extend(int(d.id) for d in devices.flat)
    out.device_shape.extend(int(n) for n in devices.shape)
    out.xla_flags.extend(keys.xla_flags())
    out.slice_devices = int(backend.device_count())
    out.target.platform = str(backend.platform)
    out.target.platform_version = str(backend.platform_version)[:500]
    out.target.jaxlib_version = jax_adapter.jaxlib_version()
    out.target.libtpu_version = jax_adapter.libtpu_version() if out.target.platform == "tpu" else ""
    out.created_unix = time.time()
    if out.ByteSize() > validate.MAX_RECIPE_BYTES:
        out.program = b""  # still replayable from its entry point, if it has one
    return out


# -- compile and share ----------------------------------------------------------

@dataclass
class Outcome:
    name: str
    key: str
    status: str  # "published", "cached", "published-by-another"
    seconds: float = 0.0
    size: int = 0
    data: bytes | None = field(default=None, repr=False)  # fetched and verified, on request


def compile_and_share(client: CacheClient, program: Program, *,
                      wait_timeout_s: float = 1200.0, fetch: bool = False) -> Outcome:
    """Make sure the program's executable is published under its key. With
    `fetch`, a process that did not compile it also fetches and verifies it
    (as a host that loads it would; `Outcome.data`), a waiter as soon as the
    holder starts to publish."""
    p = probe(program.trigger)
    key = p.key.value
    # The recipe (the whole program serialized) is only needed to publish: a
    # process that finds the executable, or waits for it, never builds one.
    ask: dict[str, Any] = {"components": p.key.components,
                           "program_name": program_name(program.recipe, p.module)}
    resp = client.acquire(key, **ask)
    if resp.decision == pb.HIT:
        data = client.fetch(key, resp.artifact.digest)[1] if fetch else None
        return Outcome(program.name, key, "cached", size=resp.artifact.size, data=data)
    lease = _lease_or_outcome(client, program, key, resp, wait_timeout_s, fetch)
    if isinstance(lease, Outcome):
        return lease
    client.keep_lease(key, lease)
    try:
        recipe = complete_recipe(program.recipe, p)
        got, data, seconds = compile_entry(program.trigger)
        if got != key:
            raise AotError(f"{program.name}: the compile computed key {got}, the probe {key}")
        for _ in range(3):
            try:
                client.publish(key, lease, data, seconds, recipe=recipe)
                break
            except (LeaseError, AlreadyPublished) as exc:
                # The lease lapsed while this process compiled (three renewals
                # missed: a host starved of CPU): ask again rather than throw
                # the executable away. Another holder may have published it
                # (ALREADY_EXISTS), or be compiling it; or the key is free and
                # this one publishes.
                log.warning("%s: %s; asking for %s again", program.name, exc, key)
                client.stop_lease(key, lease)
                again = _ask_again(client, program, key, ask, wait_timeout_s, seconds)
                if isinstance(again, Outcome):
                    again.data = data if fetch else None  # the same program, compiled here
                    return again
                lease = again
                client.keep_lease(key, lease)
        else:
            raise AotError(f"{program.name}: the compile lease for {key} lapsed three times "
                           "before the executable could be published")
    except BaseException as exc:
        client.stop_lease(key, lease)
        with contextlib.suppress(CompilecastError):
            client.release(key, lease, pb.COMPILE_FAILED, f"{type(exc).__name__}: {exc}")
        raise
    client.stop_lease(key, lease)
    log.info("published %s (%s) in %.1fs, %d bytes", program.name, key, seconds, len(data))
    return Outcome(program.name, key, "published", seconds, len(data))


def _ask_again(client: CacheClient, program: Program, key: str, ask: dict,
               wait_timeout_s: float, seconds: float) -> pb.Lease | Outcome:
    """After a lease lapsed: the lease to publish under now, or the outcome
    of another holder's publish (already done, or waited for)."""
    resp = client.acquire(key, **ask)
    if resp.decision == pb.HIT:
        return Outcome(program.name, key, "published-by-another", seconds, resp.artifact.size)
    return _lease_or_outcome(client, program, key, resp, wait_timeout_s, False)


def _lease_or_outcome(client: CacheClient, program: Program, key: str,
                      resp: pb.AcquireResponse, wait_timeout_s: float,
                      fetch: bool) -> pb.Lease | Outcome:
    """What an Acquire that did not HIT leads to: the lease to compile under
    (told COMPILE, at once or after waiting), or the outcome of waiting for
    another holder's publish."""
    if resp.decision == pb.COMPILE:
        return resp.lease
    if resp.decision != pb.WAIT:
        raise AotError(f"{program.name}: the coordinator cannot share {key} now "
                       f"({pb.Decision.Name(resp.decision)}: {resp.reason})")
    if fetch:
        event, data = client.wait_and_fetch(key, wait_timeout_s)
    else:
        event, data = client.wait(key, wait_timeout_s), None
    if event.decision == pb.HIT:
        return Outcome(program.name, key, "published-by-another", size=event.artifact.size,
                       data=data)
    if event.decision != pb.COMPILE:
        raise AotError(f"{program.name}: waited for {key}, then told "
                       f"{pb.Decision.Name(event.decision)}: {event.reason}")
    return event.lease


@dataclass
class Presence:
    name: str
    key: str
    present: bool
    size: int = 0
    seconds: float = 0.0


def check(client: CacheClient, programs: list[Program], *, fetch: bool = True) -> list[Presence]:
    """What a target process will find: each program's key and whether its
    artifact is stored (fetched and digest-verified when `fetch`)."""
    out = []
    for prog in programs:
        start = time.monotonic()
        key = probe(prog.trigger).key.value
        try:
            info = client.fetch(key)[0] if fetch else client.describe(key).artifact
        except NotFound:
            info = pb.ArtifactInfo()
        out.append(Presence(prog.name, key, bool(info.digest), info.size,
                            time.monotonic() - start))
    return out


# -- the farm -------------------------------------------------------------------

def default_concurrency() -> int:
    """One compile per core, at most one per 4 GiB of memory."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):
        mem_gib = 4.0
    return max(1, min(cores or 1, int(mem_gib // 4)))


class FarmWorker:
    """Takes compile tasks from the coordinator's queue and runs them."""

    def __init__(self, client: CacheClient, name: str, concurrency: int, *,
                 claim_wait_ms: int = 5000, heartbeat_file: str = "") -> None:
        self.client = client
        self.heartbeat_file = heartbeat_file
        self.name = name
        self.concurrency = max(1, concurrency)
        self.claim_wait_ms = claim_wait_ms
        self.done = 0
        self.failed = 0
        self._slots = threading.Semaphore(self.concurrency)
        self._threads: list[threading.Thread] = []

    def run(self, stop: threading.Event, max_tasks: int | None = None) -> None:
        taken = 0
        while not stop.is_set() and (max_tasks is None or taken < max_tasks):
            if self.heartbeat_file:
                with contextlib.suppress(OSError), open(self.heartbeat_file, "w") as f:
                    f.write(f"{time.time():.0f}\n")
            if not self._slots.acquire(timeout=1.0):
                continue
            try:
                resp = self.client.claim(self.name, self.claim_wait_ms)
            except CompilecastError as exc:
                self._slots.release()
                log.warning("farm: cannot claim a task (coordinator %s: %s); retrying",
                            self.client.target, rpc_problem(exc))
                stop.wait(2.0)
                continue
            if not resp.task_id:
                self._slots.release()
                continue
            taken += 1
            t = threading.Thread(target=self._run_task, args=(resp,),
                                 name=f"farm-{resp.task_id}", daemon=True)
            self._threads.append(t)
            t.start()
        for t in self._threads:
            t.join()

    @contextlib.contextmanager
    def _claim_kept(self, task_id: str, claim: pb.Lease) -> Iterator[None]:
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(max(claim.ttl_seconds / 3.0, 0.5)):
                with contextlib.suppress(CompilecastError):
                    if self.client.renew(task_id, claim) <= 0:
                        log.warning("farm: the claim on task %s lapsed", task_id)
                        return

        t = threading.Thread(target=renew, daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()

    def _run_task(self, resp: pb.ClaimCompileResponse) -> None:
        recipe = resp.recipe
        what = f"{recipe.program_name or recipe.entry} for {describe_target(recipe.target)}"
        ok, detail, key = False, "", ""
        try:
            with self._claim_kept(resp.task_id, resp.claim):
                out = compile_and_share(self.client, recipe_program(recipe))
            ok, key = True, out.key
            detail = f"{out.status}" + (f" in {out.seconds:.1f}s" if out.seconds else "")
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            log.warning("farm: task %s (%s) failed: %s", resp.task_id, what, detail)
        finally:
            self._slots.release()
        try:
            self.client.finish(resp.task_id, resp.claim, ok, detail, key)
        except CompilecastError as exc:
            log.warning("farm: cannot settle task %s (%s); its claim lapses and it is retried",
                        resp.task_id, exc)
            return
        if ok:
            self.done += 1
        else:
            self.failed += 1
        log.info("farm: task %s (%s): %s", resp.task_id, what, detail)
