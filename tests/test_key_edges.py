"""Keys at their edges: mesh axes named like the program's other strings,
programs nested deeper than the canonical walk goes, and StableHLO portable
artifacts, in every form a door hands the core (MLIR text, bytecode, HLO)."""

from __future__ import annotations

import io
import itertools
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from compilecast.worker.keylib import hlocanon, keys

# A sharded program whose one mesh axis is AXIS, with a string VALUE where the
# program keeps a string that is not an axis.
PROGRAM = '''module @m attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["AXIS"=2]>
  func.func public @main(%arg0: tensor<8xf32> {ARG sdy.sharding = #sdy.sharding<@mesh, [{"AXIS"}]>})
      -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"AXIS"}]>}) {
    BODY
    return %0 : tensor<8xf32>
  }
  PRIVATE
}'''
ADD = "%0 = stablehlo.add %arg0, %arg0 : tensor<8xf32>"

# (what the string is, the argument's attribute, the body, a private function)
WHERE = {
    "memory kind": ('mhlo.memory_kind = "VALUE",', ADD, ""),
    "layout mode": ('mhlo.layout_mode = "VALUE",', ADD, ""),
    "frontend attribute": ('mhlo.frontend_attributes = {tag = "VALUE"},', ADD, ""),
    "custom-call target": ("", '%0 = stablehlo.custom_call @VALUE(%arg0) : '
                               '(tensor<8xf32>) -> tensor<8xf32>', ""),
    "custom-call config": ("", '%0 = stablehlo.custom_call @target(%arg0) '
                               '{backend_config = "VALUE"} : (tensor<8xf32>) -> tensor<8xf32>', ""),
    "composite name": ("", '%0 = stablehlo.composite "VALUE" %arg0 {decomposition = @twice} : '
                           '(tensor<8xf32>) -> tensor<8xf32>',
                       'func.func private @twice(%a: tensor<8xf32>) -> tensor<8xf32> {\n'
                       '    %s = stablehlo.add %a, %a : tensor<8xf32>\n'
                       '    return %s : tensor<8xf32>\n  }'),
    "op frontend attribute": ("", '%0 = stablehlo.add %arg0, %arg0 {mhlo.frontend_attributes = '
                                  '{tag = "VALUE"}} : tensor<8xf32>', ""),
}
VALUES = ("device", "pinned_host", "unpinned_host", "default", "auto", "my.op", "your.op")
NAMESPACED = ("my.op", "your.op", "jax.device", "mosaic.auto")  # (a composite's names)
OTHER_AXIS = "zz"


def program(where: str, axis: str, value: str) -> str:
    arg, body, private = WHERE[where]
    return (PROGRAM.replace("ARG", arg).replace("BODY", body).replace("PRIVATE", private)
            .replace("VALUE", value).replace("AXIS", axis))


def in_form(text: str, form: str) -> bytes:
    if form == "mlir-text":
        return text.encode()
    module, _ = keys.parse_program(text.encode())
    out = io.BytesIO()
    module.operation.write_bytecode(file=out)
    if form == "mlir-bytecode":
        return out.getvalue()
    from compilecast.worker.xla import jax_adapter

    return jax_adapter.stablehlo_to_hlo(out.getvalue())


def key(where: str, axis: str, value: str, form: str) -> str:
    k = keys.program_key(in_form(program(where, axis, value), form))
    assert not k.unparsed and k.components["program_format"] == form, k.unparsed
    return k.components["program"]


@pytest.mark.parametrize("form", ["mlir-text", "mlir-bytecode", "hlo-proto"])
@pytest.mark.parametrize("where", sorted(WHERE))
def test_an_axis_named_like_a_string_of_the_program_renames_only_the_axis(where, form):
    """Renaming a mesh axis renames the axis, never a string spelled the same:
    two programs share a key exactly when, with their axes named alike, they
    are the same program (no false hit, no false miss)."""
    values = NAMESPACED if where == "composite name" else VALUES
    same_axis = {v: key(where, OTHER_AXIS, v, form) for v in values}
    own_axis = {v: key(where, v, v, form) for v in values}
    for v in values:
        assert own_axis[v] == same_axis[v], (where, form, v)  # only the axis's name differs
    for a, b in itertools.combinations(values, 2):
        # (the HLO form drops a memory kind or a layout mode: compile options carry them)
        assert (own_axis[a] == own_axis[b]) == (same_axis[a] == same_axis[b]), (where, form, a, b)
    if form != "hlo-proto" or where not in ("memory kind", "layout mode"):
        assert len(set(own_axis.values())) == len(values), (where, form)


@pytest.mark.parametrize("text, renamed", [
    ('{mhlo.memory_kind = "x", sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}',
     '{mhlo.memory_kind = "x", sdy.sharding = #sdy.sharding<@mesh, [{"axis0"}, {}]>}'),
    ('#sdy.sharding_per_value<[<@"x", [{"x", "y"}]>]>',
     '#sdy.sharding_per_value<[<@"x", [{"axis0", "axis1"}]>]>'),
    ('#sdy<manual_axes{"y"}>', '#sdy<manual_axes{"axis1"}>'),
    ('{mesh = #sdy.mesh<["x"=2, "y"=4]>, rule = #sdy.op_sharding_rule<([i])->([i]) {i=2}>, '
     'tag = "y"}',
     '{mesh = #sdy.mesh<["axis0"=2, "axis1"=4]>, rule = #sdy.op_sharding_rule<([i])->([i]) '
     '{i=2}>, tag = "y"}'),
    ('"#sdy.sharding<@mesh, [{\\22x\\22}]>"', '"#sdy.sharding<@mesh, [{\\22x\\22}]>"'),
])
def test_axes_are_renamed_inside_shardys_attributes_alone(text, renamed):
    renames = {b"x": b"axis0", b"y": b"axis1"}
    assert hlocanon.rename_axes(text.encode(), renames).decode() == renamed


def test_a_mesh_described_as_a_dictionary_is_renamed_whole():
    text = b'{axes = [{name = "x", size = 2 : i64}, {name = "y", size = 4 : i64}]}'
    assert hlocanon.rename_axes(text, {b"x": b"axis0", b"y": b"axis1"}, whole=True) == \
        b'{axes = [{name = "axis0", size = 2 : i64}, {name = "axis1", size = 4 : i64}]}'


def nested(depth: int, scale: float):
    def f(x):
        def level(x, k):
            if k == 0:
                return x * scale
            return jax.lax.cond(x.sum() > 0, lambda y: level(y + 1, k - 1), lambda y: y - 1, x)
        return level(x, depth)
    return jax.jit(f).lower(jnp.ones(4))


def test_a_program_nested_deeper_than_the_walk_is_keyed(monkeypatch):
    """210 nested conds (the walk stops at 200 levels): keyed by the
    canonical bytecode, the same for the same program, another for another,
    in every form."""
    monkeypatch.setattr(sys, "getrecursionlimit", sys.getrecursionlimit)  # (restored after)
    sys.setrecursionlimit(20_000)  # JAX's own tracing recurses per level
    a, again, other = nested(210, 1.0), nested(210, 1.0), nested(210, 2.0)
    for form in ("module", "mlir-bytecode", "hlo-proto"):
        got = []
        for lowered in (a, again, other):
            if form == "module":
                got.append(keys.program_digest(lowered.compiler_ir(), keys.default_config())[0])
                continue
            if form == "mlir-bytecode":
                out = io.BytesIO()
                lowered.compiler_ir().operation.write_bytecode(file=out)
                data = out.getvalue()
            else:
                data = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
            k = keys.program_key(data)
            assert not k.unparsed and k.components["program_format"] == form, k.unparsed
            got.append(k.components["program"])
        assert got[0] == got[1] != got[2], form


def test_a_portable_artifact_is_keyed_at_every_door(tmp_path):
    """jax.export's module (a StableHLO portable artifact) keys as a program
    in the core, so `compilecast key` and the PJRT door key it alike."""
    from jax import export

    from compilecast.worker.pjrtdoor import pjrtkeys

    made = [export.export(jax.jit(lambda x, c=c: jnp.tanh(x) * c))(jnp.ones(4))
            for c in (2.0, 2.0, 3.0)]
    got = [keys.program_key(e.mlir_module_serialized) for e in made]
    assert all(k.components["program_format"] == "stablehlo-portable" and not k.unparsed
               for k in got)
    digests = [k.components["program"] for k in got]
    assert digests[0] == digests[1] != digests[2]
    assert pjrtkeys.program_component(made[0].mlir_module_serialized, "mlir")[:2] == \
        (digests[0], "stablehlo-portable")
    path = tmp_path / "exported.mlirbc"
    path.write_bytes(made[0].mlir_module_serialized)
    done = subprocess.run([sys.executable, "-m", "compilecast.cli", "key", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == got[0].value
