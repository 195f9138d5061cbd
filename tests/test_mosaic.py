"""Pallas/Mosaic TPU kernels inside a program (worker/keylib/mosaic.py): their
locations never change a key, anything else in them always does, and both
canonical walks write the same stream for them. The kernels are real Pallas
kernels, lowered for TPU by JAX on this CPU machine."""

from __future__ import annotations

import base64
import hashlib
import re

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilecast.worker.keylib import hlocanon, mlircanon, mosaic
from compilecast.worker.keylib.keys import KeyConfig, program_digest, program_key

pl = pytest.importorskip("jax.experimental.pallas")
pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

SPEC = jax.ShapeDtypeStruct((8, 128), jnp.float32)
KERNEL = """
def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * SCALE + y_ref[...]
"""


def lowered(scale: str = "2.0", line: int = 0, path: str = "/src/model.py",
            vmem: int | None = None, calls: int = 1, ir: str = "stablehlo"):
    """The StableHLO module (or with ir="hlo" the serialized HloModuleProto)
    of a jitted function calling a Pallas kernel defined at `line` of `path`
    (as if from that file)."""
    ns: dict = {}
    exec(compile("\n" * line + KERNEL.replace("SCALE", scale), path, "exec"), ns)
    params = {} if vmem is None else {"compiler_params": pltpu.CompilerParams(
        vmem_limit_bytes=vmem)}
    call = pl.pallas_call(ns["kernel"], out_shape=SPEC, **params)

    def f(x, y):
        for _ in range(calls):
            x = call(x, y)
        return x

    low = jax.jit(f).trace(SPEC, SPEC).lower(lowering_platforms=("tpu",))
    if ir == "hlo":
        return low.compiler_ir("hlo").as_serialized_hlo_module_proto()
    return low.compiler_ir("stablehlo")


def key(module) -> str:
    return program_digest(module, KeyConfig())[0]


def config_of(module) -> bytes:
    """The backend_config of the module's (first) tpu_custom_call."""
    found = []

    def visit(op):
        if op.name == "stablehlo.custom_call" and \
                op.attributes["call_target_name"].value == "tpu_custom_call":
            found.append(op.attributes["backend_config"].value_bytes)
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    visit(child.operation)

    visit(module.operation)
    assert found, "no tpu_custom_call in the module"
    return found[0]


def test_a_kernel_holds_its_source_locations():
    # What the canonicalization is for: the kernel's bytecode names its file.
    body = re.search(rb'"body"\s*:\s*"([^"]*)"', config_of(lowered(path="/src/model.py")))
    assert b"/src/model.py" in base64.b64decode(body.group(1))


def test_kernel_locations_never_change_a_key():
    first = key(lowered())
    assert key(lowered(line=40)) == first
    assert key(lowered(path="/elsewhere/other_checkout/model.py")) == first


def test_the_metadata_switch_puts_kernel_locations_back():
    cfg = KeyConfig(include_metadata=True)
    assert program_digest(lowered(), cfg)[0] != program_digest(lowered(line=40), cfg)[0]


@pytest.mark.parametrize("change", ["constant", "vmem limit", "calls"])
def test_what_changes_a_kernel_changes_the_key(change):
    base = key(lowered())
    other = {"constant": lambda: lowered(scale="3.0"),
             "vmem limit": lambda: lowered(vmem=1 << 20),  # outside the body, in the config
             "calls": lambda: lowered(calls=2)}[change]()
    assert key(other) != base


def test_both_walks_agree_on_kernels():
    assert mlircanon.bind_here() is not None
    ignore = frozenset(KeyConfig().ignore_attributes)
    for module in (lowered(), lowered(line=7, vmem=1 << 21), lowered(calls=3)):
        c, py = hashlib.sha256(), hashlib.sha256()
        mlircanon._native.canonical_stream(module._CAPIPtr, c, ignore, None, mosaic.kernel_part)
        with module.context:
            mlircanon.stream_py(module, py, ignore, None, mosaic.kernel_part)
        assert c.hexdigest() == py.hexdigest()


def test_the_config_is_split_around_the_body_and_kept_byte_for_byte():
    config = config_of(lowered(vmem=1 << 20))
    before, digest, after = mosaic.kernel_part(config)
    body = re.search(rb'"body"\s*:\s*"([^"]*)"', config).group(1)
    assert before + body + after == config
    assert len(digest) == 32 and digest not in config


@pytest.mark.parametrize("config", [
    b'{"custom_call_config": {"serialization_format": 1}}',  # no body
    b'{"custom_call_config": {"body": "not base64!"}}',  # not the body's alphabet
    b'{"custom_call_config": {"body": "AAAA"}}',  # base64, not MLIR bytecode
    b'{"custom_call_config": {"body": "' + base64.b64encode(b"module {}") + b'"}}',  # MLIR text
    b'{"a": {"body": "AAAA"}, "b": {"body": "AAAA"}}',  # two bodies
])
def test_a_config_it_cannot_read_is_kept_whole(config):
    assert mosaic.kernel_part(config) is None


def test_a_body_that_does_not_parse_keeps_the_whole_config_in_the_key():
    # The stream then holds the attribute as it is, so two such configs that
    # differ anywhere get two keys.
    module = lowered()
    broken = base64.b64encode(b"ML\xefR not really bytecode")
    with module.context:
        h_kept = hashlib.sha256()
        mlircanon.stream_py(module, h_kept, frozenset(), None, lambda config: None)
        h_hook = hashlib.sha256()
        mlircanon.stream_py(module, h_hook, frozenset(), None,
                            lambda config: mosaic.kernel_part(
                                re.sub(rb'"body"\s*:\s*"[^"]*"', b'"body": "' + broken + b'"',
                                       config)))
    assert h_hook.hexdigest() == h_kept.hexdigest()


@pytest.mark.parametrize("walk", ["c", "python"])
def test_a_hook_that_returns_nonsense_is_an_error(walk):
    module = lowered()
    with pytest.raises(ValueError, match="kernel hook must return"):
        if walk == "c":
            assert mlircanon.bind_here() is not None
            mlircanon._native.canonical_stream(module._CAPIPtr, hashlib.sha256(), frozenset(),
                                               None, lambda config: ("a", "b"))
        else:
            with module.context:
                mlircanon.stream_py(module, hashlib.sha256(), frozenset(), None,
                                    lambda config: ("a", "b"))


# -- the same kernels in HLO protos (PyTorch/XLA's Pallas kernels come this way) ----

def hlo_key(**kw) -> str:
    key = program_key(lowered(ir="hlo", **kw))
    assert key.components["program_format"] == "hlo-proto"
    return key.value


def test_kernel_locations_never_change_an_hlo_key():
    first = hlo_key()
    assert hlo_key(line=40) == first
    assert hlo_key(path="/elsewhere/model.py") == first
    # and without the hook they would
    drops, attrs = KeyConfig().hlo_config
    a, b = lowered(ir="hlo"), lowered(ir="hlo", line=40)
    assert hlocanon.canonical_sha256(a, drops, attrs) != hlocanon.canonical_sha256(b, drops, attrs)


@pytest.mark.parametrize("change", [{"scale": "3.0"}, {"vmem": 1 << 20}, {"calls": 2}])
def test_what_changes_a_kernel_changes_the_hlo_key(change):
    assert hlo_key(**change) != hlo_key()


def test_both_hlo_canonicalizers_agree_on_kernels():
    assert hlocanon._native is not None
    drops, attrs = KeyConfig().hlo_config
    for data in (lowered(ir="hlo"), lowered(ir="hlo", line=3, vmem=1 << 21),
                 lowered(ir="hlo", calls=3)):
        c = hlocanon.canonical_hlo(data, drops, attrs, mosaic.kernel_part)
        assert c == hlocanon.canonical_hlo_py(data, drops, attrs, mosaic.kernel_part)
        assert hlocanon.canonical_sha256(data, drops, attrs, mosaic.kernel_part) == \
            hashlib.sha256(c).hexdigest()
        assert c != hlocanon.canonical_hlo(data, drops, attrs)  # the hook took part


@pytest.mark.parametrize("impl", ["c", "python"])
def test_an_hlo_kernel_hook_that_fails_is_an_error(impl):
    data = lowered(ir="hlo")
    canonical = hlocanon._native if impl == "c" else hlocanon.canonical_hlo_py

    def raising(config):
        raise KeyError("hook broke")

    with pytest.raises(KeyError, match="hook broke"):
        canonical(data, (), (), raising)
    with pytest.raises(ValueError, match="kernel hook must return"):
        canonical(data, (), (), lambda config: ("a", "b"))


def _fake_split(config: bytes):
    """A deterministic stand-in for the hook (our own interface): the walks'
    agreement, not the kernel digest, is under test."""
    return (config[:5], hashlib.sha256(config).digest(), config[5:]) if len(config) > 8 else None


_PALLAS_HLO: list[bytes] = []


def _pallas_hlo() -> bytes:
    if not _PALLAS_HLO:
        _PALLAS_HLO.append(lowered(ir="hlo", calls=2))
    return _PALLAS_HLO[0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                min_size=1, max_size=4))
def test_hlo_canonicalizers_agree_on_corrupted_kernel_calls(edits):
    data = bytearray(_pallas_hlo())
    for at, value in edits:
        data[int(at * len(data))] = value
    data = bytes(data)
    try:
        ref = hlocanon.canonical_hlo_py(data, (), (), _fake_split)
    except (ValueError, RecursionError):
        with pytest.raises(ValueError):
            hlocanon._native(data, (), (), _fake_split)
        return
    assert hlocanon._native(data, (), (), _fake_split) == ref
    assert hlocanon._native_sha256(data, (), (), _fake_split) == hashlib.sha256(ref).hexdigest()


def test_kernels_parsed_in_a_renewed_context_key_the_same(monkeypatch):
    from compilecast.worker.xla import jax_adapter

    modules = [lowered(), lowered(scale="5.0"), lowered(line=9)]
    mosaic._cache.clear()
    shared = [key(m) for m in modules]
    mosaic._cache.clear()
    monkeypatch.setattr(jax_adapter, "MOSAIC_CONTEXT_USES", 1)  # a new context every kernel
    contexts = []  # held, so that no two can share an address
    for _ in range(2):
        mosaic._cache.clear()
        assert [key(m) for m in modules] == shared
        contexts.append(jax_adapter._mosaic_ctx[0])
    assert contexts[0] is not contexts[1] and shared[0] == shared[2] != shared[1]


# -- explain ---------------------------------------------------------------------

def _explained(a, b) -> list[str]:
    from compilecast.worker.keylib.keys import Key, explain

    ka, kb = Key(), Key()
    for k, m in ((ka, a), (kb, b)):
        k.components["program"], k.program_text, _ = program_digest(m, KeyConfig(), keep_text=True)
    return explain(ka, kb)


def test_explain_shows_a_kernel_as_its_digest_and_points_past_moved_kernels():
    # Kernels at two lines and another scale outside them: the first
    # differing operation is the changed multiply, not the (moved) kernel call.
    def program(line: int, factor: float):
        ns: dict = {}
        exec(compile("\n" * line + KERNEL.replace("SCALE", "2.0"), "/src/m.py", "exec"), ns)
        call = pl.pallas_call(ns["kernel"], out_shape=SPEC)
        return jax.jit(lambda x, y: call(x, y) * factor).trace(SPEC, SPEC).lower(
            lowering_platforms=("tpu",)).compiler_ir("stablehlo")

    lines = _explained(program(0, 3.0), program(30, 4.0))
    assert "component program differs" in lines[0]
    assert "constant" in lines[2] and "3.0" in lines[2] and "4.0" in lines[3], lines
    # and when the kernels themselves differ, the call shows their digests, briefly
    lines = _explained(lowered(scale="2.0"), lowered(scale="3.0"))
    assert "<kernel " in lines[2] and "<kernel " in lines[3], lines
    assert all(len(line) < 260 for line in lines), lines


def test_without_mosaics_dialect_kernels_keep_their_locations(monkeypatch):
    # A jaxlib without Mosaic's dialect: keys are still computed, with the
    # configs whole (a miss when a kernel moves, never a shared key).
    import sys

    from jax._src import lib

    monkeypatch.delattr(lib, "tpu")
    monkeypatch.setitem(sys.modules, "jax._src.lib.tpu", None)
    monkeypatch.setattr(mosaic, "_cache", type(mosaic._cache)())
    config = config_of(lowered())
    assert mosaic.kernel_part(config) is None
    assert key(lowered()) != key(lowered(line=40))
    assert key(lowered()) != key(lowered(scale="3.0"))


# -- the walks' kernel path on generated modules ----------------------------------

_CALL = ('%{out} = stablehlo.custom_call @{target}(%{arg}) {{{attrs}}} : '
         '(tensor<4xf32>) -> tensor<4xf32>')


@st.composite
def custom_call_modules(draw):
    """Text of a module of custom calls: targets tpu_custom_call or not,
    backend_config a string (random bytes, escaped), a dictionary or absent."""
    calls, prev = [], "arg0"
    for i in range(draw(st.integers(1, 5))):
        target = draw(st.sampled_from(["tpu_custom_call", "tpu_custom_call2", "other"]))
        kind = draw(st.sampled_from(["string", "string", "dict", "none"]))
        attrs = []
        if kind == "string":
            raw = draw(st.binary(max_size=40))
            attrs.append('backend_config = "' + "".join(f"\\{b:02X}" for b in raw) + '"')
        elif kind == "dict":
            attrs += ["api_version = 4 : i32",
                      f"backend_config = {{x = {draw(st.integers(0, 9))} : i32}}"]
        if draw(st.booleans()):
            attrs.append("has_side_effect = true")
        calls.append(_CALL.format(out=i, target=target, arg=prev, attrs=", ".join(attrs)))
        prev = str(i)
    return ("func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {\n  " +
            "\n  ".join(calls) + f"\n  return %{prev} : tensor<4xf32>\n}}\n")


def _fake_kernel(calls: list[bytes]):
    """A deterministic split standing in for mosaic.kernel_part (our own
    interface): None for some configs, so both answers are exercised."""
    def split(config: bytes):
        calls.append(config)
        if len(config) % 3 == 0:
            return None
        return config[:2], hashlib.sha256(config).digest(), config[2:]
    return split


@settings(max_examples=150, deadline=None)
@given(custom_call_modules())
def test_both_walks_agree_on_custom_calls(text):
    from compilecast.worker.xla import jax_adapter

    assert mlircanon.bind_here() is not None
    with jax_adapter.mlir_context():
        module = jax_adapter.ir.Module.parse(text)
    seen_c: list[bytes] = []
    seen_py: list[bytes] = []
    c, py = hashlib.sha256(), hashlib.sha256()
    mlircanon._native.canonical_stream(module._CAPIPtr, c, frozenset(), None, _fake_kernel(seen_c))
    with module.context:
        mlircanon.stream_py(module, py, frozenset(), None, _fake_kernel(seen_py))
    assert c.hexdigest() == py.hexdigest()
    assert seen_c == seen_py  # the hook saw the same configs, in the same order
    # only string configs of tpu_custom_call calls reach the hook
    assert len(seen_c) == len(re.findall(r'@tpu_custom_call\(%\w+\) \{backend_config = "', text))
    plain = hashlib.sha256()
    mlircanon._native.canonical_stream(module._CAPIPtr, plain, frozenset(), None, None)
    split = any(len(cfg) % 3 for cfg in seen_c)
    assert (plain.hexdigest() != c.hexdigest()) is split
