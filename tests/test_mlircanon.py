"""The MLIR canonical stream: the C path over MLIR's C API against the Python
reference, and the gate that keeps the C path out of a JAX process until a
self-test in another process passed for this exact build."""

from __future__ import annotations

import hashlib
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compilecast.worker import keys, mlircanon

native = pytest.mark.skipif(mlircanon._native is None, reason="_mlircanon extension not built")

DEFAULT_IGNORE = frozenset(keys.DEFAULT_IGNORED_ATTRIBUTES)


FIND = object()  # the walk finds the renames itself


def digest_native(module, ignore=DEFAULT_IGNORE, renames=FIND) -> str:
    """The C stream's digest; renames default: the Python private_renames."""
    assert mlircanon.bind_here() is not None
    h = hashlib.sha256()
    renames = mlircanon.private_renames(module) if renames is FIND else renames
    mlircanon._native.canonical_stream(module._CAPIPtr, h, ignore, renames)
    return h.hexdigest()


def digest_py(module, ignore=DEFAULT_IGNORE, renames=FIND) -> str:
    h = hashlib.sha256()
    renames = mlircanon.private_renames(module) if renames is FIND else renames
    with module.context:
        mlircanon.stream_py(module, h, ignore, renames)
    return h.hexdigest()


def modules():
    """Programs beyond the self-test's corpus: a training step, nested calls,
    scans, shardings on arguments, big and splat constants."""
    from compilecast.demo_step import make_inputs, make_step

    params, x, y = make_inputs(6, 16, batch=4)
    layer = jax.jit(lambda h, w: jnp.tanh(h @ w))

    def nested(ws, h):
        for w in ws:
            h = layer(h, w)
        return h.sum()

    ws = [jnp.ones((8, 8))] * 3
    scan = jax.jit(lambda c, xs: jax.lax.scan(lambda c, v: (c * v, c + v), c, xs))
    big = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    return {
        "step": make_step().lower(params, x, y).compiler_ir("stablehlo"),
        "nested": jax.jit(nested).lower(ws, jnp.ones((2, 8))).compiler_ir("stablehlo"),
        "grad-nested": jax.jit(jax.grad(nested)).lower(ws, jnp.ones((2, 8))).compiler_ir(
            "stablehlo"),
        "scan": scan.lower(jnp.ones(3), jnp.ones((5, 3))).compiler_ir("stablehlo"),
        "big-constant": jax.jit(lambda v: v + jnp.asarray(big).sum()).lower(
            jnp.ones(2)).compiler_ir("stablehlo"),
        "where": jax.jit(lambda v: jnp.where(v > 0, v, jnp.zeros_like(v))).lower(
            jnp.ones(4)).compiler_ir("stablehlo"),
    }


@native
def test_the_c_path_passes_its_self_test_on_this_jaxlib():
    """Fails loudly when a jaxlib release strips MLIR's C API from its
    library or changes it under us (keys then fall back to the slower walk)."""
    ok, why, api = mlircanon.selftest()
    assert ok, why
    assert api is not None and len(api[1]) == len(set(api[1]))  # one function per name


@native
@pytest.mark.parametrize("ignore", [frozenset(), DEFAULT_IGNORE, frozenset({"mhlo.sharding"})])
def test_c_and_python_streams_are_the_same_bytes(ignore):
    for name, module in modules().items():
        assert digest_native(module, ignore) == digest_py(module, ignore), name
        assert digest_native(module, ignore, {}) == digest_py(module, ignore, {}), name


@native
def test_a_module_with_many_values_and_the_small_ones_after_it_stream_alike():
    """The C walk's value table grows past its first size here, its cache of
    recent values sees many collisions, and the next walks start at the size
    this one reached: the streams stay the reference's."""
    from compilecast.demo_step import make_inputs, make_step

    params, x, y = make_inputs(800, 16, batch=4)
    big = make_step().lower(params, x, y).compiler_ir("stablehlo")
    values = sum(1 for line in str(big).splitlines() if " = " in line)
    assert values > 1 << 14, values  # more than the table's first size
    assert digest_native(big) == digest_py(big)
    for name, module in modules().items():
        assert digest_native(module) == digest_py(module), name


@native
def test_the_stream_covers_what_it_walks():
    """Sanity of the comparison above: different programs, different streams
    on both paths; the same program twice, one stream."""
    ms = modules()
    natives = {digest_native(m) for m in ms.values()}
    assert len(natives) == len(ms)
    again = modules()
    assert all(digest_native(ms[n]) == digest_native(again[n]) for n in ms)


@native
def test_the_c_walk_finds_the_same_renames():
    for name, m in modules().items():
        assert digest_native(m, renames=None) == digest_native(m), name
        assert digest_py(m, renames=None) == digest_py(m), name
    assert len(mlircanon.private_renames(modules()["nested"])) >= 1


def test_private_renames_are_in_order_and_refuse_a_clash():
    m = modules()["nested"]
    renames = mlircanon.private_renames(m)
    assert list(renames.values()) == [f"f{i}" for i in range(len(renames))]
    assert "main" not in renames
    with m.context:
        from compilecast.worker.jax_adapter import ir
        body = m.operation.regions[0].blocks[0]
        for op in body.operations:  # name the public function f0: a clash
            attrs = op.operation.attributes
            if ir.StringAttr(attrs["sym_name"]).value == "main":
                attrs["sym_name"] = ir.StringAttr.get("f0")
    assert mlircanon.private_renames(m) == {}
    if mlircanon._native is not None:  # the C walk finds no renames either
        assert digest_native(m, renames=None) == digest_native(m, renames={})


@native
def test_bind_refuses_a_library_that_is_not_loaded_or_lacks_the_api(tmp_path):
    lib, locs = mlircanon.find_api()
    with pytest.raises(LookupError, match="not loaded"):
        mlircanon._native.bind(str(tmp_path), locs)  # a directory: never a loaded library
    with pytest.raises(ValueError, match="symbol locations"):
        mlircanon._native.bind(lib, locs[:-1])
    hlocanon_so = __import__("compilecast.worker._hlocanon", fromlist=["x"]).__file__
    with pytest.raises(LookupError, match="has no mlir"):
        mlircanon._native.symbols(hlocanon_so)
    assert mlircanon.bind_here() == lib  # bound again for the other tests


@native
@pytest.mark.parametrize("tamper", ["swap", "shift", "far"])
def test_a_tampered_verdict_cannot_point_the_c_path_anywhere_else(fresh_gate, tamper, caplog):
    """The verdict file says where the functions' symbols are; whoever can
    write it must not be able to make a JAX process call something else."""
    caplog.set_level(logging.INFO, logger="compilecast.mlircanon")
    lib, locs = mlircanon.find_api()
    bad = list(locs)
    if tamper == "swap":
        bad[0], bad[1] = bad[1], bad[0]
    elif tamper == "shift":
        bad[3] += 1
    else:
        bad[5] = (999 << 40) | 7
    with pytest.raises(ValueError, match="do not hold"):
        mlircanon._native.bind(lib, bad)
    mlircanon._write_verdict(True, "tampered by the test", (lib, bad))
    assert not mlircanon.native_ready()  # refused: keys take the reference walk
    assert "cannot bind" in caplog.text
    assert mlircanon.bind_here() == lib


@native
def test_canonical_stream_refuses_what_is_not_a_module():
    assert mlircanon.bind_here() is not None
    with pytest.raises(TypeError):
        mlircanon._native.canonical_stream(object(), hashlib.sha256(), frozenset(), {})
    op = modules()["where"].operation
    with pytest.raises(TypeError, match="Module capsule"):
        mlircanon._native.canonical_stream(op._CAPIPtr, hashlib.sha256(), frozenset(), {})


@pytest.fixture
def fresh_gate(tmp_path, monkeypatch):
    """No verdict anywhere: neither in the cache nor shipped for this build."""
    monkeypatch.setattr(mlircanon, "KNOWN_BUILDS", tmp_path / "no-known-builds.json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("COMPILECAST_KEY_NATIVE", raising=False)
    monkeypatch.setattr(mlircanon, "_state", {"native": None, "testing": False, "next_try": 0.0})
    return tmp_path


@native
def test_no_verdict_means_the_reference_until_the_self_test_in_a_child_passed(fresh_gate):
    assert not mlircanon._verdict_path().exists()
    assert mlircanon.native_ready(wait=True)
    verdict = json.loads(mlircanon._verdict_path().read_text())
    assert verdict["ok"], verdict
    assert str(fresh_gate) in str(mlircanon._verdict_path())


@native
def test_a_failed_verdict_keeps_the_reference_and_keys_do_not_change(fresh_gate, caplog):
    caplog.set_level(logging.INFO, logger="compilecast.mlircanon")
    m = modules()["step"]
    fast = digest_native(m)
    mlircanon._write_verdict(False, "the C path disagreed (written by the test)")
    assert not mlircanon.native_ready()
    assert "disagreed" in caplog.text
    assert keys.program_digest(m, keys.KeyConfig())[0] == fast


def test_key_native_0_keeps_a_process_on_the_reference(fresh_gate, monkeypatch):
    monkeypatch.setenv("COMPILECAST_KEY_NATIVE", "0")
    assert not mlircanon.native_ready(wait=True)
    assert not mlircanon._verdict_path().exists()  # nothing was even tested


@native
def test_the_worker_daemon_warms_up_the_verdict_without_importing_jax(tmp_path):
    import subprocess
    import sys
    probe = ("import sys\n"
             "from pathlib import Path\n"
             "from compilecast.worker import mlircanon\n"
             "mlircanon.KNOWN_BUILDS = Path('/nonexistent')  # as for a build not shipped\n"
             "t = mlircanon.warm_up()\n"
             "t.join()\n"
             "assert 'jax' not in sys.modules, 'the daemon imported jax'\n"
             "print(mlircanon._verdict_path().read_text())\n")
    out = subprocess.run([sys.executable, "-c", probe], env={**__import__("os").environ,
                         "XDG_CACHE_HOME": str(tmp_path)}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"]


RESOURCE_PROGRAM = """
module @m {
  func.func public @main() -> tensor<2xi32> {
    %0 = stablehlo.constant dense_resource<blob1> : tensor<2xi32>
    return %0 : tensor<2xi32>
  }
}
{-#
  dialect_resources: {
    builtin: {
      blob1: "0x04000000BLOB"
    }
  }
#-}
"""


def assert_both_walks_refuse(module, match: str) -> None:
    with module.context, pytest.raises(ValueError, match=match):
        mlircanon.stream_py(module, hashlib.sha256(), DEFAULT_IGNORE, {})
    if mlircanon._native is not None:
        assert mlircanon.bind_here() is not None
        with pytest.raises(ValueError, match=match):
            mlircanon._native.canonical_stream(module._CAPIPtr, hashlib.sha256(),
                                               DEFAULT_IGNORE, {})


def test_dense_resource_constants_are_keyed_by_their_bytes_not_their_name():
    """The printed form of a dense_resource names its blob without the bytes:
    both walks refuse it, and the key covers the blob through the bytecode."""
    a = RESOURCE_PROGRAM.replace("BLOB", "0100000002000000").encode()
    b = RESOURCE_PROGRAM.replace("BLOB", "0100000003000000").encode()
    assert keys.program_key(a).components["program_format"] == "mlir-text"
    assert keys.program_key(a).value != keys.program_key(b).value
    assert keys.program_key(a).value == keys.program_key(a).value
    assert_both_walks_refuse(keys.parse_program(a)[0], "dense_resource")


def test_attributes_nested_too_deeply_are_refused_by_both_walks():
    deep = "[" * 300 + "1" + "]" * 300
    text = f'module {{ func.func public @main() -> () attributes {{x = {deep}}} {{ return }} }}'
    assert_both_walks_refuse(keys.parse_program(text.encode())[0], "nested too deeply")
    assert keys.program_key(text.encode()).components["program_format"] == "raw"


BRANCHES = """module {
  func.func public @main(%a: tensor<i1>, %x: tensor<f32>) -> tensor<f32> {
    %p = tensor.extract %a[] : tensor<i1>
    cf.cond_br %p, ^bb1(%x : tensor<f32>), ^bb2
  ^bb2:
    %y = stablehlo.negate %x : tensor<f32>
    cf.br ^bb1(%y : tensor<f32>)
  ^bb1(%r: tensor<f32>):
    return %r : tensor<f32>
  }
}"""


def test_successors_and_block_arguments_are_in_the_stream():
    """Blocks, branches and block arguments (which JAX's own output rarely
    has): both walks agree, and a branch to the other block is another key."""
    swapped = BRANCHES.replace("^bb1(%x : tensor<f32>), ^bb2", "^bb2, ^bb1(%x : tensor<f32>)")
    renamed = BRANCHES.replace("%y", "%other").replace("^bb2", "^next")
    a, b, c = (keys.parse_program(t.encode())[0] for t in (BRANCHES, swapped, renamed))
    if mlircanon._native is not None:
        for m in (a, b, c):
            assert digest_native(m) == digest_py(m)
    assert digest_py(a) != digest_py(b)
    assert digest_py(a) == digest_py(c)  # value and block names are not the program


def forward_use_module(defs: int, between: int = 0, late: int = 8) -> str:
    """`defs` values defined in the entry block, then a block that uses
    `late` values defined in a block written after it (which dominates the
    user; MLIR allows the order), defines `between` more values (at least
    one), and uses early ones."""
    chain = [f"    %d{i} = stablehlo.negate %d{i - 1} : tensor<f32>" for i in range(1, defs)]
    uses = [f"    %u{k} = stablehlo.add %v{k}, %d{defs - 1} : tensor<f32>" for k in range(late)]
    more = [f"    %b{i} = stablehlo.negate %b{i - 1} : tensor<f32>" for i in range(1, between)]
    defined = [f"    %v{k} = stablehlo.negate %d{(defs * k) // late} : tensor<f32>"
               for k in range(late)]
    return "\n".join([
        "module {",
        "  func.func public @main(%x: tensor<f32>) -> tensor<f32> {",
        "    %d0 = stablehlo.negate %x : tensor<f32>",
        *chain,
        "    cf.br ^late",
        "  ^early:",
        *uses,
        "    %b0 = stablehlo.add %u0, %d1 : tensor<f32>",
        *more,
        f"    %e1 = stablehlo.add %b{max(between - 1, 0)}, %w : tensor<f32>",
        "    return %e1 : tensor<f32>",
        "  ^late:",
        *defined,
        "    %w = stablehlo.add %v0, %d1 : tensor<f32>",
        "    cf.br ^early",
        "  }",
        "}"])


@native
@pytest.mark.parametrize("defs,between", [(3, 0), (63, 0), (64, 0), (65, 0), (200, 0),
                                          (200, 30000)])
def test_a_use_before_its_definition_numbers_both_as_the_reference_does(defs, between):
    """The C walk keeps new definitions aside and inserts them into its value
    table in batches, until it meets a use before a definition; from then on
    every definition looks itself up. Around the batch's size, the uses
    before the definitions must still get the definitions' numbers, and the
    definitions kept aside theirs; with many values between the uses and the
    definitions, the walk's cache of recent values no longer holds them."""
    text = forward_use_module(defs, between)
    module = keys.parse_program(text.encode())[0]
    assert digest_native(module) == digest_py(module)
    # The late block's value is the one used early: another operand is another key.
    other = keys.parse_program(text.replace("%u0 = stablehlo.add %v0,", "%u0 = stablehlo.add %w,")
                               .encode())[0]
    assert digest_native(other) == digest_py(other) != digest_py(module)


def test_installed_hash_is_the_one_jaxlibs_record_gives_the_file(tmp_path):
    """What importlib.metadata's parsed RECORD says for each library file
    (None for one it does not list), and None for a same-named file elsewhere."""
    from importlib import metadata

    by_name = {f.name: f for f in metadata.files("jaxlib") or [] if f.name.endswith(".so")}
    libs = [lib for lib in mlircanon.library_candidates() if lib.exists()]
    if not libs:
        pytest.skip("no jaxlib library file here")
    for lib in libs:
        listed = by_name.get(lib.name)
        want = listed.hash.value if listed is not None and listed.hash is not None else None
        assert mlircanon.installed_hash(lib) == want
    assert any(mlircanon.installed_hash(lib) for lib in libs), "jaxlib's RECORD lists none"
    elsewhere = tmp_path / libs[0].name
    elsewhere.write_bytes(b"not the library")
    assert mlircanon.installed_hash(elsewhere) is None


def installed_build() -> str:
    lib = mlircanon.library_candidates()[0]
    digest = mlircanon.installed_hash(lib)
    known = json.loads(mlircanon.KNOWN_BUILDS.read_text())
    if digest not in known:
        pytest.skip(f"no verdict shipped for this jaxlib build ({digest}): the self-test runs")
    return digest


@native
def test_the_verdict_shipped_for_this_jaxlib_build_is_still_right():
    """A shipped verdict lets every process bind at once; it must say what
    the self-test finds today (rerun `python -m compilecast.worker.mlircanon
    --record` when this fails)."""
    installed_build()
    shipped = mlircanon.known_build()
    assert shipped is not None, "shipped for this build, but for another API or stream version"
    ok, why, api = mlircanon.selftest()
    assert ok, why
    assert shipped["symbol_locations"] == api[1]


@pytest.fixture
def shipped_gate(tmp_path, monkeypatch):
    """This build's shipped verdict, no cached one, and nothing settled yet
    in this process."""
    installed_build()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mlircanon, "_state", {"native": None, "testing": False, "next_try": 0.0})
    return tmp_path


@native
def test_a_shipped_build_binds_without_a_self_test(shipped_gate, monkeypatch):
    monkeypatch.setattr(mlircanon, "_run_selftest", lambda: pytest.fail("self-test started"))
    assert mlircanon.native_ready()
    assert mlircanon.warm_up() is None
    assert not mlircanon._verdict_path().exists()


@native
@pytest.mark.parametrize("how", ["keys.prepare", "enable"])
def test_a_process_settles_the_c_walk_at_start_not_at_its_first_key(shipped_gate, how):
    if how == "keys.prepare":
        keys.prepare()
    else:
        import compilecast.jax

        assert compilecast.jax.enable(f"unix://{shipped_gate}/none.sock") is not None
        compilecast.jax.disable()
    assert mlircanon._state["native"] is True


@native
def test_a_shipped_verdict_for_another_api_or_stream_is_not_used(tmp_path, monkeypatch):
    digest = installed_build()
    entry = json.loads(mlircanon.KNOWN_BUILDS.read_text())[digest]
    for change in ({"api": "another"}, {"stream_version": "0"}):
        path = tmp_path / "known.json"
        path.write_text(json.dumps({digest: {**entry, **change}}))
        monkeypatch.setattr(mlircanon, "KNOWN_BUILDS", path)
        assert mlircanon.known_build() is None


@native
def test_a_name_that_is_not_utf8_is_refused_by_the_c_walk():
    """The C walk refuses it with a clear error and the file is keyed by its
    bytes. (jaxlib's Python bindings abort the process on such a name, so
    the reference walk is not run on it here: docs/keys.md.)"""
    text = 'module { func.func public @main() -> () attributes {"a\\FFb" = 1 : i32} { return } }'
    module, _ = keys.parse_program(text.encode())
    assert mlircanon.bind_here() is not None
    with pytest.raises(ValueError, match="not UTF-8"):
        mlircanon._native.canonical_stream(module._CAPIPtr, hashlib.sha256(), DEFAULT_IGNORE, {})
    assert mlircanon.native_ready()
    assert keys.program_key(text.encode()).components["program_format"] == "raw"


# Random programs: both walks must write the same stream for anything JAX
# lowers, or hosts with and without the C walk would never share a key.
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

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


@native
def test_a_self_test_another_process_runs_is_left_to_it(fresh_gate, monkeypatch):
    """Processes of a job that start together run one self-test between them;
    the others do not remove its marker and look for its verdict later."""
    running = mlircanon._verdict_path().with_suffix(".running")
    running.parent.mkdir(parents=True)
    running.touch()
    spawned = []
    monkeypatch.setattr(mlircanon.subprocess, "run", lambda *a, **k: spawned.append(a))
    mlircanon._run_selftest()
    assert running.exists() and not spawned
    assert not mlircanon.native_ready()  # no verdict yet, and not tried again at once
    assert not mlircanon._state["testing"]


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
