"""Both MLIR walks write the same stream for anything JAX lowers (random
programs, edge constants, JAX's features, random attributes), or hosts with
and without the C walk would never share a key."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilecast.worker.keylib import keys, mlircanon

from .mlirwalks import DEFAULT_IGNORE, digest_native, digest_py, native

_UNARY = [jnp.tanh, jnp.exp, jnp.abs, jnp.sin, lambda v: v * 2, lambda v: -v, jnp.cumsum,
          lambda v: jnp.sort(v, axis=-1), lambda v: v.T @ v if v.ndim == 2 else v,
          lambda v: jnp.where(v > 0, v, 0.5), lambda v: v.astype(jnp.int32).astype(v.dtype),
          lambda v: jax.lax.cond(v.sum() > 0, jnp.sin, jnp.cos, v),
          lambda v: jax.lax.fori_loop(0, 2, lambda i, c: c * 1.5, v),
          lambda v: jax.jit(lambda u: u + 1)(v)]


@native
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.integers(0, len(_UNARY) - 1), min_size=1, max_size=8),
       shape=st.sampled_from([(3,), (4, 4), (2, 3, 4)]),
       dtype=st.sampled_from([jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32]),
       consts=st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=5))
def test_both_walks_write_the_same_stream_for_random_programs(ops, shape, dtype, consts):
    table = np.asarray(consts, np.float32)

    def f(v):
        for i in ops:
            v = _UNARY[i](v)
        return v + jnp.asarray(table).sum().astype(v.dtype)

    x = jax.ShapeDtypeStruct(shape, jnp.float32 if dtype == jnp.int32 else dtype)
    try:
        module = jax.jit(f).lower(x).compiler_ir("stablehlo")
    except (TypeError, ValueError):  # an op that does not take this dtype or shape
        return
    for ignore in (frozenset(), DEFAULT_IGNORE):
        assert digest_native(module, ignore) == digest_py(module, ignore)




CONSTANTS = ["dense<> : tensor<0xf32>", "dense<7> : tensor<2x0xi8>", "dense<7> : tensor<3xi8>",
             "dense<[1, 2]> : tensor<2xui8>", "dense<[-1, 2]> : tensor<2xsi16>",
             "dense<[true, false]> : tensor<2xi1>", "dense<1.5> : tensor<2x2xbf16>",
             "dense<[1.5, -0.0]> : tensor<2xf64>", "dense<[1, 2, 3]> : tensor<3xi4>", "dense<0x7FC00000> : tensor<f32>",
             "dense<-0.0> : tensor<f32>", "dense<0.0> : tensor<f32>"]


@native
def test_edge_constants_stream_alike_in_both_walks_and_stay_apart():
    """Empty shapes, splats over empty shapes, sub-byte, unsigned, complex,
    NaN and signed zeros: the same stream in both walks, a stream each."""
    digests = []
    for c in CONSTANTS:  # as attributes: no op's type constraints apply
        text = f"module {{ func.func public @main() -> () attributes {{c = {c}}} {{ return }} }}"
        m = keys.parse_program(text.encode())[0]
        assert digest_native(m) == digest_py(m), c
        digests.append(digest_py(m))
    assert len(set(digests)) == len(CONSTANTS)


def test_a_complex_constant_is_keyed_by_the_c_walk_and_refused_by_the_python_one():
    """jaxlib's bindings cannot cast complex dense constants (reading one as
    NamedAttribute.attr aborts the process): the reference reads attributes
    by name, which raises instead, and refuses the module; a JAX process
    without the C walk then compiles it locally."""
    a, b = (jax.jit(lambda x, c=c: x * jnp.asarray(np.array(c, np.complex64))).lower(
        jax.ShapeDtypeStruct((2,), jnp.complex64)).compiler_ir("stablehlo")
        for c in ([1 + 2j, 3 - 1j], [1 + 2j, 3 - 2j]))
    with a.context, pytest.raises(mlircanon.BindingsRefused):
        mlircanon.stream_py(a, hashlib.sha256(), DEFAULT_IGNORE, None)
    if mlircanon._native is not None:
        assert digest_native(a, renames=None) != digest_native(b, renames=None)
        assert mlircanon.native_ready()
        cfg = keys.KeyConfig()
        assert keys.program_digest(a, cfg)[0] != keys.program_digest(b, cfg)[0]


def _features():
    """Programs across JAX's feature set, lowered (never run)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    S = jax.ShapeDtypeStruct
    x = S((4, 8), jnp.float32)

    @jax.custom_jvp
    def g(v):
        return jnp.sin(v)

    g.defjvp(lambda p, t: (g(p[0]), jnp.cos(p[0]) * t[0]))
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    cases = {
        "zero-size": (lambda v: v + jnp.zeros((4, 0)).sum(), x),
        "argsort": (lambda v: jnp.argsort(v, axis=1), x),
        "top_k": (lambda v: jax.lax.top_k(v, 3), x),
        "conv": (lambda v, w: jax.lax.conv(v, w, (1, 1), "SAME"), S((1, 3, 8, 8), jnp.float32),
                 S((4, 3, 3, 3), jnp.float32)),
        "dot precision": (lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST), x,
                          S((8, 2), jnp.float32)),
        "reduce_window": (lambda v: jax.lax.reduce_window(v, 0., jax.lax.add, (2, 2), (1, 1),
                                                          "VALID"), x),
        "gather": (lambda v, i: v[i], x, S((3,), jnp.int32)),
        "scatter": (lambda v, i: v.at[i].add(1.0), x, S((3,), jnp.int32)),
        "rng": (lambda k: jax.random.normal(k, (4,)), S((2,), jnp.uint32)),
        "custom_jvp grad": (jax.grad(lambda v: g(v).sum()), x),
        "checkpoint": (jax.grad(lambda v: jax.checkpoint(lambda u: jnp.sin(u) ** 2)(v).sum()), x),
        "while": (lambda v: jax.lax.while_loop(lambda c: c[0] < 5,
                                               lambda c: (c[0] + 1, c[1] * 2), (0, v)), x),
        "switch": (lambda i, v: jax.lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh], v),
                   S((), jnp.int32), x),
        "sharding": (lambda v: jax.lax.with_sharding_constraint(v * 2, NamedSharding(mesh, P("d"))),
                     x),
        "host callback": (lambda v: jax.pure_callback(lambda u: np.asarray(u) * 2, x, v), x),
        "fft": (lambda v: jnp.fft.fft(v).real, x),
        "cholesky": (lambda v: jnp.linalg.cholesky(v @ v.T + jnp.eye(4)), x),
        "nan, inf, -0": (lambda v: v + jnp.array([jnp.nan, jnp.inf, -jnp.inf, -0.0]).sum(), x),
        "bf16 constant": (lambda v: v + jnp.asarray(np.arange(4096.0).reshape(64, 64)).astype(
            jnp.bfloat16).astype(jnp.float32).sum(), x),
        "remat scan": (lambda v: jax.lax.scan(jax.checkpoint(lambda c, u: (c + u, c * u)), v[0],
                                              v)[0], x),
    }
    return cases


@native
@pytest.mark.parametrize("name", sorted(_features()))
def test_both_walks_agree_across_jax_features(name):
    f, *args = _features()[name]
    module = jax.jit(f).lower(*args).compiler_ir("stablehlo")
    for ignore in (frozenset(), DEFAULT_IGNORE):
        assert digest_native(module, ignore, None) == digest_py(module, ignore, None)


_LEAVES = ['1 : i32', '-7 : i64', '3.5 : f32', '1.0e-30 : f64', '0x7FC00000 : f32', 'true', 'unit',
           '"s"', '"with \\"quote\\" \\n"', '"\\E2\\82\\AC"', 'i32', 'tensor<2x?xf32>', '@f', '@g',
           '@outer::@inner', 'dense<[1, 2]> : tensor<2xi32>', 'dense<1.5> : tensor<3xf16>',
           'dense<[true, false]> : tensor<2xi1>', 'array<i64: 1, 2, 3>', 'array<f32: 1.5>',
           'affine_map<(d0) -> (d0 + 1)>', '#stablehlo<comparison_direction LT>',
           'dense<"0x01020304"> : tensor<4xi8>', 'dense<[1.0, 2.0]> : tensor<2xbf16>', '{}', '[]']
_attr_trees = st.recursive(
    st.sampled_from(_LEAVES),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.dictionaries(st.sampled_from(["a", "b", "z", "jax.arg_info", "k1"]), inner,
                        max_size=3).map(
            lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}")),
    max_leaves=12)


@native
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attrs=st.lists(_attr_trees, min_size=1, max_size=4))
def test_both_walks_write_the_same_stream_for_random_attributes(attrs):
    """Attribute trees: symbol references (renamed, nested, unknown), arrays,
    dictionaries with ignored names, strings with escapes, floats, dense and
    array constants, dialect attributes."""
    body = ", ".join(f"x{i} = {a}" for i, a in enumerate(attrs))
    text = ("module { func.func private @f() -> () { return }\n"
            "func.func private @g() -> () { return }\n"
            f"func.func public @main() -> () attributes {{{body}}} {{ return }} }}")
    module = keys.parse_program(text.encode())[0]
    for ignore in (frozenset(), frozenset({"jax.arg_info", "a"})):
        assert digest_native(module, ignore, None) == digest_py(module, ignore, None)


def _main(body: str, args: str = "%arg0: tensor<4xf32>", results: str = "tensor<4xf32>") -> str:
    return (f"module {{ func.func public @main({args}) -> {results} {{\n{body}\n}} }}")


# What XLA's C-API client does to a module before a plugin sees it (constants
# hoisted and merged, converts to the same type folded, default precisions
# dropped) never changes what it computes: each pair streams alike in both walks.
_REWRITTEN = {
    "constants hoisted and merged": (
        _main("%0 = stablehlo.constant dense<2.0> : tensor<4xf32>\n"
              "%1 = stablehlo.multiply %arg0, %0 : tensor<4xf32>\n"
              "%2 = stablehlo.constant dense<2.0> : tensor<4xf32>\n"
              "%3 = stablehlo.add %1, %2 : tensor<4xf32>\n"
              "return %3 : tensor<4xf32>"),
        _main("%0 = stablehlo.constant dense<2.0> : tensor<4xf32>\n"
              "%1 = stablehlo.multiply %arg0, %0 : tensor<4xf32>\n"
              "%2 = stablehlo.add %1, %0 : tensor<4xf32>\n"
              "return %2 : tensor<4xf32>")),
    "a constant sunk into a loop": (
        _main("%c = stablehlo.constant dense<1.0> : tensor<4xf32>\n"
              "%0 = stablehlo.while(%it = %arg0) : tensor<4xf32>\n"
              " cond { %z = stablehlo.constant dense<true> : tensor<i1>\n"
              "        stablehlo.return %z : tensor<i1> }\n"
              " do { %s = stablehlo.add %it, %c : tensor<4xf32>\n"
              "      stablehlo.return %s : tensor<4xf32> }\n"
              "return %0 : tensor<4xf32>"),
        _main("%t = stablehlo.constant dense<true> : tensor<i1>\n"
              "%0 = stablehlo.while(%it = %arg0) : tensor<4xf32>\n"
              " cond { stablehlo.return %t : tensor<i1> }\n"
              " do { %c = stablehlo.constant dense<1.0> : tensor<4xf32>\n"
              "      %s = stablehlo.add %it, %c : tensor<4xf32>\n"
              "      stablehlo.return %s : tensor<4xf32> }\n"
              "return %0 : tensor<4xf32>")),
    "a convert to the same type": (
        _main("%0 = stablehlo.convert %arg0 : tensor<4xf32>\n"
              "%1 = stablehlo.convert %0 : tensor<4xf32>\n"
              "%2 = stablehlo.tanh %1 : tensor<4xf32>\nreturn %2 : tensor<4xf32>"),
        _main("%0 = stablehlo.tanh %arg0 : tensor<4xf32>\nreturn %0 : tensor<4xf32>")),
    "default precisions": (
        _main("%0 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [0] x [0], "
              "precision = [DEFAULT, DEFAULT] : (tensor<4xf32>, tensor<4xf32>) -> tensor<f32>\n"
              "return %0 : tensor<f32>", results="tensor<f32>"),
        _main("%0 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [0] x [0] "
              ": (tensor<4xf32>, tensor<4xf32>) -> tensor<f32>\n"
              "return %0 : tensor<f32>", results="tensor<f32>")),
}

# ... and what changes a program still changes its stream.
_APART = {
    "another constant": (
        _REWRITTEN["constants hoisted and merged"][1],
        _REWRITTEN["constants hoisted and merged"][1].replace(
            "%2 = stablehlo.add %1, %0", "%c = stablehlo.constant dense<3.0> : tensor<4xf32>\n"
            "%2 = stablehlo.add %1, %c")),
    "a constant where an argument was": (
        _main("%0 = stablehlo.constant dense<2.0> : tensor<4xf32>\n"
              "%1 = stablehlo.add %arg0, %0 : tensor<4xf32>\nreturn %1 : tensor<4xf32>"),
        _main("%0 = stablehlo.constant dense<2.0> : tensor<4xf32>\n"
              "%1 = stablehlo.add %0, %arg0 : tensor<4xf32>\nreturn %1 : tensor<4xf32>")),
    "a convert to another type": (
        _main("%0 = stablehlo.convert %arg0 : (tensor<4xf32>) -> tensor<4xf16>\n"
              "%1 = stablehlo.convert %0 : (tensor<4xf16>) -> tensor<4xf32>\n"
              "return %1 : tensor<4xf32>"),
        _main("return %arg0 : tensor<4xf32>")),
    "another precision": (
        _REWRITTEN["default precisions"][0].replace("DEFAULT, DEFAULT", "HIGHEST, DEFAULT"),
        _REWRITTEN["default precisions"][1]),
}


@native
@pytest.mark.parametrize("name", sorted(_REWRITTEN))
def test_what_a_plugins_client_rewrites_streams_alike_in_both_walks(name):
    a, b = (keys.parse_program(t.encode())[0] for t in _REWRITTEN[name])
    assert digest_native(a) == digest_py(a) == digest_py(b) == digest_native(b)


@native
@pytest.mark.parametrize("name", sorted(_APART))
def test_what_changes_a_program_still_changes_both_walks_streams(name):
    a, b = (keys.parse_program(t.encode())[0] for t in _APART[name])
    assert digest_native(a) == digest_py(a) != digest_py(b) == digest_native(b)
