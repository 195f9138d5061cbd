"""The HloModuleProto canonicalizer: the C fast path against the Python
reference, and what the canonical form keeps and drops, on real modules (JAX
lowerings, the PyTorch/XLA dumps) and on modules written field by field."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilecast.worker.keylib import hlocanon
from compilecast.worker.keylib.keys import hlo_module_bytes, program_key

FIXTURES = Path(__file__).parent / "fixtures" / "torch_xla"
needs_native = pytest.mark.skipif(hlocanon._native is None, reason="checked by the test below")


def test_native_extension_is_built():
    # `pip install` builds it (pyproject: ext-modules); without a C compiler the
    # package still works through the Python reference, only slower.
    assert hlocanon._native is not None, "worker/keylib/_hlocanon.c was not built"


# -- a tiny protobuf writer for hand-made modules --------------------------------

def tag(number: int, wire: int) -> bytes:
    return hlocanon.varint((number << 3) | wire)


def vint(number: int, value: int) -> bytes:
    return tag(number, 0) + hlocanon.varint(value)


def ln(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + hlocanon.varint(len(payload)) + payload


def packed(number: int, values: list[int]) -> bytes:
    return ln(number, b"".join(hlocanon.varint(v) for v in values))


def attrs(pairs: list[tuple[str, str]]) -> bytes:
    """FrontendAttributes: map<string, string> map = 1, entries in this order."""
    return b"".join(ln(1, ln(1, k.encode()) + ln(2, v.encode())) for k, v in pairs)


def instruction(iid: int, opcode: str, operands: list[int], *, name: str = "",
                meta: bytes = b"", calls: list[int] = (), sharding: bytes = b"",
                frontend: bytes = b"", stats: bytes = b"") -> bytes:
    out = ln(1, name.encode()) if name else b""
    out += ln(2, opcode.encode())
    out += ln(3, vint(2, 11) + packed(3, [4]))  # f32[4]
    if meta:
        out += ln(7, meta)
    if iid:  # proto3: id 0 is not written
        out += vint(35, iid)
    if operands:
        out += packed(36, operands)
    if calls:
        out += packed(38, list(calls))
    if sharding:
        out += ln(40, sharding)
    if frontend:
        out += ln(68, frontend)
    if stats:
        out += ln(82, stats)
    return out


def computation(cid: int, name: str, instrs: list[bytes], root: int,
                param_names: tuple[str, ...] = ()) -> bytes:
    shape = b"".join(ln(3, n.encode()) for n in param_names)
    out = ln(1, name.encode()) + b"".join(ln(2, i) for i in instrs) + ln(4, shape)
    if cid:
        out += vint(5, cid)
    if root:
        out += vint(6, root)
    return out


def module(ids: dict[str, int], *, names: str = "a", meta: str = "x.py",
           constant: int = 7, schedule_order: tuple[int, ...] = (0, 1),
           sharding_meta: str = "s", frames: str = "f", swap: bool = False,
           table: tuple[int, ...] = (), frontend: tuple[tuple[str, str], ...] = (),
           stats: bytes = b"") -> bytes:
    """A two-computation module (a reducer and an entry that calls it) with
    every id, name and piece of metadata a parameter."""
    m = lambda op: ln(1, b"op") + ln(2, f"{meta}/{op}".encode()) + ln(3, meta.encode()) + \
        vint(4, len(meta))  # noqa: E731
    shard = vint(1, 3) + packed(3, [2, 1]) + ln(7, ln(2, sharding_meta.encode()))
    reducer = computation(ids["r"], f"{names}_add", [
        instruction(ids["r0"], "parameter", [], name=f"{names}.p0", meta=m("p0")),
        instruction(ids["r1"], "parameter", [], name=f"{names}.p1", meta=m("p1")),
        instruction(ids["r2"], "subtract", [ids["r1"], ids["r0"]] if swap else [ids["r0"], ids["r1"]],
                    name=f"{names}.sub", meta=m("sub")),
    ], ids["r2"], (f"{names}_x", f"{names}_y"))
    entry = computation(ids["e"], f"{names}_main", [
        instruction(ids["e0"], "parameter", [], name=f"{names}.arg", meta=m("arg"),
                    sharding=shard),
        instruction(ids["e1"], "constant", [], name=f"{names}.c", meta=m("c")) +
        ln(8, vint(2, 0) + packed(4, [constant, *table])),
        instruction(ids["e2"], "reduce", [ids["e0"], ids["e1"]], name=f"{names}.red",
                    meta=m("reduce"), calls=[ids["r"]], frontend=attrs(list(frontend)),
                    stats=stats),
    ], ids["e2"], (f"{names}_arg",))
    seqs = {0: (ids["r"], [ids["r0"], ids["r1"], ids["r2"]]),
            1: (ids["e"], [ids["e0"], ids["e1"], ids["e2"]])}
    schedule = b"".join(ln(1, vint(1, seqs[i][0]) + ln(2, packed(1, seqs[i][1])))
                        for i in schedule_order)
    return (ln(1, f"{names}_module".encode()) + ln(2, f"{names}_main".encode()) +
            ln(3, reducer) + ln(3, entry) + vint(5, len(names) + 40) + vint(6, ids["e"]) +
            ln(7, schedule) + ln(17, ln(1, frames.encode())))


IDS = {"r": 3, "r0": 10, "r1": 11, "r2": 12, "e": 4, "e0": 20, "e1": 21, "e2": 22}


def both(data: bytes, *config) -> bytes:
    """Canonical bytes, asserting the C and Python implementations agree
    (including on refusing the input). `config`: (drops, attributes)."""
    try:
        ref = hlocanon.canonical_hlo_py(data, *config)
    except (ValueError, RecursionError) as exc:
        if hlocanon._native is not None:
            with pytest.raises(ValueError):
                hlocanon._native(data, *config)
            with pytest.raises(ValueError):
                hlocanon._native_sha256(data, *config)
        raise ValueError(str(exc)) from exc
    if hlocanon._native is not None:
        assert hlocanon._native(data, *config) == ref
        assert hlocanon._native_sha256(data, *config) == hashlib.sha256(ref).hexdigest()
    return ref


# -- what is dropped and what is kept ----------------------------------------------

def test_names_metadata_ids_and_schedule_order_do_not_change_the_bytes():
    base = both(module(IDS))
    renumbered = {k: v * 1000 + 5 for k, v in IDS.items()}
    assert both(module(renumbered)) == base
    assert both(module(IDS, names="other")) == base
    assert both(module(IDS, meta="/elsewhere/model.py")) == base
    assert both(module(IDS, sharding_meta="from another op")) == base
    assert both(module(IDS, frames="other frames")) == base
    assert both(module(IDS, schedule_order=(1, 0))) == base


def test_frontend_attributes_are_a_map_in_any_order():
    a = both(module(IDS, frontend=(("_xla_compute_type", "host"), ("_scope", "layer1"))))
    b = both(module(IDS, frontend=(("_scope", "layer1"), ("_xla_compute_type", "host"))))
    assert a == b
    assert both(module(IDS, frontend=(("_xla_compute_type", "dev"), ("_scope", "layer1")))) != a


def test_frontend_attributes_on_the_ignore_list_are_dropped():
    config = ((), (b"_scope",))
    a = both(module(IDS, frontend=(("_xla_compute_type", "host"), ("_scope", "layer1"))), *config)
    b = both(module(IDS, frontend=(("_xla_compute_type", "host"), ("_scope", "layer7"))), *config)
    c = both(module(IDS, frontend=(("_xla_compute_type", "dev"), ("_scope", "layer1"))), *config)
    assert a == b != c
    unconfigured = both(module(IDS, frontend=(("_xla_compute_type", "host"), ("_scope", "layer7"))))
    assert unconfigured != both(module(IDS, frontend=(("_xla_compute_type", "host"),
                                                      ("_scope", "layer1"))))


def test_configured_fields_are_dropped_and_only_known_ones():
    drops = hlocanon.field_drops(["instruction.statistics_viz"])
    a, b = module(IDS, stats=ln(1, b"x")), module(IDS, stats=ln(1, b"y"))
    assert both(a) != both(b)
    assert both(a, drops, ()) == both(b, drops, ()) == both(module(IDS), drops, ())
    with pytest.raises(ValueError, match=r"unknown HLO field 'instruction\.id'"):
        hlocanon.field_drops(["instruction.id"])  # renumbered, never dropped


def test_id_zero_is_an_id_like_any_other():
    base = both(module(IDS))
    zero = dict(IDS, r0=0, e=0)  # proto3 leaves zero ids off the wire
    assert both(module(zero)) == base


def test_what_changes_the_program_changes_the_bytes():
    base = both(module(IDS))
    assert both(module(IDS, constant=8)) != base
    assert both(module(IDS, swap=True)) != base  # operand order


def test_a_dangling_reference_keeps_its_raw_value():
    base = module(IDS)
    broken = base.replace(packed(36, [10, 11]), packed(36, [10, 99]))
    assert broken != base
    b, c = both(broken), both(broken.replace(packed(36, [10, 99]), packed(36, [10, 98])))
    assert both(base) != b and b != c  # unresolved 99 and 98 stay apart


@pytest.mark.parametrize("bad", [
    b"",  # no computations
    ln(3, computation(1, "a", [instruction(5, "add", []), instruction(5, "add", [])], 5)),
    ln(3, computation(1, "a", [], 0)) + ln(3, computation(1, "b", [], 0)),
    ln(3, b"\x0a\x05ab"),  # truncated field
    b"\x0b\x0c",  # groups are not used by XLA
])
def test_malformed_modules_are_refused_and_keyed_raw(bad):
    with pytest.raises(ValueError):
        both(bad)
    assert program_key(bad).components["program_format"] == "raw"


@pytest.mark.parametrize("innermost", [vint(1, 0), b""])
def test_deeply_nested_shardings_are_refused_not_a_crash(innermost):
    s = innermost
    for _ in range(hlocanon.MAX_DEPTH + 5):
        s = ln(5, s)
    data = ln(3, computation(1, "a", [instruction(1, "parameter", [], sharding=s)], 1))
    with pytest.raises(ValueError):
        both(data)


# -- the two implementations agree -------------------------------------------------

def lowered_hlo(fn, *args) -> bytes:
    return jax.jit(fn).lower(*args).compiler_ir("hlo").as_serialized_hlo_module_proto()


def test_forward_references_resolve_like_backward_ones():
    # XLA writes callees before callers and operands before users; the C code
    # relies on that for its single pass and must fall back to two passes,
    # with the same bytes, when a module does not.
    data = module(IDS)
    fields = list(hlocanon.fields(data, 0, len(data)))
    comps = [data[s:e] for f, _w, s, _vs, e, _v in fields if f == 3]
    rest = b"".join(data[s:e] for f, _w, s, _vs, e, _v in fields if f != 3)
    reordered = comps[1] + comps[0] + rest  # the entry (the caller) first
    out = both(reordered)
    assert out != both(data)  # positions moved with the computations
    marker = hlocanon.varint(((38 + hlocanon.UNRESOLVED) << 3) | 0)
    assert marker not in out  # the call still resolved


def test_the_streamed_digest_covers_chunks_and_large_constants():
    # Longer than the C code's 256 KiB hashing chunk, with one constant that
    # is hashed straight from the input.
    big = module(IDS, table=tuple(range(200_000)))
    assert len(big) > 300_000
    edited = module(IDS, table=(*range(199_999), 1))
    assert both(big) != both(edited) != both(module(IDS))


@pytest.mark.parametrize("innermost", [vint(1, 0), b""])
def test_agree_at_the_nesting_limit(innermost):
    refused = []
    for wrappers in range(hlocanon.MAX_DEPTH - 5, hlocanon.MAX_DEPTH + 1):
        s = innermost
        for _ in range(wrappers):
            s = ln(5, s)
        data = ln(3, computation(1, "a", [instruction(1, "parameter", [], sharding=s)], 1))
        try:
            both(data)  # the same bytes, or refused by both
        except ValueError:
            refused.append(wrappers)
    assert refused and refused[0] > hlocanon.MAX_DEPTH - 5  # the limit lies inside the range


def test_agree_on_real_modules():
    real = [hlo_module_bytes(p.read_bytes()) for p in sorted(FIXTURES.glob("*.pb"))]
    x = jnp.ones((8, 8))
    real.append(lowered_hlo(lambda a: jnp.linalg.cholesky(a @ a.T + 8 * jnp.eye(8)), x))
    real.append(lowered_hlo(lambda a: jax.lax.fori_loop(0, 3, lambda i, v: v @ a, a), x))
    assert len(real) >= 8
    for data in real:
        out = both(data)
        assert len(out) < len(data)  # names and metadata went


REAL = hlo_module_bytes((FIXTURES / "mlp.hlo.pb").read_bytes())


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(REAL) - 1), st.integers(0, 255)),
                min_size=1, max_size=4))
def test_agree_on_corrupted_modules(edits):
    data = bytearray(REAL)
    for at, value in edits:
        data[at] = value
    try:
        both(bytes(data))
    except ValueError:
        pass  # refused by both: checked inside `both`


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_agree_on_random_ids(seed):
    rng = random.Random(seed)
    ids = {k: rng.choice([0, rng.randrange(1, 2**63)]) for k in IDS}
    if len(set(ids[k] for k in ("r0", "r1", "r2"))) < 3 or \
            len(set(ids[k] for k in ("e0", "e1", "e2"))) < 3 or ids["r"] == ids["e"]:
        return
    order = (0, 1) if rng.random() < 0.5 else (1, 0)
    assert both(module(ids, schedule_order=order)) == both(module(IDS))
