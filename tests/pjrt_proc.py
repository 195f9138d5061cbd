"""A JAX training step on a PJRT plugin, as a user's script: no compilecast
import. The plugin is $PJRT_PLUGIN_PATH (the interposer, or the real plugin).
Prints one JSON line: the loss, and whether compilecast was imported.

    python pjrt_proc.py [--ready FILE --go FILE]   (write FILE, wait for GO)
"""

import argparse
import json
import os
import sys
import time

from jax._src import xla_bridge

ap = argparse.ArgumentParser()
ap.add_argument("--ready", default="")
ap.add_argument("--go", default="")
args = ap.parse_args()

xla_bridge.register_plugin("ccplug", library_path=os.environ["PJRT_PLUGIN_PATH"])
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_platforms", "ccplug")


def loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w[0]) @ w[1] - y) ** 2)


@jax.jit
def step(w, x, y):
    value, grads = jax.value_and_grad(loss)(w, x, y)
    return [p - 0.05 * g for p, g in zip(w, grads, strict=True)], value


x = jnp.linspace(-1.0, 1.0, 64 * 16).reshape(64, 16)
y = jnp.sin(x.sum(axis=1, keepdims=True))
w = [jnp.full((16, 32), 0.01), jnp.full((32, 1), 0.02)]
if args.ready:
    open(args.ready, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(args.go):
        if time.monotonic() > deadline:
            sys.exit("never told to go")
        time.sleep(0.02)
for _ in range(3):
    w, value = step(w, x, y)
print(json.dumps({"loss": float(value), "platform": jax.devices()[0].platform,
                  # compilecast's JAX integration: never imported here (JAX's plugin
                  # discovery imports compilecast's entry point, which does nothing
                  # without COMPILECAST_ENABLE).
                  "compilecast_jax": sorted(m for m in sys.modules if m in (
                      "compilecast.jax", "compilecast.worker.jaxdoor.jax_integration",
                      "compilecast.worker.xla.jax_adapter"))}))
