"""The one place compilecast touches JAX's private code.

JAX's persistent compilation cache has no public plugin hook. We use:

- `jax._src.compilation_cache._cache` (a `CacheInterface` with get/put) and
  its initialization flags, to route JAX's cache reads and writes to us;
- `jax._src.compiler.compile_or_get_cached`, wrapped to learn who compiles
  each program by JAX's own rule (`Program`: the processes its devices
  span, the one owning its lowest device id, whether it has host callbacks);
- `jax._src.compiler._cache_read`, wrapped to tell a *decision* read (the
  one before a compile: it may take a compile lease) from a mere presence
  check (`is_executable_in_cache`, used by the PGLE path);
- `jax._src.compiler._compile_and_write_cache`, wrapped so that a lease is
  always settled after the compile: published (even on processes other than
  0, where JAX never calls put), or released when the compile raised or the
  entry is under JAX's thresholds; on a GPU job of several processes the
  compile autotunes alone (`compile_alone`);
- `jax._src.compiler._share_fdo_profiles`, wrapped so that the FDO (PGLE)
  profile the program's designated process hands to the others goes through compilecast:
  one writer, the others wait for it, and it is stored, so a restarted job
  compiles with the same profile (JAX's own exchange is the fallback);
- `combine_executable_and_time` / `compress_executable`, to write entries in
  exactly JAX's own format, and their inverses with the backend's
  `deserialize_executable` to load one ahead (`load_executable`, the
  preload: worker/jaxdoor/preload.py), once `xla_bridge`'s backends are open
  (`when_devices_open`); a JAX release without them loses the preload only;
- `jax._src.compilation_cache.get_cache_key`, replaced by compilecast's
  canonical key (worker/keylib/keys.py), which is identical on every process of a
  job and ignores names and debug metadata;
- jaxlib's MLIR bindings (`jax._src.lib.mlir`) that the key library parses
  MLIR programs with (and `jax._src.lib.tpu`, Mosaic's dialect, for the
  Pallas kernels inside them), and the HLO -> StableHLO converter
  (`_jax.mlir.hlo_to_stablehlo`) that `explain` prints HLO protos with;
- for recipes and replays (worker/jaxdoor/aot.py): `mlir.module_to_bytecode`,
  `xla_client.CompileOptions` (de)serialization, `xla_client.DeviceList` and
  `compiler.compile_or_get_cached`, which compiles a recorded program through
  the same hooked path (and so under the same key) as a jitted function.

`check()` verifies every one of these exists with the expected signature and
raises AdapterError naming what moved; tests/test_jax_adapter.py calls it so a
JAX release that changes them fails loudly in CI rather than silently
disabling the cache. Mosaic's dialect is checked apart (`check_optional()`,
which the tests require too): without it only Pallas kernels' keys lose
their location-agnosticism, so install() does not need it.
"""

# pyright: reportPrivateImportUsage=false
# (The module that reaches JAX's private code, on purpose: see above.)

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
from jax._src import cache_key as _ck
from jax._src import compilation_cache as _cc
from jax._src import compiler as _compiler
from jax._src import config as _config
from jax._src import distributed as _distributed
from jax._src import xla_bridge as _xb
from jax._src.compilation_cache_interface import CacheInterface
from jax._src.interpreters import mlir as _mlir
from jax._src.lib import _jax
from jax._src.lib import version_str as _jaxlib_version
from jax._src.lib import xla_client as _xc
from jax._src.lib.mlir import ir  # also used by worker/keylib/keys.py
from jax._src.lib.mlir import passmanager as _passmanager

from .xlaflags import GPU_PLATFORMS

TESTED_JAX = ("0.10", "0.11")  # 0.11: on a GPU machine (docs/jax.md)


class AdapterError(RuntimeError):
    """JAX's private API moved; compilecast cannot hook this JAX release."""


# (module, name, its parameters: None (not checked), a tuple of names, or a
# tuple of such tuples where JAX releases differ and the hook takes either).
_EXPECTED: list[tuple[Any, str, tuple | None]] = [
    (_cc, "_cache", None),
    (_cc, "_cache_initialized", None),
    (_cc, "_cache_checked", None),
    (_cc, "_cache_used", None),
    (_cc, "_cache_initialized_mutex", None),
    (_cc, "combine_executable_and_time", ("serialized_executable", "compile_time")),
    (_cc, "compress_executable", ("executable",)),
    # JAX 0.11 names its last parameter ignore_custom_partitioning; compilecast's
    # key replaces the function whole, so either is fine.
    (_cc, "get_cache_key", (("module", "devices", "compile_options", "backend",
                             "ignore_callbacks"),
                            ("module", "devices", "compile_options", "backend",
                             "ignore_custom_partitioning"))),
    (_mlir, "make_ir_context", ()),
    (_ck, "_hash_serialized_compile_options",
     ("hash_obj", "compile_options_obj", "strip_device_assignment")),
    (_ck, "xla_flags_to_exclude_from_cache_key", None),
    (_ck, "custom_hook", ()),
    (_ck, "get_flag_prefixes", ()),
    (_jax.mlir, "hlo_to_stablehlo", None),
    (_passmanager.PassManager, "enable_verifier", None),
    (ir.SymbolTable, "replace_all_symbol_uses", None),
    # JAX 0.11 adds host_callbacks (passed through).
    (_compiler, "_cache_read",
     (("module_name", "cache_key", "compile_options", "backend", "executable_devices"),
      ("module_name", "cache_key", "compile_options", "backend", "executable_devices",
       "host_callbacks"))),
    (_compiler, "_compile_and_write_cache",
     ("backend", "computation", "executable_devices", "compile_options", "host_callbacks",
      "module_name", "cache_key")),
    (_compiler, "_share_fdo_profiles",
     ("computation", "devices", "compile_options", "backend", "global_client", "min_process_id")),
    (_compiler, "compile_or_get_cached",
     ("backend", "computation", "devices", "compile_options", "host_callbacks",
      "executable_devices", "pgle_profiler")),
    (_mlir, "module_to_bytecode", ("module",)),
    (_xc, "CompileOptions", None),
    (_xc, "DeviceList", None),
]


def check() -> None:
    problems = []
    for mod, name, params in _EXPECTED:
        if not hasattr(mod, name):
            problems.append(f"{mod.__name__}.{name} is gone")
            continue
        if params is not None:
            got = tuple(inspect.signature(getattr(mod, name)).parameters)
            accepted = params if params and isinstance(params[0], tuple) else (params,)
            if got not in accepted:
                problems.append(f"{mod.__name__}.{name}{got} != expected "
                                f"{' or '.join(map(str, accepted))}")
    for name in ("share_binary_between_hosts_timeout_ms", "persistent_cache_min_compile_time_secs",
                 "persistent_cache_min_entry_size_bytes", "share_binary_between_hosts",
                 "raise_persistent_cache_errors"):
        if not hasattr(_config, name):
            problems.append(f"jax._src.config.{name} is gone")
    if problems:
        raise AdapterError(
            f"compilecast cannot hook JAX {jax.__version__} (tested with "
            f"{', '.join(TESTED_JAX)}.x): " + "; ".join(problems)
        )


def check_optional() -> list[str]:
    """What moved among the private APIs compilecast can do without: Mosaic's
    dialect, without which Pallas kernels are keyed with their locations (a
    miss when one moves, never a wrong hit). The tests require it to name
    nothing; install() does not call it."""
    try:
        from jax._src.lib import tpu
    except ImportError:
        return ["jax._src.lib.tpu (Mosaic's dialect, for Pallas kernels) is gone"]
    if not hasattr(tpu, "register_dialect"):
        return ["jax._src.lib.tpu.register_dialect is gone"]
    return []


@dataclass(frozen=True)
class Program:
    """Who compiles a program, by JAX's rule (`compile_or_get_cached`): a
    program is shared in flight only when its devices span several processes
    and it has no host callbacks, and then the process that owns its lowest
    device id compiles. Any other program is compiled (or found) by each
    process on its own, waiting for nobody."""

    processes: frozenset[int]
    designated: int  # the process owning the program's lowest device id
    host_callbacks: bool = False

    @property
    def shared_in_flight(self) -> bool:
        return len(self.processes) > 1 and not self.host_callbacks


def program_of(devices: Any, host_callbacks: Any = ()) -> Program:
    """The Program of a compile over `devices` (any iterable of JAX devices,
    or an array of them)."""
    flat = list(getattr(devices, "flat", devices))
    lowest = min(flat, key=lambda d: d.id)
    return Program(frozenset(int(d.process_index) for d in flat), int(lowest.process_index),
                   bool(host_callbacks))


_compiling = threading.local()  # .program: the Program compile_or_get_cached is deciding


def current_program() -> Program | None:
    """The program this thread's compile_or_get_cached is deciding, if known."""
    return getattr(_compiling, "program", None)


class Hooks(Protocol):
    def cache_key(self, module: Any, devices: Any, compile_options: Any,
                  backend: Any) -> str | None:
        """The program's key; None: JAX's cache is skipped (it compiles locally)."""

    def acquiring(self, key: str,
                  program: Program | None) -> contextlib.AbstractContextManager[None]: ...

    def compile(self, key: str, module_name: str, has_host_callbacks: bool,
                run: Callable[[], Any], serialize: Callable[[Any, float], bytes]) -> Any: ...

    # Optional: share_profile(profile_key, profile, designated) -> bytes | None
    # (None: use JAX's own exchange).
    # Optional: autotune_dir(namespace) -> str: the host's directory of XLA's
    # GPU autotune results for that namespace ("" : none).

    def failed(self, where: str, exc: BaseException) -> None:
        """An error in a hook's own work (never the user's compile): logged
        as a warning, or raised where the user asked for cache errors to be
        (`jax_raise_persistent_cache_errors`)."""


# XLA's GPU compiler shards autotuning across a job's processes and joins the
# results over the job's key-value store (`xla_gpu_shard_autotuning`, on by
# default): each process's compile then waits until every other process
# compiles the same program. Under compilecast one process compiles while the
# others wait for its executable, so it would wait for them until their
# share-binary timeout (seen on a 2-process GPU job: the holder's compile ended
# 23 s after it began, 3 s after the waiter's 20 s timeout made the waiter
# compile too). A process that compiles through compilecast autotunes alone.
SHARD_AUTOTUNING = "xla_gpu_shard_autotuning"


def compile_alone(backend: Any, compile_options: Any) -> Any:
    """`compile_options` for a compile that waits for no other process: a
    copy without sharded autotuning for a GPU job of several processes, else
    the options themselves."""
    if getattr(backend, "platform", "") not in GPU_PLATFORMS or jax.process_count() < 2:
        return compile_options
    overrides = list(compile_options.env_option_overrides)
    if any(name == SHARD_AUTOTUNING for name, _ in overrides):
        return compile_options
    opts = copy.deepcopy(compile_options)
    opts.env_option_overrides = [*overrides, (SHARD_AUTOTUNING, False)]
    return opts


AUTOTUNE_DIR_OPTION = "xla_gpu_per_fusion_autotune_cache_dir"


def autotune_cache_on() -> bool:
    """Whether JAX's settings ask for XLA's per-fusion autotune cache
    (`jax_persistent_cache_enable_xla_caches`, on by default)."""
    flags = _config.persistent_cache_enable_xla_caches.value or ""
    return flags == "all" or AUTOTUNE_DIR_OPTION in flags


def with_autotune_dir(compile_options: Any, directory: str) -> Any:
    """A copy of `compile_options` that reads and writes XLA's GPU autotune
    results in `directory`, or the options themselves where JAX already gave
    the compile a directory of its own (the user's compilation cache)."""
    debug = compile_options.executable_build_options.debug_options
    if not directory or getattr(debug, AUTOTUNE_DIR_OPTION):
        return compile_options
    opts = copy.deepcopy(compile_options)
    debug = opts.executable_build_options.debug_options
    setattr(debug, AUTOTUNE_DIR_OPTION, directory)
    # Every process that compiles writes what it measured: the files are
    # write-once and XLA renames each into place.
    debug.xla_gpu_experimental_autotune_cache_mode = _xc.AutotuneCacheMode.UPDATE
    return opts


def autotune_namespace(backend: Any, device: Any) -> dict[str, str]:
    """What XLA's autotune results are valid for: the GPU model and its
    compute capability, the CUDA or ROCm runtime and driver, jaxlib (XLA)."""
    ns = {"platform": str(backend.platform),
          "platform_version": str(getattr(backend, "platform_version", "")),
          "device_kind": str(getattr(device, "device_kind", "")),
          "compute_capability": str(getattr(device, "compute_capability", "")),
          "jaxlib": str(_jaxlib_version)}
    if driver := _driver_release():
        ns["driver"] = driver
    return ns


@functools.cache
def _driver_release() -> str:
    """The NVIDIA kernel driver's release line ("" : none), read once: it
    cannot change under a running process."""
    with contextlib.suppress(OSError):
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()[:200]
    return ""


def serialize(executable: Any, compile_time_s: float) -> bytes:
    """An entry in JAX's own cache format (what put_executable_and_time writes)."""
    data = _cc.combine_executable_and_time(executable.serialize(), int(compile_time_s))
    return _cc.compress_executable(data)


def settings() -> dict[str, Any]:
    return {
        "share_binary_between_hosts_timeout_ms":
            int(_config.share_binary_between_hosts_timeout_ms.value),
        "min_compile_time_s": float(_config.persistent_cache_min_compile_time_secs.value),
        "min_entry_size_bytes": int(_config.persistent_cache_min_entry_size_bytes.value),
    }


def raise_cache_errors() -> bool:
    """Whether the user asked JAX to raise its cache's errors
    (`jax_raise_persistent_cache_errors`) instead of warning."""
    return bool(_config.raise_persistent_cache_errors.value)


def process_identity() -> tuple[int, int] | None:
    """(process_id, process_count) of a jax.distributed job, else None."""
    state = _distributed.global_state
    if state.client is None:
        return None
    return int(state.process_id), int(state.num_processes)


def coordinator_address() -> str:
    return str(_distributed.global_state.coordinator_address or "")


_lock = threading.Lock()
_originals: dict[str, Any] = {}


def _profile_hook(hooks: Hooks, orig_share: Callable[..., Any]) -> Callable[..., Any]:
    """JAX's `_share_fdo_profiles`, through compilecast: the profile under
    JAX's own profile key, written by the program's designated process; JAX's
    exchange where compilecast cannot deliver it."""

    def _share_fdo_profiles(computation, devices, compile_options, backend, global_client,
                            min_process_id):
        profile = compile_options.executable_build_options.fdo_profile
        if profile is None or not len(profile):
            return orig_share(computation, devices, compile_options, backend, global_client,
                              min_process_id)
        got, key = None, None
        try:
            # Keyed as JAX keys it: the program's key without the profile + "_fdo_sync".
            opts = copy.deepcopy(compile_options)
            opts.executable_build_options.fdo_profile = b""
            key = hooks.cache_key(computation, devices, opts, backend)
            share = getattr(hooks, "share_profile", None)
            if key and share is not None:  # the program's designated process writes
                got = share(f"{key}_fdo_sync", bytes(profile), int(min_process_id))
        except Exception as exc:
            hooks.failed("the FDO profile exchange", exc)
        if got is None and not key:
            # No key to exchange under (JAX does the same when its own key
            # fails): this process compiles with its own profile.
            return profile
        if got is None:
            return orig_share(computation, devices, compile_options, backend, global_client,
                              min_process_id)
        if _distributed.global_state.process_id == min_process_id:
            # Also where JAX's own exchange looks: a process whose
            # compilecast failed falls back to it and finds this profile.
            with contextlib.suppress(Exception):
                global_client.key_value_set_bytes(f"{key}_fdo_sync", got)
        compile_options.executable_build_options.fdo_profile = b""  # as JAX's does
        return got

    return _share_fdo_profiles


def _autotune_dir(hooks: Hooks, backend: Any, devices: Any) -> str:
    """The host's synced autotune directory for a GPU compile ("" : none)."""
    find = getattr(hooks, "autotune_dir", None)
    if (find is None or getattr(backend, "platform", "") not in GPU_PLATFORMS
            or not autotune_cache_on()):
        return ""
    try:
        return find(autotune_namespace(backend, next(iter(devices)))) or ""
    except Exception as exc:  # the compile goes on without it
        hooks.failed("finding the autotune directory", exc)
        return ""


def install(cache: CacheInterface, hooks: Hooks) -> None:
    """Make `cache` JAX's persistent cache and wrap the compile path."""
    check()
    with _lock:
        if not _originals:
            _originals["_cache_read"] = _compiler._cache_read
            _originals["_compile_and_write_cache"] = _compiler._compile_and_write_cache
            _originals["share_binary"] = _config.share_binary_between_hosts.value
            _originals["get_cache_key"] = _cc.get_cache_key
            _originals["_share_fdo_profiles"] = _compiler._share_fdo_profiles
            _originals["compile_or_get_cached"] = _compiler.compile_or_get_cached
        orig_read = _originals["_cache_read"]
        orig_compile_or_get = _originals["compile_or_get_cached"]
        orig_share = _originals["_share_fdo_profiles"]
        orig_compile = _originals["_compile_and_write_cache"]

        def compile_or_get_cached(backend, computation, devices, compile_options,
                                  host_callbacks, executable_devices, pgle_profiler=None):
            before = current_program()
            try:
                program = program_of(devices, host_callbacks)
            except Exception as exc:  # unknown: the program waits for nobody
                program = None
                hooks.failed("who compiles the program", exc)
            _compiling.program = program
            try:
                return orig_compile_or_get(backend, computation, devices, compile_options,
                                           host_callbacks, executable_devices, pgle_profiler)
            finally:
                _compiling.program = before

        def _cache_read(module_name, cache_key, compile_options, backend, executable_devices,
                        *rest):  # rest: JAX 0.11's host_callbacks
            loaded = _preloaded(hooks, cache_key)
            if loaded is not None:  # loaded while the program started: no read, no load
                return loaded
            with hooks.acquiring(cache_key, current_program()):
                return orig_read(module_name, cache_key, compile_options, backend,
                                 executable_devices, *rest)

        def _compile_and_write_cache(backend, computation, executable_devices, compile_options,
                                     host_callbacks, module_name, cache_key):
            alone = with_autotune_dir(compile_alone(backend, compile_options),
                                      _autotune_dir(hooks, backend, executable_devices))
            return hooks.compile(
                cache_key, module_name, bool(host_callbacks),
                lambda: orig_compile(backend, computation, executable_devices, alone,
                                     host_callbacks, module_name, cache_key),
                serialize,
            )

        def get_cache_key(module, devices, compile_options, backend, *_ignore, **_ignore_kw):
            # (_ignore: JAX 0.10's ignore_callbacks or 0.11's ignore_custom_partitioning)
            return hooks.cache_key(module, devices, compile_options, backend)

        _share_fdo_profiles = _profile_hook(hooks, orig_share)

        # JAX's own exchange keeps its profiles on the function it calls by
        # name (`_share_fdo_profiles.modules_profiles`): the wrapper carries them.
        _share_fdo_profiles.__dict__.update(orig_share.__dict__)
        _compiler.compile_or_get_cached = compile_or_get_cached
        _compiler._cache_read = _cache_read
        _compiler._share_fdo_profiles = _share_fdo_profiles
        _cc.get_cache_key = get_cache_key
        _compiler._compile_and_write_cache = _compile_and_write_cache
        # compilecast replaces JAX's own share-binary exchange.
        jax.config.update("jax_share_binary_between_hosts", False)
        _set_cache(cache)


def _preloaded(hooks: Hooks, key: str) -> tuple[Any, int] | None:
    """The executable of `key` the hooks loaded ahead (`preloaded(key)`, an
    optional hook), or None: JAX reads its cache as always."""
    take = getattr(hooks, "preloaded", None)
    if take is None:
        return None
    try:
        return take(key)
    except Exception as exc:  # a preload never fails a compile: today's path
        hooks.failed("the preload", exc)
        return None


def load_executable(entry: bytes, compile_options: bytes, device_ids: list[int],
                    platform: str) -> tuple[Any, int]:
    """An entry of JAX's cache format loaded as JAX's own cache read loads it
    (get_executable_and_time): onto the devices `device_ids` of `platform`'s
    backend, with the serialized CompileOptionsProto the program was
    compiled with. Returns (the loaded executable, its compile time as the
    entry says); raises where a device is not this process's backend's."""
    backend = _xb.get_backend(platform)
    by_id = {int(d.id): d for d in backend.devices()}
    devices = _xc.DeviceList(tuple(by_id[i] for i in device_ids))
    options = _xc.CompileOptions.ParseFromString(compile_options)
    serialized, compile_time = _cc.extract_executable_and_time(_cc.decompress_executable(entry))
    return backend.deserialize_executable(serialized, devices, options), compile_time


def ours(device_ids: list[int], platform: str) -> bool:
    """Whether a program on `device_ids` of `platform` runs in this process
    (one of them is addressable here): its executable is loaded here."""
    backend = _xb.get_backend(platform)
    mine = {int(d.id) for d in backend.local_devices()}
    return bool(mine.intersection(device_ids))


def when_devices_open(then: Callable[[], None]) -> None:
    """Call `then` on a thread of its own once JAX's backends are open: now
    where they are, else right after the program opens them. It is never
    this call that opens them (a jax.distributed job initializes first), and
    it never polls: a thread waits for xla_bridge's lock, which the program
    holds while it opens them (COMPILECAST_ENABLE's plugin is called just
    before), and each backend JAX opens later is seen where it is made."""
    fired = threading.Event()
    original = _xb._init_backend

    def after_init() -> None:
        with _xb._backend_lock:  # (held while the program opens the backends)
            opened = bool(_xb._backends)
        with _lock:
            if not opened or fired.is_set():
                return
            fired.set()
            if _xb._init_backend is init_backend:
                _xb._init_backend = original
        then()

    def init_backend(platform):
        backend = original(platform)
        _thread(after_init)  # (waits for the rest of the program's opening)
        return backend

    with _lock:
        _xb._init_backend = init_backend
    _thread(after_init)


def _thread(target: Callable[[], None]) -> None:
    threading.Thread(target=target, name="compilecast-preload", daemon=True).start()


def uninstall() -> None:
    with _lock:
        if not _originals:
            return
        _compiler._cache_read = _originals.pop("_cache_read")
        _compiler.compile_or_get_cached = _originals.pop("compile_or_get_cached")
        _compiler._compile_and_write_cache = _originals.pop("_compile_and_write_cache")
        jax.config.update("jax_share_binary_between_hosts", _originals.pop("share_binary"))
        _cc.get_cache_key = _originals.pop("get_cache_key")
        _compiler._share_fdo_profiles = _originals.pop("_share_fdo_profiles")
        _set_cache(None)


def _set_cache(cache: CacheInterface | None) -> None:
    """Make `cache` JAX's persistent cache (None: back to uninitialized); JAX
    re-checks whether to use it on its next compile."""
    with _cc._cache_initialized_mutex:
        _cc._cache = cache
        _cc._cache_initialized = cache is not None
        _cc._cache_checked = False
        _cc._cache_used = False


# -- the key library's view of jaxlib ------------------------------------------

def mlir_context() -> Any:
    """An MLIR context with every dialect JAX lowers to registered."""
    return _mlir.make_ir_context()


# One context for parsing kernels (making one costs ~4.5 ms, more than most
# kernels' parse and walk), replaced after this many parses: a context keeps
# every attribute and type it ever uniqued.
MOSAIC_CONTEXT_USES = 256
_mosaic_ctx: list[Any] = [None, 0]
_mosaic_lock = threading.Lock()


def mosaic_kernel_module(body: bytes) -> Any:
    """A Pallas/Mosaic TPU kernel, the MLIR bytecode a tpu_custom_call's
    backend_config carries, parsed in a context that knows Mosaic's dialect
    as `jax._src.tpu_custom_call` makes one (jaxlib's `tpu` dialect
    registered, the versioning dialect `stable_mosaic` allowed unregistered).
    Raises when it does not parse. The module keeps its context alive."""
    from jax._src.lib import tpu

    with _mosaic_lock:
        ctx, uses = _mosaic_ctx
        if ctx is None or uses >= MOSAIC_CONTEXT_USES:
            ctx = _mlir.make_ir_context()
            tpu.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            uses = 0
        _mosaic_ctx[:] = [ctx, uses + 1]
        with ctx, ir.Location.unknown():
            return ir.Module.parse(body)


def strip_debuginfo(module: Any) -> None:
    """Drop every location. Without the verifier MLIR runs after each pass by
    default: a module JAX lowered is valid, and dropping locations cannot make
    it invalid (on a 2400-layer module, 143 ms with it, 4 ms without)."""
    pm = _passmanager.PassManager.parse("builtin.module(strip-debuginfo)")
    pm.enable_verifier(False)
    pm.run(module.operation)


def hlo_to_stablehlo(hlo_module_proto: bytes) -> bytes:
    """Convert a serialized HloModuleProto to StableHLO (MLIR bytecode)."""
    return _jax.mlir.hlo_to_stablehlo(hlo_module_proto)


def stablehlo_to_hlo(bytecode: bytes) -> bytes:
    """MLIR bytecode converted to a serialized HloModuleProto by XLA's own
    converter (what lowered.compiler_ir("hlo") uses)."""
    return _jax.mlir.mlir_module_to_xla_computation(
        bytecode, use_tuple_args=False, return_tuple=False).as_serialized_hlo_module_proto()


def jaxlib_version() -> str:
    return str(_jaxlib_version)


def compile_options_bytes(compile_options: Any) -> bytes:
    """CompileOptionsProto bytes without the debug-only fields JAX itself
    leaves out of its key (dump paths and formats, forced device counts),
    computed by JAX's own function so the two lists never drift apart."""
    class _Capture:
        data = b""

        def update(self, b: bytes) -> None:
            self.data += b

    opts = copy.deepcopy(compile_options)
    # A host-local path (JAX derives it from its own cache directory, which
    # may differ per process); where autotune results are cached does not
    # change generated code.
    opts.executable_build_options.debug_options.xla_gpu_per_fusion_autotune_cache_dir = ""
    cap = _Capture()
    _ck._hash_serialized_compile_options(cap, opts, strip_device_assignment=False)
    return cap.data


def canonical_compile_options(serialized: bytes) -> bytes:
    """compile_options_bytes of a serialized CompileOptionsProto (as a PJRT
    plugin receives it): the same bytes however its maps were ordered."""
    return compile_options_bytes(_xc.CompileOptions.ParseFromString(serialized))


def compile_options_round_trip(serialized: bytes) -> bytes:
    """A serialized CompileOptionsProto as this jaxlib reads and writes it
    back: what it does not know is gone (raises when it cannot read it)."""
    return bytes(_xc.CompileOptions.ParseFromString(serialized).SerializeAsString())


def without_shard_autotuning(serialized: bytes) -> bytes:
    """A serialized CompileOptionsProto for a GPU compile that waits for no
    other process (compile_alone): sharded autotuning off."""
    opts = _xc.CompileOptions.ParseFromString(serialized)
    overrides = list(opts.env_option_overrides)
    if any(name == SHARD_AUTOTUNING for name, _ in overrides):
        return serialized
    opts.env_option_overrides = [*overrides, (SHARD_AUTOTUNING, False)]
    return bytes(opts.SerializeAsString())


def portable_artifact_module(data: bytes) -> Any:
    """A StableHLO portable artifact (what JAX hands a PJRT plugin) as an MLIR
    module in a fresh context; raises when `data` is not one."""
    from jaxlib.mlir.dialects import stablehlo

    ctx = mlir_context()
    with ctx:
        return stablehlo.deserialize_portable_artifact(ctx, data)


def excluded_xla_flags() -> list[str]:
    return list(_ck.xla_flags_to_exclude_from_cache_key)


def xla_flag_prefixes() -> list[str]:
    """Command-line prefixes that plugins registered for JAX's key
    (cache_key.add_flag_prefixes), besides `--xla`."""
    return list(_ck.get_flag_prefixes())


def custom_hook() -> str:
    """What the user's cache_key.custom_hook adds to JAX's key ("" by default).
    Looked up on every call: users replace the module attribute."""
    return str(_ck.custom_hook())


# -- recipes: what it takes to compile a program again -------------------------

def module_bytecode(module: Any) -> bytes:
    return bytes(_mlir.module_to_bytecode(module))


def compile_options_proto(compile_options: Any) -> bytes:
    """The full CompileOptionsProto (for a recipe; the key uses compile_options_bytes)."""
    return bytes(compile_options.SerializeAsString())


def libtpu_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return ""


def compile_program(program: bytes, compile_options: bytes, devices: list[Any],
                    device_shape: tuple[int, ...]) -> Any:
    """Compile recorded MLIR bytecode for `devices` (in the recorded assignment
    order) through JAX's own compile path: the installed hooks see it exactly
    as they see a jitted function, so it gets the same key."""
    import numpy as np

    with mlir_context() as ctx:
        module = ir.Module.parse(program, context=ctx)
        opts = _xc.CompileOptions.ParseFromString(compile_options)
        arr = np.empty(len(devices), dtype=object)
        arr[:] = devices
        backend = devices[0].client
        return _compiler.compile_or_get_cached(
            backend, module, arr.reshape(device_shape), opts, [], _xc.DeviceList(tuple(devices)),
            None)
