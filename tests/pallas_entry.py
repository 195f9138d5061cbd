"""A `compilecast precompile --entry tests.pallas_entry:programs` entry point:
a jitted function calling a Pallas TPU kernel, the kernel defined at line
$PALLAS_KERNEL_LINE of /src/model.py and scaling by $PALLAS_KERNEL_SCALE (as
if a user had moved or changed it)."""

from __future__ import annotations

import os

KERNEL = """
def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * SCALE + 1.0
"""


def programs(devices):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    line = int(os.environ.get("PALLAS_KERNEL_LINE", "0"))
    scale = os.environ.get("PALLAS_KERNEL_SCALE", "2.0")
    ns: dict = {}
    exec(compile("\n" * line + KERNEL.replace("SCALE", scale), "/src/model.py", "exec"), ns)
    # one (8, 128) block per device of the target's topology, the kernel on each
    mesh = Mesh(np.array(devices).reshape(-1), ("d",))
    spec = jax.ShapeDtypeStruct((8 * len(devices), 128), jnp.float32,
                                sharding=NamedSharding(mesh, P("d")))
    call = pl.pallas_call(ns["kernel"], out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))

    @jax.jit
    def scaled(x):
        return jax.shard_map(call, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                             check_vma=False)(x) * 0.5

    return [(scaled, (spec,))]
