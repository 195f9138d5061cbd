"""A JAX training step used by `make demo`, the tests and the benchmarks.

An MLP of `layers` x `width`, squared loss, one SGD step. Inputs are built
with NumPy so that the jitted step is the only program compiled.
"""

from __future__ import annotations

import hashlib

import numpy as np


def make_inputs(layers: int, width: int, batch: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = [
        (rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width),
         np.zeros((width,), np.float32))
        for _ in range(layers)
    ]
    x = rng.standard_normal((batch, width), dtype=np.float32)
    y = rng.standard_normal((batch, width), dtype=np.float32)
    return params, x, y


def make_step(lr: float = 1e-3):
    import jax
    import jax.numpy as jnp

    def loss_fn(params, x, y):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def train_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        new = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
        return new, loss

    return train_step


def result_digest(params, loss) -> str:
    """A digest of the step's outputs, to compare runs bit for bit."""
    h = hashlib.sha256()
    for w, b in params:
        h.update(np.asarray(w).tobytes())
        h.update(np.asarray(b).tobytes())
    h.update(np.asarray(loss).tobytes())
    return h.hexdigest()


def aot_programs(devices, layers: int | None = None, width: int | None = None,
                 batch: int | None = None):
    """An entry point for `compilecast precompile --entry
    compilecast.demo.step:aot_programs`: the training step (data-parallel over
    `devices`, parameters replicated) and its evaluation, as (jitted function,
    abstract arguments) pairs. Sizes from $COMPILECAST_EXAMPLE_LAYERS /
    _WIDTH / _BATCH (default 2 x 128, batch 8 per device)."""
    import os

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    layers = layers or int(os.environ.get("COMPILECAST_EXAMPLE_LAYERS", "2"))
    width = width or int(os.environ.get("COMPILECAST_EXAMPLE_WIDTH", "128"))
    batch = (batch or int(os.environ.get("COMPILECAST_EXAMPLE_BATCH", "8"))) * len(devices)
    mesh = Mesh(np.array(devices).reshape(-1), ("data",))
    rep, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = [(jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=rep),
               jax.ShapeDtypeStruct((width,), jnp.float32, sharding=rep))
              for _ in range(layers)]
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=sharded)
    y = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=sharded)
    step = make_step()

    @jax.jit
    def evaluate(params, x, y):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return jnp.mean((h - y) ** 2)

    return [(step, (params, x, y)), (evaluate, (params, x, y))]
