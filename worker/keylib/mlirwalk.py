"""The canonical stream of an MLIR module: what a program key hashes.

One walk over the module, in operation order, writes what can change the
executable and nothing else. The grammar (varint: LEB128; str: varint length
and UTF-8 bytes; ref: varint 0 followed by the content on first sight, the
first sighting's index + 1 after; identifiers, types and attributes have one
index space each):

    op      := 'O' ref(name) varint(#operands) use* varint(#results) (def ref(type))*
               varint(#attrs) (ref(attr name) value)* varint(#successors) block*
               varint(#regions) region*
    region  := varint(#blocks) (varint(#args) (def ref(type))* op* 'Z')*
    use/def := varint(0) for a value not seen before (it takes the next value
               number), varint(1) ref(attr) for a constant, else varint(number + 2)
    block   := varint(block number + 1), 0 for a block not numbered yet (blocks are
               numbered in walk order, all of a region's as the walk enters it)
    value   := 'r' ref(attr) | 'S' str (a renamed sym_name) | 'F' filtered
             | 'K' str(before) str(kernel) str(after)  (the backend_config of a
               tpu_custom_call, split by the kernel hook: worker/keylib/mosaic.py)
    filtered:= varint(#dicts) ('D' varint(#kept) (ref(name) ref(attr))* | 'r' ref(attr))*
    attr    := 'R' str (a flat symbol reference, renamed when private)
             | 'A' varint(n) ref(attr)*            (arrays)
             | 'D' varint(n) (ref(name) ref(attr))*  (dictionaries)
             | 'E' ref(type) byte(splat) str(raw)  (dense int/float elements of
                                                    8/16/32/64-bit integers or f16/f32/f64)
             | 'T' str(printed)                    (any other attribute, as MLIR prints it)
    type    := str(printed)

Every field of the grammar is length-prefixed or counted, so two different
streams never parse the same: the stream is injective over what it covers.

What it leaves out, besides the three rewrites below, is what canonicalization
drops (docs/keys.md): locations (never visited), SSA names (values are numbers),
the module's sym_name, the ignore list on the module and its functions (and
in their arg_attrs/res_attrs), and private function names (renamed f0, f1, ...
in order of appearance, everywhere they are referenced). MLIR prints types and
attributes completely (floats so that they parse back to the same bits, and
no element is elided unless asked, which nothing here does); dense constants
of the common element types are hashed from their raw bytes instead.
Refused, by both walks alike (ValueError): a dense_resource constant (its
printed form names a blob without its bytes: ResourceRefused, and
keys.program_digest keys such a module by its stripped bytecode) and nesting
deeper than MAX_NESTING; the C walk also refuses a name that is not UTF-8, on
which jaxlib's Python bindings abort the process.

The three rewrites, which never change what a program computes, leave the stream as
it was, so that a module and the same module after XLA's C-API client
canonicalized it for a plugin (worker/pjrtdoor/pjrtkeys.py) stream alike:
- a constant (`stablehlo.constant` with its `value` alone) is written where it
  is used, as its value, never where it is defined: where constants sit, and
  whether equal constants are one op or several, does not count;
- a `stablehlo.convert` to its operand's own type is its operand;
- a `precision_config` of DEFAULT precisions only is left out (the default).

This module is the reference walk, through jaxlib's Python bindings;
worker/keylib/mlircanon.py chooses between it and the C walk (`_mlircanon.c`), which
writes the same bytes.
"""

from __future__ import annotations

from typing import Any, cast

from .hlocanon import checked_split

STREAM_VERSION = "4"
RESOURCE_REFUSED = "the module holds dense_resource constants (bytes outside the walk)"


class BindingsRefused(ValueError):
    """The Python walk cannot read an attribute that jaxlib's bindings fail to
    cast (complex dense constants, in jaxlib 0.10): a process without the C
    walk compiles such a program locally; the C walk keys it."""


NESTED_REFUSED = "operations or attributes nested too deeply"


class NestingRefused(ValueError):
    """A module nested deeper than MAX_NESTING: the walk stops (its recursion
    is bounded); keys.program_digest keys such a module by its canonicalized
    bytecode."""


class ResourceRefused(ValueError):
    """A module whose constants live in resources: their printed form names a
    blob without its bytes, so the walk refuses it (keys.program_digest keys
    such a module by its stripped bytecode, which carries the blobs)."""
_ELEMENT_BITS = (8, 16, 32, 64)
DEFAULT_PRECISION = "#stablehlo<precision DEFAULT>"
MAX_NESTING = 200  # operations in regions, or attributes in attributes (as _mlircanon.c); 200
# levels of both stay within Python's recursion limit in the reference


def ir_bindings() -> Any:
    from ..xla.jax_adapter import ir  # pyright: ignore[reportPrivateImportUsage] (jax's, on purpose)
    return ir


# -- private function renames (shared by both paths) ---------------------------

def private_renames(module: Any) -> dict[str, str]:
    """Private functions of the module's body, renamed f0, f1, ... in order of
    appearance; {} when a new name would be a public function's name (the
    module keeps its names: a miss at worst, never a collision)."""
    ir = ir_bindings()
    mapping: dict[str, str] = {}
    public: set[str] = set()
    for op in module.operation.regions[0].blocks[0].operations:
        attrs = op.operation.attributes
        if "sym_name" not in attrs:
            continue
        name = ir.StringAttr(attrs["sym_name"]).value
        if "sym_visibility" in attrs and ir.StringAttr(attrs["sym_visibility"]).value == "private":
            mapping[name] = f"f{len(mapping)}"
        else:
            public.add(name)
    public -= set(mapping)
    if public & set(mapping.values()):
        return {}
    return mapping


# -- the reference -----------------------------------------------------------------

class _Stream:
    def __init__(self, hasher: Any, ignore: frozenset[str], renames: dict[str, str],
                 kernel: Any = None) -> None:
        self.ir = ir_bindings()
        self.kernel = kernel
        self.h = hasher
        self.buf = bytearray()
        self.ignore = ignore
        self.renames = renames
        self.idents: dict[str, int] = {}
        self.types: dict[Any, int] = {}
        self.attrs: dict[Any, int] = {}
        self.values: dict[Any, int] = {}
        self.constants: dict[Any, Any] = {}  # a constant's result -> its value attribute
        self.same: dict[Any, Any] = {}  # an identity convert's result -> its operand
        self.blocks: dict[Any, int] = {}
        self.attr_depth = 0

    def flush(self) -> None:
        self.h.update(bytes(self.buf))
        self.buf.clear()

    def varint(self, v: int) -> None:
        if v < 0x80:  # most are: counts, small indexes
            self.buf.append(v)
            return
        while True:
            b = v & 0x7F
            v >>= 7
            self.buf.append(b | 0x80 if v else b)
            if not v:
                return

    def string(self, s: str | bytes) -> None:
        b = s.encode() if isinstance(s, str) else s
        self.varint(len(b))
        self.buf += b
        if len(self.buf) > 1 << 18:
            self.flush()

    def intern(self, table: dict[Any, int], k: Any) -> bool:
        idx = table.get(k)
        if idx is not None:
            self.varint(idx + 1)
            return False
        table[k] = len(table)
        self.varint(0)
        return True

    @staticmethod
    def named(container: Any) -> list[tuple[str, Any]]:
        """(name, attribute) of an op's attributes or a DictAttr, in order.
        Read by name: jaxlib's bindings abort the process on
        NamedAttribute.attr of an attribute they cannot cast (a complex dense
        constant), while a read by name raises TypeError (BindingsRefused)."""
        names = [container[i].name for i in range(len(container))]
        return [(n, container[n]) for n in names]

    def ident(self, name: str) -> None:
        idx = self.idents.get(name)  # intern(), inlined: the walk's commonest call
        if idx is None:
            self.idents[name] = len(self.idents)
            self.buf.append(0)
            self.string(name)
        elif idx < 0x7F:
            self.buf.append(idx + 1)
        else:
            self.varint(idx + 1)

    def type(self, t: Any) -> None:
        if self.intern(self.types, t):
            self.string(str(t))

    def attr(self, a: Any) -> None:
        if self.intern(self.attrs, a):
            self.attr_depth += 1
            if self.attr_depth > MAX_NESTING:
                raise NestingRefused(NESTED_REFUSED)
            self.attr_content(a)
            self.attr_depth -= 1

    def dense_raw(self, a: Any) -> bytes | None:
        ir = self.ir
        if not (isinstance(a, ir.DenseIntElementsAttr) or isinstance(a, ir.DenseFPElementsAttr)):
            return None
        et = ir.ShapedType(a.type).element_type
        if isinstance(et, ir.IntegerType):
            if ir.IntegerType(et).width not in _ELEMENT_BITS:
                return None
        elif not (isinstance(et, ir.F16Type) or isinstance(et, ir.F32Type)
                  or isinstance(et, ir.F64Type)):
            return None
        import numpy as np
        arr = np.asarray(a)
        if a.is_splat:
            arr = arr.reshape(-1)[:1]
        return np.ascontiguousarray(arr).tobytes()

    def attr_content(self, a: Any) -> None:
        ir = self.ir
        if isinstance(a, ir.FlatSymbolRefAttr):
            name = cast(str, ir.FlatSymbolRefAttr(a).value)
            self.buf += b"R"
            self.string(self.renames.get(name, name))
        elif isinstance(a, ir.ArrayAttr):
            items = list(ir.ArrayAttr(a))
            self.buf += b"A"
            self.varint(len(items))
            for item in items:
                self.attr(item)
        elif isinstance(a, ir.DictAttr):
            entries = self.named(ir.DictAttr(a))
            self.buf += b"D"
            self.varint(len(entries))
            for name, value in entries:
                self.ident(name)
                self.attr(value)
        elif (raw := self.dense_raw(a)) is not None:
            self.buf += b"E"
            self.type(a.type)
            self.buf.append(1 if a.is_splat else 0)
            self.flush()
            self.varint(len(raw))
            self.flush()
            self.h.update(raw)
        else:
            text = str(a)
            if text.startswith("dense_resource<"):  # as in _mlircanon.c
                raise ResourceRefused(RESOURCE_REFUSED)
            self.buf += b"T"
            self.string(text)

    def rule(self, name: str, a: Any, depth: int) -> int:
        """0 dropped, 1 kept, 2 a renamed sym_name, 3 filtered arg/res attrs
        (as attr_rule in _mlircanon.c)."""
        ir = self.ir
        if depth > 1:
            return 1
        if depth == 0 and name == "sym_name":
            return 0
        if name in self.ignore:
            return 0
        if depth == 1 and name == "sym_name" and isinstance(a, ir.StringAttr) and \
                ir.StringAttr(a).value in self.renames:
            return 2
        if self.ignore and name in ("arg_attrs", "res_attrs") and isinstance(a, ir.ArrayAttr):
            return 3
        return 1

    def filtered(self, a: Any) -> None:
        ir = self.ir
        items = list(ir.ArrayAttr(a))
        self.buf += b"F"
        self.varint(len(items))
        for d in items:
            if not isinstance(d, ir.DictAttr):
                self.buf += b"r"
                self.attr(d)
                continue
            kept = [(n, v) for n, v in self.named(ir.DictAttr(d)) if n not in self.ignore]
            self.buf += b"D"
            self.varint(len(kept))
            for name, value in kept:
                self.ident(name)
                self.attr(value)

    def tpu_kernel_call(self, name: str, attrs: Any) -> bool:
        """A Pallas/Mosaic TPU kernel call (as is_tpu_kernel_call in _mlircanon.c);
        op() asks only when a kernel hook is set."""
        if name != "stablehlo.custom_call" or "call_target_name" not in attrs:
            return False
        target = attrs["call_target_name"]
        return isinstance(target, self.ir.StringAttr) and \
            self.ir.StringAttr(target).value_bytes == b"tpu_custom_call"

    def kernel_value(self, a: Any) -> bool:
        """'K' and the config as the kernel hook splits it; False when the hook
        keeps it whole (the caller writes the attribute as usual)."""
        if not isinstance(a, self.ir.StringAttr):
            return False
        parts = checked_split(self.kernel, self.ir.StringAttr(a).value_bytes)
        if parts is None:
            return False
        self.buf += b"K"
        for p in parts:
            self.string(p)
        return True

    def values_of(self, vs: Any, typed: bool) -> None:
        """varint(#vs), then each value as a use/def, with its type when typed
        (the hot loop of the walk, inlined)."""
        buf, values, varint = self.buf, self.values, self.varint
        n = len(vs)
        if n < 0x80:
            buf.append(n)
        else:
            varint(n)
        same, constants = self.same, self.constants
        for v in vs:
            v = same.get(v, v)
            if v in constants:
                buf.append(1)
                self.attr(constants[v])
                continue
            idx = values.get(v)
            if idx is None:
                values[v] = len(values)
                buf.append(0)
            elif idx < 0x7E:
                buf.append(idx + 2)
            else:
                varint(idx + 2)
            if typed:
                t = v.type
                idx = self.types.get(t)
                if idx is None:
                    self.types[t] = len(self.types)
                    buf.append(0)
                    self.string(str(t))
                elif idx < 0x7F:
                    buf.append(idx + 1)
                else:
                    varint(idx + 1)

    def elided(self, op: Any, opname: str) -> bool:
        """A constant, or a convert to its operand's type: written where used."""
        if len(op.results) != 1 or len(op.regions):
            return False
        attrs = op.attributes
        if opname == "stablehlo.constant":
            if len(op.operands) or len(attrs) != 1 or "value" not in attrs:
                return False
            self.constants[op.results[0]] = attrs["value"]
            return True
        if len(op.operands) != 1 or len(attrs) or op.operands[0].type != op.results[0].type:
            return False
        operand = op.operands[0]
        self.same[op.results[0]] = self.same.get(operand, operand)
        return True

    def default_precision(self, a: Any) -> bool:
        ir = self.ir
        return isinstance(a, ir.ArrayAttr) and \
            all(str(e) == DEFAULT_PRECISION for e in ir.ArrayAttr(a))

    def op(self, op: Any, depth: int) -> None:
        if depth > MAX_NESTING:
            raise NestingRefused(NESTED_REFUSED)
        opname = op.name
        if opname in ("stablehlo.constant", "stablehlo.convert") and self.elided(op, opname):
            return
        buf = self.buf
        buf += b"O"
        self.ident(opname)
        self.values_of(op.operands, False)
        self.values_of(op.results, True)
        attrs = op.attributes
        names = attrs.keys()  # names only: see named() on reading attributes
        if "precision_config" in names and self.default_precision(attrs["precision_config"]):
            names = [n for n in names if n != "precision_config"]
        kernel_call = self.kernel is not None and self.tpu_kernel_call(opname, attrs)
        if depth > 1:  # below the module's functions every attribute is kept
            n = len(names)
            if n < 0x80:
                buf.append(n)
            else:
                self.varint(n)
            for name in names:
                self.ident(name)
                a = attrs[name]
                if kernel_call and name == "backend_config" and self.kernel_value(a):
                    continue
                buf += b"r"
                self.attr(a)
        else:
            named = [(n, attrs[n]) for n in names]
            rules = [self.rule(name, value, depth) for name, value in named]
            self.varint(sum(1 for r in rules if r))
            for (name, value), r in zip(named, rules, strict=True):
                if not r:
                    continue
                self.ident(name)
                if r == 1:
                    if kernel_call and name == "backend_config" and self.kernel_value(value):
                        continue
                    buf += b"r"
                    self.attr(value)
                elif r == 2:
                    buf += b"S"
                    self.string(self.renames[self.ir.StringAttr(value).value])
                else:
                    self.filtered(value)
        successors = op.successors
        if successors:
            self.varint(len(successors))
            for b in successors:
                idx = self.blocks.get(b)
                self.varint(0 if idx is None else idx + 1)
        else:
            buf.append(0)
        regions = op.regions
        if not regions:
            buf.append(0)
            return
        self.varint(len(regions))
        for region in regions:
            blocks = list(region.blocks)
            for b in blocks:
                self.blocks[b] = len(self.blocks)
            self.varint(len(blocks))
            for b in blocks:
                self.values_of(b.arguments, True)
                for child in b.operations:
                    self.op(child.operation, depth + 1)
                self.buf += b"Z"


def stream_py(module: Any, hasher: Any, ignore: frozenset[str],
              renames: dict[str, str] | None, kernel: Any = None) -> None:
    """The canonical stream of `module`, fed to hasher.update (the reference).
    renames None: the module's private_renames. kernel: the hook that splits
    a tpu_custom_call's backend_config (worker/keylib/mosaic.py), or None."""
    s = _Stream(hasher, ignore, private_renames(module) if renames is None else renames, kernel)
    try:
        s.op(module.operation, 0)
    except TypeError as e:  # what jaxlib's bindings cannot cast (the C walk reads it)
        raise BindingsRefused(f"jaxlib's Python bindings cannot read this module: {e}") from e
    s.flush()
