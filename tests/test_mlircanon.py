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

from compilecast.worker.keylib import keys, mlircanon

from .mlirwalks import DEFAULT_IGNORE, digest_native, digest_py, native


def modules():
    """Programs beyond the self-test's corpus: a training step, nested calls,
    scans, shardings on arguments, big and splat constants."""
    from compilecast.demo.step import make_inputs, make_step

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
    from compilecast.demo.step import make_inputs, make_step

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
        from compilecast.worker.xla.jax_adapter import ir
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
    hlocanon_so = __import__("compilecast.worker.keylib._hlocanon", fromlist=["x"]).__file__
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
             "from compilecast.worker.keylib import mlircanon\n"
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
    """Both walks stop past MAX_NESTING; the key is then the canonical
    bytecode's (still the program's: another value, another key)."""
    def text(value: int) -> bytes:
        deep = "[" * 300 + str(value) + "]" * 300
        return f'module {{ func.func public @main() -> () attributes {{x = {deep}}} {{ return }} }}'.encode()

    assert_both_walks_refuse(keys.parse_program(text(1))[0], "nested too deeply")
    one, again, two = keys.program_key(text(1)), keys.program_key(text(1)), keys.program_key(text(2))
    assert one.components["program_format"] == "mlir-text" and not one.unparsed
    assert one.value == again.value != two.value


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
    the self-test finds today (rerun `python -m compilecast.worker.keylib.mlircanon
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
