"""Canonical bytes of a serialized HloModuleProto, without going through MLIR.

The input is walked at the protobuf wire level. Every field is copied byte for
byte unless this schema says otherwise, so a field that XLA adds tomorrow is
in the key (a miss at worst, never a collision). What changes:

- dropped (cannot change the executable): module, computation and instruction
  names, the module id, the entry computation name, every OpMetadata
  (instructions' and shardings'), the module's stack-frame index and the
  parameter names of program shapes;
- renumbered: instruction ids become their position in their computation and
  computation ids their position in the module. Definitions are implied by
  position; every reference (operands, control predecessors, called
  computations, roots, the entry computation, schedules) is written as the
  position it resolves to. A reference that resolves to nothing keeps its raw
  value under a field number no real field uses, so it can never be mistaken
  for a resolved one;
- rewritten sub-messages are written as protobuf groups (start/end tags), so
  the output parses unambiguously without length prefixes; schedule entries
  (a map) are sorted by the position of their computation, frontend attributes
  (a map too) by their bytes;
- configurable (KeyConfig): frontend attributes whose key is on the ignore
  list, and the fields named in HLO_FIELDS that a deployment also drops;
- renamed (with axis_renamer's hook): a Shardy frontend attribute's ("xla.sdy."
  key) mesh axis names, by their position in the module's meshes ("axis0",
  "axis1"...), as the MLIR form's key names them; written as a group under field
  2 + RENAMED. Axis names are metadata: renamed consistently, the executable
  is the same;
- a Pallas/Mosaic TPU kernel call (custom_call_target "tpu_custom_call"
  before its backend_config): the config is written as the kernel hook
  (worker/keylib/mosaic.py) splits it, the kernel's bytecode replaced by the digest
  of its canonical stream, under field 43 + KERNEL, a number no real field
  uses.

The output is only ever hashed. `canonical_hlo` uses the C implementation
(`_hlocanon`, built with the package) when it is importable and this module
otherwise; both produce the same bytes (tests/test_hlocanon.py).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from typing import Any


def checked_split(hook: Callable[[bytes], Any],
                  config: bytes) -> tuple[bytes, bytes, bytes] | None:
    """hook(config), held to the kernel hook's contract: None, or (before,
    kernel digest, after) as bytes; ValueError otherwise. What the Python
    walks (mlirwalk, here) call; the C ones check the same."""
    parts = hook(config)
    if parts is not None and not (isinstance(parts, tuple) and len(parts) == 3 and
                                  all(isinstance(p, bytes) for p in parts)):
        raise ValueError("the kernel hook must return None or 3 bytes")
    return parts


VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5
UNRESOLVED = 1 << 28  # added to the field number of a reference that resolves to nothing
KERNEL = 1 << 27  # added to backend_config's number when the kernel hook splits it
RENAMED = 1 << 26  # added to an attribute's field number when its mesh axes are renamed
CUSTOM_CALL_TARGET, BACKEND_CONFIG = 28, 43  # HloInstructionProto
MAX_DEPTH = 64  # nested messages (shardings inside shardings) deeper than this are refused

# Message kinds and what happens to their fields (anything not listed is kept).
(MODULE, COMPUTATION, INSTRUCTION, PROGRAM_SHAPE, SHARDING, NAMED_SHARDING, SCHEDULE,
 FRONTEND) = range(8)
DROP, IDEF, CDEF, IREF, CREF, ROOT, ENTRY, SEQUENCES, ATTRIBUTE = range(9)  # non-message actions

SCHEMA: dict[int, dict[int, tuple[int, int] | int]] = {
    MODULE: {1: DROP, 2: DROP, 5: DROP, 17: DROP, 6: ENTRY,
             3: (COMPUTATION, 0), 4: (PROGRAM_SHAPE, 0), 7: (SCHEDULE, 0),
             12: (SHARDING, 0), 14: (SHARDING, 0), 19: (FRONTEND, 0)},
    COMPUTATION: {1: DROP, 5: CDEF, 6: ROOT,
                  2: (INSTRUCTION, 0), 4: (PROGRAM_SHAPE, 0)},
    INSTRUCTION: {1: DROP, 7: DROP, 35: IDEF, 36: IREF, 37: IREF, 38: CREF,
                  40: (SHARDING, 0), 54: (SHARDING, 0), 55: (SHARDING, 0),
                  68: (FRONTEND, 0)},
    PROGRAM_SHAPE: {3: DROP},
    SHARDING: {7: DROP, 5: (SHARDING, 0), 14: (NAMED_SHARDING, 0)},
    NAMED_SHARDING: {6: DROP, 1: (NAMED_SHARDING, 0)},
    SCHEDULE: {1: SEQUENCES},
    FRONTEND: {1: ATTRIBUTE},  # FrontendAttributes: map<string, string> map = 1
}

# Fields that configuration may add to what is dropped (KeyConfig.ignore_hlo_fields),
# by `message.field` name. Only fields copied as they are can be named; naming one
# that changes the executable makes different programs share a key.
HLO_FIELDS: dict[str, tuple[int, int]] = {
    **{f"instruction.{name}": (INSTRUCTION, number) for name, number in {
        "opcode": 2, "shape": 3, "literal": 8, "parameter_number": 9, "fusion_kind": 11,
        "tuple_index": 13, "dimensions": 14, "window": 15, "channel_id": 26,
        "custom_call_target": 28, "backend_config": 43, "frontend_attributes": 68,
        "statistics_viz": 82, "original_value": 88, "result_accuracy": 91}.items()},
    **{f"computation.{name}": (COMPUTATION, number) for name, number in {
        "is_fusion_computation": 7, "execution_thread": 8}.items()},
    **{f"module.{name}": (MODULE, number) for name, number in {
        "input_output_alias": 8, "cross_program_prefetches": 10, "is_dynamic": 11,
        "profile_info": 13, "device_assignment": 15, "use_auto_spmd_partitioning": 16,
        "buffer_donor": 18, "frontend_attributes": 19}.items()},
}


def field_drops(names: tuple[str, ...] | list[str]) -> tuple[int, ...]:
    """Configured field names as the (kind * 1000 + field) codes both
    implementations take; ValueError naming the field for an unknown one."""
    codes = []
    for name in names:
        if name not in HLO_FIELDS:
            known = ", ".join(sorted(HLO_FIELDS))
            raise ValueError(f"unknown HLO field {name!r} in the ignore list (known: {known})")
        kind, number = HLO_FIELDS[name]
        codes.append(kind * 1000 + number)
    return tuple(sorted(set(codes)))


def varint(v: int) -> bytes:
    v &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _read_varint(buf: bytes | memoryview, i: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, i


def fields(buf: bytes | memoryview, i: int, end: int) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(field, wire type, tag start, value start, value end, varint value)."""
    while i < end:
        start = i
        tag, i = _read_varint(buf, i, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise ValueError("field number 0")
        value = 0
        if wire == VARINT:
            vs = i
            value, i = _read_varint(buf, i, end)
        elif wire == I64:
            vs, i = i, i + 8
        elif wire == I32:
            vs, i = i, i + 4
        elif wire == LEN:
            n, vs = _read_varint(buf, i, end)
            i = vs + n
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if i > end:
            raise ValueError("field runs past the end of its message")
        yield number, wire, start, vs, i, value


def repeated_ints(buf: bytes, wire: int, vs: int, ve: int, value: int) -> list[int]:
    """The integers of a (possibly packed) repeated int64 field occurrence."""
    if wire == VARINT:
        return [value]
    if wire != LEN:
        raise ValueError("an id field that is not a varint")
    out, i = [], vs
    while i < ve:
        v, i = _read_varint(buf, i, ve)
        out.append(v)
    return out


def _last_varint(buf: bytes, vs: int, ve: int, number: int) -> int:
    value = 0  # proto3: absent means 0
    for f, wire, _s, _vs, _ve, v in fields(buf, vs, ve):
        if f == number:
            if wire != VARINT:
                raise ValueError(f"field {number} is not a varint")
            value = v
    return value


class _Module:
    def __init__(self, buf: bytes, drops: tuple[int, ...] = (),
                 attributes: tuple[bytes, ...] = (), kernel: Any = None,
                 rename: Callable[[bytes], bytes] | None = None) -> None:
        self.buf = buf
        self.kernel = kernel
        self.rename = rename
        self.drops = {(code // 1000, code % 1000) for code in drops}
        self.attributes = set(attributes)  # frontend attribute keys to drop
        self.comps: dict[int, int] = {}  # raw computation id -> position
        self.instrs: list[dict[int, int]] = []  # per computation: raw id -> position
        for f, wire, _s, vs, ve, _v in fields(buf, 0, len(buf)):
            if f != 3:
                continue
            if wire != LEN:
                raise ValueError("a computation that is not a message")
            cid = _last_varint(buf, vs, ve, 5)
            if cid in self.comps:
                raise ValueError(f"duplicate computation id {cid}")
            self.comps[cid] = len(self.instrs)
            ids: dict[int, int] = {}
            for g, w2, _s2, vs2, ve2, _v2 in fields(buf, vs, ve):
                if g == 2:
                    if w2 != LEN:
                        raise ValueError("an instruction that is not a message")
                    iid = _last_varint(buf, vs2, ve2, 35)
                    if iid in ids:
                        raise ValueError(f"duplicate instruction id {iid}")
                    ids[iid] = len(ids)
            self.instrs.append(ids)
        if not self.instrs:
            raise ValueError("no computations: not an HloModuleProto")


def _ref(out: bytearray, number: int, raw: int, table: dict[int, int] | None) -> None:
    pos = table.get(raw) if table is not None else None
    if pos is None:
        out += varint(((number + UNRESOLVED) << 3) | VARINT) + varint(raw)
    else:
        out += varint((number << 3) | VARINT) + varint(pos)


def _emit(m: _Module, kind: int, vs: int, ve: int, out: bytearray,
          comp: int | None, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise ValueError("messages nested too deeply")
    buf = m.buf
    schema = SCHEMA[kind]
    instrs = m.instrs[comp] if comp is not None else None
    tail: tuple[int, int, dict[int, int] | None] | None = None
    if kind == COMPUTATION:
        tail = (6, 0, instrs)  # root id; absent means 0
    elif kind == MODULE:
        tail = (6, 0, m.comps)  # entry computation id
    entries: list[tuple[tuple[int, int, bytes], bytes]] = []
    n_comp = 0
    tpu_call = False  # custom_call_target "tpu_custom_call" seen (as in _hlocanon.c)
    for f, wire, s, fvs, fve, value in fields(buf, vs, ve):
        if (kind, f) in m.drops:
            continue
        action = schema.get(f)
        if action is None and kind == INSTRUCTION and m.kernel is not None and wire == LEN:
            if f == CUSTOM_CALL_TARGET:
                tpu_call = buf[fvs:fve] == b"tpu_custom_call"
            elif f == BACKEND_CONFIG and tpu_call and _kernel_config(m, f, fvs, fve, out):
                continue
        if action is None:
            out += buf[s:fve]
        elif isinstance(action, tuple):
            if wire != LEN:
                raise ValueError(f"field {f} should be a message")
            sub_comp = comp
            if kind == MODULE and f == 3:
                sub_comp, n_comp = n_comp, n_comp + 1
            out += varint((f << 3) | SGROUP)
            _emit(m, action[0], fvs, fve, out, sub_comp, depth + 1)
            out += varint((f << 3) | EGROUP)
        elif action in (DROP, IDEF, CDEF):
            continue
        elif action in (ROOT, ENTRY):
            if wire != VARINT:
                raise ValueError(f"field {f} should be a varint")
            assert tail is not None
            tail = (tail[0], value, tail[2])
        elif action in (IREF, CREF):
            table = instrs if action == IREF else m.comps
            for raw in repeated_ints(buf, wire, fvs, fve, value):
                _ref(out, f, raw, table)
        elif action == SEQUENCES:
            entries.append(_sequence(m, f, wire, fvs, fve))
        elif action == ATTRIBUTE:
            entry = _attribute(m, wire, s, fvs, fve)
            if entry is not None:
                entries.append(((0, 0, entry), entry))
    for _key, entry in sorted(entries):
        out += entry
    if tail is not None:
        _ref(out, tail[0], tail[1], tail[2])


def _kernel_config(m: _Module, f: int, vs: int, ve: int, out: bytearray) -> bool:
    """A tpu_custom_call's backend_config as the kernel hook splits it
    (worker/keylib/mosaic.py): a group under field f + KERNEL holding {1: before,
    2: the kernel's digest, 3: after}. False when the hook keeps it whole."""
    parts = checked_split(m.kernel, m.buf[vs:ve])
    if parts is None:
        return False
    out += varint(((f + KERNEL) << 3) | SGROUP)
    for i, p in enumerate(parts, 1):
        out += varint((i << 3) | LEN) + varint(len(p)) + p
    out += varint(((f + KERNEL) << 3) | EGROUP)
    return True


def _sequence(m: _Module, f: int, wire: int, vs: int,
              ve: int) -> tuple[tuple[int, int, bytes], bytes]:
    """One schedule map entry {1: computation id, 2: {1: instruction ids}} and
    its sort key: map entries come in any order, so they are sorted by the
    position of their computation (unresolved ones last, by raw id)."""
    if wire != LEN:
        raise ValueError("a schedule entry that is not a message")
    buf = m.buf
    raw_comp, seq = 0, None
    for g, w2, _s, vs2, ve2, v2 in fields(buf, vs, ve):
        if g == 1 and w2 == VARINT:
            raw_comp = v2
        elif g == 2 and w2 == LEN:
            seq = (vs2, ve2)
        else:
            raise ValueError("unexpected field in a schedule entry")
    pos = m.comps.get(raw_comp)
    entry = bytearray(varint((f << 3) | SGROUP))
    _ref(entry, 1, raw_comp, m.comps)
    if seq is not None:
        entry += varint((2 << 3) | SGROUP)
        table = m.instrs[pos] if pos is not None else None
        for g, w3, _s, vs3, ve3, v3 in fields(buf, *seq):
            if g != 1:
                raise ValueError("unexpected field in an instruction sequence")
            for raw in repeated_ints(buf, w3, vs3, ve3, v3):
                _ref(entry, 1, raw, table)
        entry += varint((2 << 3) | EGROUP)
    entry += varint((f << 3) | EGROUP)
    key = (0, pos, b"") if pos is not None else (1, raw_comp, bytes(entry))
    return key, bytes(entry)


def _attribute(m: _Module, wire: int, s: int, vs: int, ve: int) -> bytes | None:
    """One frontend attribute (a map entry {1: key, 2: value}) as it is, or
    None when its key is on the ignore list. A map comes in any order, so the
    entries are sorted by their bytes."""
    if wire != LEN:
        raise ValueError("a frontend attribute that is not a message")
    if m.attributes or m.rename is not None:
        key = _attribute_key(m.buf, vs, ve)
        if key in m.attributes:
            return None
        if m.rename is not None and key.startswith(SDY):
            return _renamed(m.rename, m.buf[s:ve])
    return m.buf[s:ve]


SDY = b"xla.sdy."  # the frontend attributes that carry Shardy's meshes and shardings


def _attribute_key(buf: bytes | memoryview, vs: int, ve: int) -> bytes:
    key = b""
    for g, w, _s, vs2, ve2, _v in fields(buf, vs, ve):
        if g == 1 and w == LEN:
            key = bytes(buf[vs2:ve2])
    return key


def _renamed(rename: Callable[[bytes], bytes], entry: bytes) -> bytes:
    out = rename(entry)
    if not isinstance(out, bytes):
        raise ValueError("the rename hook must return bytes")
    return out


_MESH_AXIS = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*=\s*\d+')
MESHES = b"xla.sdy.meshes"
AXIS_SPANS = (b"#sdy", b"#stablehlo")  # the attributes whose quoted strings are mesh axes
_NAME = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.$")


def rename_axes(text: bytes, renames: dict[bytes, bytes], *, whole: bool = False) -> bytes:
    """`text` (attributes as MLIR prints them) with the mesh axes renamed
    where it names them as axes: a quoted string inside a Shardy attribute
    (#sdy.mesh<...>, #sdy.sharding<...>, #sdy<manual_axes{...}>...) or a
    StableHLO one that holds axis references. Every other quoted string (a
    memory kind, a layout mode, a custom call's target, a frontend attribute,
    a symbol @"name") stays as it is, whatever it spells: it is not an axis,
    and renaming it would give two different programs one key. `whole`:
    the text is all an axis span (an attribute that describes a mesh, as
    stablehlo.mesh = {axes = [{name = "x", size = 2}]} does)."""
    out = bytearray()
    floor = 1 if whole else 0
    i, n, depth = 0, len(text), floor  # depth: of < > inside an axis span
    while i < n:
        c = text[i]
        if c == 0x22:  # a quoted string, to its closing quote (\-escapes inside)
            j = i + 1
            while j < n and text[j] != 0x22:
                j += 2 if text[j] == 0x5C else 1
            name = text[i + 1:j]
            if depth and not (i and text[i - 1] == 0x40):  # (not a symbol: @"...")
                name = renames.get(name, name)
            out += b'"' + name + b'"'
            i = j + 1
            continue
        if depth == 0 and c == 0x23 and text.startswith(AXIS_SPANS, i):
            j = i + 1
            while j < n and text[j] in _NAME:
                j += 1
            if j < n and text[j] == 0x3C:  # '<': the span begins
                out += text[i:j + 1]
                depth, i = 1, j + 1
                continue
        elif depth and c == 0x3C:
            depth += 1
        elif depth > floor and c == 0x3E and text[i - 1] != 0x2D:  # '>' (not an arrow's: ->)
            depth -= 1
        out.append(c)
        i += 1
    return bytes(out)


def axis_renamer(module_bytes: bytes | memoryview) -> Callable[[bytes], bytes] | None:
    """The hook that writes a Shardy frontend attribute (an "xla.sdy."
    entry) with its mesh axes named by position ("axis0", "axis1"...), as
    the MLIR form's key has them (keys.mesh_axis_renames): a program whose
    mesh axes were renamed consistently compiles to the same executable.
    None when the module names no mesh, its axes are named so already, or
    its meshes disagree on a name's position (keyed by the names it has: a
    miss at worst). Reads the module's own fields only, not its computations."""
    buf = memoryview(module_bytes)
    meshes = b""
    for f, wire, _s, vs, ve, _v in fields(buf, 0, len(buf)):
        if f != 19 or wire != LEN:  # HloModuleProto.frontend_attributes
            continue
        for g, w, _s2, vs2, ve2, _v2 in fields(buf, vs, ve):
            if g != 1 or w != LEN:
                continue
            value = b""
            key = b""
            for h, w3, _s3, vs3, ve3, _v3 in fields(buf, vs2, ve2):
                if h == 1 and w3 == LEN:
                    key = bytes(buf[vs3:ve3])
                elif h == 2 and w3 == LEN:
                    value = bytes(buf[vs3:ve3])
            if key == MESHES:
                meshes = value
    renames: dict[bytes, bytes] = {}
    for mesh in meshes.split(b"#sdy.mesh<")[1:]:
        for i, name in enumerate(_MESH_AXIS.findall(mesh.split(b">", 1)[0])):
            if renames.setdefault(name, b"axis%d" % i) != b"axis%d" % i:
                return None
    if not any(old != new for old, new in renames.items()):
        return None

    def rename(entry: bytes) -> bytes:
        """A map entry {1: key, 2: value} with the value's quoted axis names
        renamed; written as a group (field 2 + RENAMED), so it can never
        read as an entry the program had."""
        key = value = b""
        tag_len = 0
        _tag, i = _read_varint(entry, 0, len(entry))
        _n, start = _read_varint(entry, i, len(entry))
        tag_len = start
        for h, w, _s, vs, ve, _v in fields(entry, tag_len, len(entry)):
            if h == 1 and w == LEN:
                key = entry[vs:ve]
            elif h == 2 and w == LEN:
                value = entry[vs:ve]
        value = rename_axes(value, renames)
        body = (varint((1 << 3) | LEN) + varint(len(key)) + key +
                varint((2 << 3) | LEN) + varint(len(value)) + value)
        return varint(((2 + RENAMED) << 3) | SGROUP) + body + varint(((2 + RENAMED) << 3) | EGROUP)

    return rename


def canonical_hlo_py(module_bytes: bytes, drops: tuple[int, ...] = (),
                     attributes: tuple[bytes, ...] = (), kernel: Any = None,
                     rename: Callable[[bytes], bytes] | None = None) -> bytes:
    """The reference implementation (pure Python). `drops`: field_drops()
    codes; `attributes`: frontend attribute keys to leave out; `kernel`: the
    hook that splits a tpu_custom_call's backend_config, or None."""
    m = _Module(bytes(module_bytes), drops, attributes, kernel, rename)
    out = bytearray()
    _emit(m, MODULE, 0, len(m.buf), out, None)
    return bytes(out)


_native: Callable[..., bytes] | None
_native_sha256: Callable[..., str] | None
try:
    from ._hlocanon import canonical_hlo as _native
    from ._hlocanon import canonical_hlo_sha256 as _native_sha256
except ImportError:  # not built (a source checkout): same bytes, slower
    _native = _native_sha256 = None


def canonical_hlo(module_bytes: bytes, drops: tuple[int, ...] = (),
                  attributes: tuple[bytes, ...] = (), kernel: Any = None,
                  rename: Callable[[bytes], bytes] | None = None) -> bytes:
    """Canonical bytes of an HloModuleProto; ValueError if it is malformed.
    `rename`: axis_renamer's hook for the module, or None."""
    if _native is not None:
        return _native(module_bytes, drops, attributes, kernel, rename)
    return canonical_hlo_py(module_bytes, drops, attributes, kernel, rename)


def canonical_sha256(module_bytes: bytes | memoryview, drops: tuple[int, ...] = (),
                     attributes: tuple[bytes, ...] = (), kernel: Any = None,
                     rename: Callable[[bytes], bytes] | None = None) -> str:
    """sha256 (hex) of `canonical_hlo(...)`. The C version hashes as it goes
    and never holds the canonical module."""
    if _native_sha256 is not None:
        return _native_sha256(module_bytes, drops, attributes, kernel, rename)
    return hashlib.sha256(canonical_hlo_py(bytes(module_bytes), drops, attributes,
                                           kernel, rename)).hexdigest()
