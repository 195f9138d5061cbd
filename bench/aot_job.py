"""The several-program job of bench/aot_farm.py: the example training step
and its evaluation at two batch sizes (four programs), sized by
$BENCH_LAYERS x $BENCH_WIDTH (default 16 x 1024)."""

import os

from compilecast.demo.step import aot_programs


def programs(devices):
    layers = int(os.environ.get("BENCH_LAYERS", "16"))
    width = int(os.environ.get("BENCH_WIDTH", "1024"))
    return (aot_programs(devices, layers, width, batch=8)
            + aot_programs(devices, layers, width, batch=16))


def step(devices):
    """One program: the training step alone (bench/time_to_executable.py --tpu)."""
    layers = int(os.environ.get("BENCH_LAYERS", "16"))
    width = int(os.environ.get("BENCH_WIDTH", "1024"))
    return aot_programs(devices, layers, width, batch=8)[:1]


def step_with_weights(devices):
    """The training step with its weights baked in as constants (a seeded
    random MLP): the executable carries them, so its size is realistic
    (~80-120 MB at 16 x 1024)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from compilecast.demo.step import make_step

    layers = int(os.environ.get("BENCH_LAYERS", "16"))
    width = int(os.environ.get("BENCH_WIDTH", "1024"))
    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((width, width), dtype=np.float32) / width**0.5,
               np.zeros(width, np.float32)) for _ in range(layers)]
    mesh = Mesh(np.array(devices).reshape(-1), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    batch = 8 * len(devices)
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=sharded)
    y = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=sharded)
    step = make_step()
    baked = jax.jit(lambda x, y: step(params, x, y))  # new weights and the loss
    return [(baked, (x, y))]
