"""Canonical cache keys.

A key is a versioned digest over named components; each component's digest
is kept so `explain` can say which one caused a miss:

    program          the canonical program (below)
    compile_options  CompileOptionsProto minus debug-only fields (JAX only)
    platform         backend platform and platform version (JAX only)
    versions         jaxlib / XLA version
    xla_flags        XLA_FLAGS and LIBTPU_INIT_ARGS in effect, as XLA reads them
                     (worker/xla/xlaflags.py), minus dump and debug flags
    topology         device kinds, count and the device assignment (JAX only)
    compression      the entry format
    key_version      bumps whenever canonicalization changes
    ignored          the ignore lists (KeyConfig.describe): keys made under
                     different configurations never meet
    custom_hook      what JAX's cache_key.custom_hook returns, when set (JAX only)
    host_cpu         on the CPU platform: the host CPU XLA compiles for (JAX only)

HloModuleProto input (PyTorch/XLA and XLA dumps) is canonicalized at the
protobuf wire level by `hlocanon` (names, ids, OpMetadata; see there), without
MLIR. StableHLO text and MLIR bytecode are parsed with jaxlib's MLIR, and the
program component is the digest of `mlircanon`'s canonical stream of the
module (one walk, see there), which leaves out only what cannot change the
executable:
- debug locations, which is where every OpMetadata field (op_type, op_name,
  source_file, source_line, stack frames) and every HLO instruction and
  parameter name ends up (never visited);
- the module name (JAX puts the Python function name there; PyTorch/XLA a
  global graph counter);
- names of private functions: renamed to f0, f1, ... in order of
  appearance, which also removes HLO computation names and unique ids;
- the attributes in `ignore_attributes` on the module, its functions and
  their arguments and results (default: JAX's jax.arg_info and
  jax.result_info, Python pytree paths that XLA never reads).
Everything else is in the stream: every element of every constant (raw
bytes, or MLIR's complete printed form), shapes, dtypes, layouts, shardings, aliasing
and donation, frontend attributes, backend configs, custom-call targets,
precision configs, comparison directions, reductions and operand order. SSA
values are numbered by position, so instruction renumbering cannot change a
key. A program that cannot be parsed is keyed by its raw bytes
(sound, never metadata-agnostic) and the key says so (`program_format: raw`).

`include_metadata=True` switches all of this off (as JAX's
compilation_cache_include_metadata_in_key does): the key then covers the
program's bytecode with locations and names.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import platform
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..xla import xlaflags
from . import hlocanon, mlircanon, mosaic


class _JaxAdapter:
    """worker/jax_adapter, imported on first use: HLO protos are keyed
    without JAX, so `compilecast key dump/*.hlo.pb` never pays for importing it."""

    def __getattr__(self, name: str) -> Any:
        from ..xla import jax_adapter as module
        globals()["jax_adapter"] = module  # later uses go straight to the module
        return getattr(module, name)


jax_adapter: Any = _JaxAdapter()

KEY_VERSION = "8"  # 2: topology with device coordinates and slice size; 3: HLO protos via hlocanon;
# 4: xla_flags as XLA reads them (last of a repeated flag, quoted values, flag files), and the
# host CPU (CPU platform) and JAX's custom_hook (when set) as components; 5: MLIR programs
# by mlircanon's canonical stream (one walk) instead of a canonicalized module's bytecode;
# 6: a Shardy mesh's axis names by their position (renamed consistently, one key); 7: the MLIR
# stream's version 4 (constants where used, identity converts, DEFAULT-only precisions: one
# digest through the JAX door and the PJRT interposer), whose grammar differs from 3's; 8: an
# HLO proto's Shardy attributes with the mesh axes named by position, as 6 has them for MLIR
KEY_PREFIX = "cc1-"
DEFAULT_IGNORED_ATTRIBUTES = ("jax.arg_info", "jax.result_info")
MLIR_BYTECODE_MAGIC = b"ML\xefR"


@dataclass(frozen=True)
class KeyConfig:
    include_metadata: bool = False
    # MLIR attributes dropped from the module, its functions and their
    # arguments and results; in HLO protos, frontend attributes with these keys.
    ignore_attributes: tuple[str, ...] = DEFAULT_IGNORED_ATTRIBUTES
    rename_private_functions: bool = True
    # HLO proto fields a deployment also drops (names in hlocanon.HLO_FIELDS).
    ignore_hlo_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.hlo_config  # noqa: B018 - ValueError naming an unknown field, at once

    @functools.cached_property
    def hlo_config(self) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """(field drops, frontend attribute keys) as hlocanon takes them."""
        return (hlocanon.field_drops(self.ignore_hlo_fields),
                tuple(a.encode() for a in self.ignore_attributes))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KeyConfig:
        env = os.environ if env is None else env
        include = env.get("COMPILECAST_KEY_INCLUDE_METADATA", "").lower() in ("1", "true", "yes")
        native = env.get("COMPILECAST_KEY_NATIVE", "1")
        if native not in ("0", "1"):
            raise ValueError(f"COMPILECAST_KEY_NATIVE={native!r}: 0 (the Python walk only) "
                             "or 1 (the default)")

        def names(var: str) -> tuple[str, ...]:
            return tuple(a.strip() for a in env.get(var, "").split(",") if a.strip())

        return cls(include_metadata=include,
                   ignore_attributes=DEFAULT_IGNORED_ATTRIBUTES + names(
                       "COMPILECAST_KEY_IGNORE_ATTRIBUTES"),
                   ignore_hlo_fields=names("COMPILECAST_KEY_IGNORE_HLO_FIELDS"))

    def describe(self) -> str:
        """What this configuration leaves out, for the key's `ignored`
        component: keys made under different ignore lists never meet."""
        return (f"attributes={sorted(set(self.ignore_attributes))}\n"
                f"hlo_fields={sorted(set(self.ignore_hlo_fields))}\n"
                f"rename_private_functions={self.rename_private_functions}")

    @functools.cached_property
    def ignored(self) -> str:
        """The key's `ignored` component (computed once: a key of a 100 KB
        module takes ~300 us, and this took 5 of them)."""
        return _digest(self.describe())


@functools.cache
def _default_config() -> KeyConfig:
    """The default configuration, built once (it is frozen)."""
    return KeyConfig()


def default_config() -> KeyConfig:
    """The key settings of this process (COMPILECAST_KEY_* at its start)."""
    return _default_config()


@dataclass
class Key:
    components: dict[str, str] = field(default_factory=dict)
    # Canonical program text for `explain` (only kept when asked for).
    program_text: str | None = None
    # Bytes of the program's canonical stream (what its digest hashed). Not
    # part of the key: it tells, before anything is serialized, roughly how
    # big the program's MLIR bytecode is (the stream is at most 1.21x the
    # bytecode, 1.0x for constants; BENCHMARKS.md, "Key computation").
    program_bytes: int = 0
    # Why a program file was keyed by its raw bytes ("" when it was parsed).
    unparsed: str = ""

    @property
    def value(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.components):
            h.update(f"{name}={self.components[name]}\n".encode())
        return KEY_PREFIX + h.hexdigest()


def _digest(data: bytes | memoryview | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


# -- formats -------------------------------------------------------------------

def hlo_module_bytes(data: bytes) -> bytes:
    """The HloModuleProto inside an HloProto (field 1), or `data` itself when
    it already is an HloModuleProto (whose field 1 is the name string)."""
    module = _hlo_module_view(data)
    return module if isinstance(module, bytes) else bytes(module)


def _hlo_module_view(data: bytes) -> bytes | memoryview:
    """hlo_module_bytes without copying an HloProto's module out of it."""
    computations = False
    for number, wire, _start, vs, ve, _value in hlocanon.fields(data, 0, len(data)):
        computations = computations or (number == 3 and wire == hlocanon.LEN)
        if number == 1 and wire == hlocanon.LEN:
            # HloModuleProto.name is a string; an HloProto's field 1 is a message.
            looks_like_name = False
            if ve - vs < 4096 and data[vs:vs + 1] != b"\n":
                try:
                    data[vs:ve].decode("utf-8")
                    looks_like_name = True
                except UnicodeDecodeError:
                    pass
            return data if looks_like_name else memoryview(data)[vs:ve]
    if computations:  # an HloModuleProto without a name (proto3 leaves "" out)
        return data
    raise ValueError("no module in the protobuf message")


PORTABLE_PRODUCER = b"StableHLO_v"  # a portable artifact's producer, near its start


def detect_format(data: bytes) -> str:
    if data.startswith(MLIR_BYTECODE_MAGIC):
        # A StableHLO portable artifact (jax.export's module, what JAX hands
        # a PJRT plugin): VHLO bytecode, read through StableHLO's own reader.
        return "stablehlo-portable" if PORTABLE_PRODUCER in data[:64] else "mlir-bytecode"
    head = data[:4096]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text.lstrip().startswith("HloModule "):
        return "hlo-text"  # not keyed canonically (HLO_TEXT)
    if text and ("module" in text or "func.func" in text or "stablehlo." in text
                 or "mhlo." in text):
        return "mlir-text"
    return "hlo-proto"


# XLA's HLO text printer elides large constants ({...}) by default: printer
# output cannot tell such programs apart, so it is never canonicalized.
HLO_TEXT = ("HLO text is not keyed canonically (its printer elides large constants); "
            "dump with --xla_dump_hlo_as_proto")


# -- canonicalization ------------------------------------------------------------

def _strip_attributes(module: Any, names: tuple[str, ...]) -> None:
    """Drop `names` from the module, its functions, and their argument and
    result attributes. Only those levels: an op inside a function carries its
    debug information in its location (dropped by strip-debuginfo), and a
    Python walk over every op cost more than everything else in a key."""
    ir = jax_adapter.ir
    drop = set(names)
    empty = ir.DictAttr.get({})

    def clean_dict(d: Any) -> Any | None:
        """`d` without the dropped names, or None when it has none of them.
        Most argument and result dicts hold nothing, or only what is dropped
        (JAX's pytree paths): those cost a lookup, not a rebuild."""
        dd = ir.DictAttr(d)
        n = len(dd)
        hits = sum(1 for name in drop if name in dd) if n else 0
        if hits == 0:
            return None
        if hits == n:
            return empty
        return ir.DictAttr.get({a.name: a.attr for a in dd if a.name not in drop})

    def visit(op: Any) -> None:
        attrs = op.attributes
        for name in drop:
            if name in attrs:
                del attrs[name]
        for list_name in ("arg_attrs", "res_attrs"):
            if list_name in attrs:
                arr = list(ir.ArrayAttr(attrs[list_name]))
                cleaned = [clean_dict(d) for d in arr]
                if any(c is not None for c in cleaned):
                    attrs[list_name] = ir.ArrayAttr.get(
                        [d if c is None else c for d, c in zip(arr, cleaned, strict=True)])

    visit(module.operation)
    for op in _body(module).operations:
        visit(op.operation)


def _body(module: Any) -> Any:
    return module.operation.regions[0].blocks[0]


def _rename_private_functions(module: Any) -> None:
    """Rename private functions to f0, f1, ... in order of appearance (the
    renames the canonical stream applies, mlircanon.private_renames), in the
    module itself: for canonicalize(), which only explain's text and modules
    the walk refuses (resources) need. One MLIR walk per function."""
    ir = jax_adapter.ir
    mapping = mlircanon.private_renames(module)
    if not mapping:
        return
    public = {ir.StringAttr(op.operation.attributes["sym_name"]).value
              for op in _body(module).operations
              if "sym_name" in op.operation.attributes} - set(mapping)
    _rename_uses(module, mapping, public)
    for op in _body(module).operations:
        attrs = op.operation.attributes
        if "sym_name" in attrs:
            old = ir.StringAttr(attrs["sym_name"]).value
            if old in mapping:
                attrs["sym_name"] = ir.StringAttr.get(mapping[old])


def _rename_uses(module: Any, mapping: dict[str, str], taken: set[str]) -> None:
    """Every use of each private function, renamed by MLIR. Renaming one at a
    time must never rename onto a name still in use, so when a new name is an
    old one (a function already called f1), everything goes through unused
    temporary names first."""
    replace = jax_adapter.ir.SymbolTable.replace_all_symbol_uses
    op = module.operation
    steps = [mapping]
    if set(mapping.values()) & set(mapping):
        used = taken | set(mapping)
        temp, i = {}, 0
        for old in mapping:
            while f"cc.tmp{i}" in used:
                i += 1
            temp[old] = f"cc.tmp{i}"
            i += 1
        steps = [temp, {temp[old]: new for old, new in mapping.items()}]
    for step in steps:
        for old, new in step.items():
            replace(old, new, op)


def parse_program(data: bytes, fmt: str | None = None) -> tuple[Any, str]:
    """Parse into an MLIR module (in a fresh context); returns (module, format)."""
    fmt = fmt or detect_format(data)
    if fmt == "stablehlo-portable":
        try:
            return jax_adapter.portable_artifact_module(data), fmt
        except Exception:  # (its reader's any error): not one after all, plain bytecode
            fmt = "mlir-bytecode"
    ctx = jax_adapter.mlir_context()
    with ctx:
        if fmt == "hlo-proto":
            data = jax_adapter.hlo_to_stablehlo(hlo_module_bytes(data))
        if fmt == "mlir-text":
            module = jax_adapter.ir.Module.parse(data.decode("utf-8"))
        else:
            module = jax_adapter.ir.Module.parse(data)
    return module, fmt


def canonicalize(module: Any, cfg: KeyConfig, *, copy: bool = True) -> Any:
    """A canonical form of `module` (a clone unless copy=False)."""
    with module.context:
        m = module.operation.clone() if copy else module  # an Operation works as a Module here
        if cfg.include_metadata:
            return m
        jax_adapter.strip_debuginfo(m)
        if "sym_name" in m.operation.attributes:
            del m.operation.attributes["sym_name"]
        if cfg.ignore_attributes:
            _strip_attributes(m, cfg.ignore_attributes)
        if cfg.rename_private_functions:
            _rename_private_functions(m)
        return m


# -- mesh axes -------------------------------------------------------------------

# Attributes that name a Shardy mesh's axes (besides any "sdy."-prefixed one).
# (`replica_groups`: a collective's groups by mesh axes, #stablehlo.axis_ref, as
# JAX 0.12 lowers a psum inside shard_map.)
_AXIS_ATTRS = frozenset({"mesh", "sharding", "arg_attrs", "res_attrs", "in_shardings",
                         "out_shardings", "manual_axes", "stablehlo.mesh", "replica_groups"})
# Of them, those whose every quoted string is an axis (a mesh described as a
# dictionary); in the others only Shardy's attributes name axes (hlocanon.rename_axes).
_MESH_ATTRS = frozenset({"stablehlo.mesh", "replica_groups"})
_MESH_AXIS = re.compile(r'"((?:[^"\\]|\\.)*)"\s*=\s*\d+')


def _ops(module: Any) -> Any:
    """The top-level operations of a module (or of a module's Operation)."""
    op = getattr(module, "operation", module)
    return op.regions[0].blocks[0].operations


def mesh_axis_renames(module: Any) -> dict[str, str]:
    """Each Shardy mesh axis name -> its position ("axis0", "axis1"...): a
    program whose mesh axes are renamed consistently (the PartitionSpecs
    with them) compiles to the same executable, so it keys the same. Only
    where every mesh of the module agrees on each name's position; {} else."""
    renames: dict[str, str] = {}
    for op in _ops(module):
        # JAX puts its meshes first: a program that does not is keyed by the
        # names it has (a miss at worst, never another program's key).
        if op.operation.name != "sdy.mesh":
            break
        if "mesh" not in op.operation.attributes:
            continue
        for i, name in enumerate(_MESH_AXIS.findall(str(op.operation.attributes["mesh"]))):
            if renames.setdefault(name, f"axis{i}") != f"axis{i}":
                return {}
    return renames if any(old != new for old, new in renames.items()) else {}


@contextlib.contextmanager
def mesh_axes_renamed(module: Any, renames: dict[str, str]) -> Iterator[None]:
    """`module` with its mesh axes renamed in every attribute that names them,
    for the length of the block; every attribute is put back as it was after
    it (the module may be the one JAX is about to compile)."""
    from jaxlib.mlir import ir

    changed: list[tuple[Any, str, Any]] = []

    by_bytes = {old.encode(): new.encode() for old, new in renames.items()}

    def rename(text: str, name: str) -> str:
        return hlocanon.rename_axes(text.encode(), by_bytes,
                                    whole=name in _MESH_ATTRS).decode()

    def visit(op: Any) -> Any:
        attrs = op.attributes
        shardy = op.name.startswith("sdy.")  # (its collectives' axes: gathering_axes...)
        for named in [attrs[i] for i in range(len(attrs))]:
            name = named.name
            if not shardy and name not in _AXIS_ATTRS and not name.startswith("sdy."):
                continue
            text = str(named.attr)
            if name in ("arg_attrs", "res_attrs") and "#sdy." not in text:
                continue
            new = rename(text, name)
            if new != text:
                changed.append((op, name, named.attr))
                attrs[name] = ir.Attribute.parse(new)
        return ir.WalkResult.ADVANCE

    with module.context:
        try:
            getattr(module, "operation", module).walk(visit)
            yield
        finally:
            for op, name, attr in reversed(changed):
                op.attributes[name] = attr


def _bytecode(module: Any) -> bytes:
    out = io.BytesIO()
    module.operation.write_bytecode(file=out)
    return out.getvalue()


class _Counted:
    """sha256 that counts the bytes it is given."""

    def __init__(self, data: bytes = b"") -> None:
        self._h = hashlib.sha256(data)
        self.n = len(data)

    def update(self, data) -> None:
        self._h.update(data)
        self.n += memoryview(data).nbytes

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def program_digest(module: Any, cfg: KeyConfig, *, keep_text: bool = False,
                   copy: bool = True) -> tuple[str, str | None, int]:
    """The program component of an MLIR module's key, (keep_text) its
    canonical text for `explain`, and the bytes hashed (Key.program_bytes).
    The digest is of mlircanon's canonical stream, one walk that leaves the
    module untouched; with include_metadata, of the module's bytecode,
    locations and names included."""
    if cfg.include_metadata:
        code = _bytecode(module)
        return _digest(code), (
            module.operation.get_asm(enable_debug_info=True) if keep_text else None), len(code)
    axes = mesh_axis_renames(module)
    if axes:  # a sharded program: its axes by position, for the walk only
        with mesh_axes_renamed(module, axes):
            return program_digest(module, cfg, keep_text=keep_text, copy=copy)
    with module.context:
        renames: dict[str, str] | None = (
            None if cfg.rename_private_functions else {})  # None: the walk finds them
        h = _Counted()
        try:
            mlircanon.stream(module, h, frozenset(cfg.ignore_attributes), renames,
                             mosaic.kernel_part)
        except mlircanon.ResourceRefused:  # blobs outside attributes: the bytecode has them
            h = _Counted(b"resources\n" + _bytecode(canonicalize(module, cfg, copy=True)))
        except mlircanon.NestingRefused:  # deeper than the walk goes: the same, by bytecode
            h = _Counted(b"nested\n" + _bytecode(canonicalize(module, cfg, copy=True)))
    text = None
    if keep_text:  # only for explain: the canonical module as MLIR prints it
        text = mosaic.readable(
            canonicalize(module, cfg, copy=copy).operation.get_asm(enable_debug_info=False))
    return h.hexdigest(), text, h.n


# -- keys ----------------------------------------------------------------------

def program_key(data: bytes, cfg: KeyConfig | None = None, *, keep_text: bool = False) -> Key:
    """The key of a program file (HloProto/HloModuleProto, StableHLO text,
    MLIR bytecode or a StableHLO portable artifact). Only program-level components: a file carries no
    platform, flags or topology."""
    cfg = cfg or _default_config()
    key = Key()
    fmt = detect_format(data)
    try:
        if fmt == "hlo-text":
            raise ValueError(HLO_TEXT)
        if fmt == "hlo-proto":
            digest = _hlo_digest(_hlo_module_view(data), cfg)
            if keep_text:  # for `explain` only: the program as MLIR prints it
                key.program_text = _hlo_text(data, cfg)
        else:
            module, fmt = parse_program(data, fmt)
            digest, key.program_text, key.program_bytes = program_digest(
                module, cfg, keep_text=keep_text, copy=False)
    except Exception as exc:
        key.unparsed = HLO_TEXT if fmt == "hlo-text" else f"not valid {fmt}: {_first_words(exc)}"
        fmt, digest = "raw", _digest(data)
    key.components.update(program=digest, program_format=fmt, key_version=KEY_VERSION,
                          include_metadata=str(cfg.include_metadata),
                          ignored=cfg.ignored)
    return key


def _first_words(exc: Exception, limit: int = 160) -> str:
    """A parser's error on one line, cut at `limit` characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = text or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _hlo_text(data: bytes, cfg: KeyConfig) -> str | None:
    """An HLO proto as MLIR prints it after canonicalization (for `explain`),
    or None when XLA's importer cannot read it: the key never depends on it."""
    try:
        module, _ = parse_program(data, "hlo-proto")
        return program_digest(module, cfg, keep_text=True, copy=False)[1]
    except Exception:  # any importer failure only loses the text
        return None


def _hlo_digest(module_bytes: bytes | memoryview, cfg: KeyConfig) -> str:
    # Computed even with include_metadata: it validates the module.
    canonical = hlocanon.canonical_sha256(module_bytes, *cfg.hlo_config, mosaic.kernel_part,
                                          hlocanon.axis_renamer(module_bytes))
    return _digest(module_bytes) if cfg.include_metadata else canonical


def xla_flags() -> list[str]:
    """The XLA flags in effect as XLA reads them (see worker/xla/xlaflags.py),
    minus those JAX knows cannot change the executable."""
    return xlaflags.describe(jax_adapter.excluded_xla_flags(),
                             prefixes=jax_adapter.xla_flag_prefixes())


# What LLVM reads to pick the CPU XLA:CPU compiles for (its host CPU name
# comes from the vendor, family and model; its features from the ISA flags).
_CPUINFO_FIELDS = ("vendor_id", "cpu family", "model", "flags",  # x86
                   "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


def host_cpu(cpuinfo: str | None = None) -> str:
    """The host CPU as XLA:CPU compiles for it: architecture, vendor, family,
    model and ISA features of the first processor in /proc/cpuinfo. A CPU
    executable uses every feature of the host that compiled it, so hosts that
    differ here must not share one (another host's would be refused on load,
    or die of an illegal instruction)."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: all of a host's cores match
            continue
        name, _, value = line.partition(":")
        name = name.strip()
        if name in _CPUINFO_FIELDS:
            words = value.split()
            fields[name] = " ".join(sorted(words) if name in ("flags", "Features") else words)
    described = "\n".join(f"{k}: {fields[k]}" for k in _CPUINFO_FIELDS if k in fields)
    return f"{platform.machine()}\n{described or platform.processor()}"


@functools.lru_cache(maxsize=1)
def _host_cpu_digest() -> str:
    return _digest(host_cpu())


def host_cpu_digest() -> str:
    """The `host_cpu` component of this host."""
    return _host_cpu_digest()


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def prepare() -> None:
    """Do at a process's start what its first key would otherwise do once:
    settle the C walk for this jaxlib build (its verdict read and bound, or
    its self-test started in the background) and build the default key
    settings. A pod's processes all key their first program at the same
    moment, the lowest-id one on the way to its compile."""
    mlircanon.native_ready()
    _default_config()


def jax_key(module: Any, devices: Any, compile_options: Any, backend: Any,
            cfg: KeyConfig | None = None) -> Key:
    """The key of a program JAX is about to compile.

    Identical on every process of a job: nothing process-specific goes in.
    The device assignment (global device ids) is the same on every process;
    the process index is not part of CompileOptions' serialized form that
    changes the executable on CPU, see docs/keys.md.
    """
    cfg = cfg or _default_config()
    digest, _, streamed = program_digest(module, cfg)
    kinds = sorted({str(d.device_kind) for d in devices.flat})
    ids = [int(d.id) for d in devices.flat]
    # Where each device sits in the slice (TPU chips' ICI coordinates and core)
    # and how big the slice is: the same device ids on another slice shape are
    # another machine. Every process of a job sees the same global devices.
    coords = [(tuple(getattr(d, "coords", ()) or ()), int(getattr(d, "core_on_chip", 0) or 0))
              for d in devices.flat]
    slice_size = int(backend.device_count())
    hook = jax_adapter.custom_hook()  # set only by users who extend JAX's key
    return Key(components={
        "program": digest,
        "program_format": "mlir",
        "compile_options": _digest(jax_adapter.compile_options_bytes(compile_options)),
        "platform": _digest(f"{backend.platform}\n{backend.platform_version}"),
        "versions": _digest(f"jaxlib {jax_adapter.jaxlib_version()}"),
        "xla_flags": _digest("\n".join(xla_flags())),
        "topology": _digest(f"{kinds}\n{devices.shape}\n{ids}\n{coords}\n{slice_size}"),
        "compression": "jax-entry-zstd",
        "key_version": KEY_VERSION,
        "include_metadata": str(cfg.include_metadata),
        "ignored": cfg.ignored,
        **({"custom_hook": _digest(hook)} if hook else {}),
        **({"host_cpu": _host_cpu_digest()} if backend.platform == "cpu" else {}),
    }, program_bytes=streamed)


EXPLAIN_WIDTH = 200  # characters of a differing line that explain shows


def _around_difference(x: str, y: str) -> tuple[str, str]:
    """Two differing lines, each cut to EXPLAIN_WIDTH characters around where
    they first differ (a big constant or config prints as one long line)."""
    if max(len(x), len(y)) <= EXPLAIN_WIDTH:
        return x, y
    at = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
              min(len(x), len(y)))
    start = max(0, at - EXPLAIN_WIDTH // 4)

    def cut(s: str) -> str:
        part = s[start:start + EXPLAIN_WIDTH]
        return ("…" if start else "") + part + ("…" if start + EXPLAIN_WIDTH < len(s) else "")

    return cut(x), cut(y)


def explain(a: Key, b: Key) -> list[str]:
    """Human-readable differences between two keys."""
    lines = []
    for name in sorted(set(a.components) | set(b.components)):
        va, vb = a.components.get(name, "-"), b.components.get(name, "-")
        if va != vb:
            lines.append(f"component {name} differs: {va[:16]} vs {vb[:16]}")
    if a.program_text is not None and b.program_text is not None and \
            a.components.get("program") != b.components.get("program"):
        la, lb = a.program_text.splitlines(), b.program_text.splitlines()
        for i, (x, y) in enumerate(zip(la, lb, strict=False)):
            if x != y:
                lines.append(f"first differing operation (canonical line {i + 1}):")
                x, y = _around_difference(x.strip(), y.strip())
                lines.append(f"  - {x}")
                lines.append(f"  + {y}")
                break
        else:
            if len(la) == len(lb):
                lines.append("the canonical programs print the same: they differ in a field "
                             "the MLIR printer does not show")
            else:
                lines.append(f"one program is a prefix of the other ({len(la)} vs {len(lb)} "
                             "lines)")
    return lines
