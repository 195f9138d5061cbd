"""One process of a transformer's training steps on a TPU, for
scripts/tpu_checks.sh: what it costs to reach the first step, cold or warm,
with JAX alone, JAX's own cache or compilecast.

    python bench/tpu_step.py [--layers 8] [--width 1024] [--steps 3] [--entry]

A decoder-only transformer (pure JAX: embedding, pre-norm attention and MLP
blocks unrolled over --layers, cross-entropy, Adam), its parameters and data
made with NumPy so that the jitted step is the program that matters. Prints a
JSON report on its last line:

- open_s: from the interpreter's start until the devices are open;
- first_step_s: from then until the first step's loss is on the host (its
  compile, or its load from a cache, and one step);
- wall_s: from the interpreter's start until the report;
- losses: each step's loss, as hex of its float32 bits (bitwise comparison);
- xla_compiles: the programs XLA compiled in this process (JAX's
  backend-compile events less its cache hits: a program loaded from a cache
  is none), and compilecast's counts when its integration is on.

With --entry it instead runs compilecast.demo.step:aot_programs' programs on
the real devices (what `compilecast precompile --entry` compiled ahead for
the chip's topology) and reports their keys' hits.
"""

from __future__ import annotations

import argparse
import json
import os
import time

T0 = time.time()
try:  # the process's own start, when /proc says it (imports before T0 count too)
    _ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as _f:
        _start = int(_f.read().rsplit(")", 1)[1].split()[19]) / _ticks
    with open("/proc/uptime") as _f:
        T0 = time.time() - (float(_f.read().split()[0]) - _start)
except (OSError, ValueError, IndexError):
    pass

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=int(os.environ.get("TPU_STEP_LAYERS", "8")))
ap.add_argument("--width", type=int, default=1024)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--seq", type=int, default=512)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--vocab", type=int, default=8192)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--entry", action="store_true",
                help="run compilecast.demo.step:aot_programs on the real devices instead")
args = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import monitoring  # noqa: E402

events: dict[str, int] = {}


def _count(event: str, **kwargs: object) -> None:
    events[event] = events.get(event, 0) + 1


durations: dict[str, list[float]] = {}


def _duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    durations.setdefault(event, []).append(duration_secs)


monitoring.register_event_listener(_count)
monitoring.register_event_duration_secs_listener(_duration)
devices = jax.devices()
opened = time.time()


def init(rng: np.random.Generator) -> dict:
    d, v = args.width, args.vocab

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[0])).astype(np.float32)

    layers = [{"ln1": np.ones((d,), np.float32), "qkv": dense(d, 3 * d), "out": dense(d, d),
               "ln2": np.ones((d,), np.float32), "up": dense(d, 4 * d), "down": dense(4 * d, d)}
              for _ in range(args.layers)]
    return {"embed": dense(v, d), "layers": layers, "ln": np.ones((d,), np.float32),
            "head": dense(d, v)}


def norm(x, scale):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale


def forward(params, tokens):
    b, s = tokens.shape
    h, hd = args.heads, args.width // args.heads
    x = params["embed"][tokens].astype(jnp.bfloat16)
    mask = jnp.tril(jnp.ones((s, s), bool))
    for layer in params["layers"]:
        y = norm(x.astype(jnp.float32), layer["ln1"]).astype(jnp.bfloat16)
        q, k, v = jnp.split(y @ layer["qkv"].astype(jnp.bfloat16), 3, axis=-1)
        q, k, v = (t.reshape(b, s, h, hd) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(hd)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), -1).astype(jnp.bfloat16)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, args.width)
        x = x + y @ layer["out"].astype(jnp.bfloat16)
        y = norm(x.astype(jnp.float32), layer["ln2"]).astype(jnp.bfloat16)
        x = x + jax.nn.gelu(y @ layer["up"].astype(jnp.bfloat16)) @ \
            layer["down"].astype(jnp.bfloat16)
    x = norm(x.astype(jnp.float32), params["ln"])
    return x @ params["head"]


def loss_fn(params, tokens):
    logits = forward(params, tokens[:, :-1])
    labels = jax.nn.one_hot(tokens[:, 1:], args.vocab)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))


@jax.jit
def train_step(params, opt, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    step = opt["step"] + 1
    m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], grads)
    lr = 1e-3 * jnp.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step)
    params = jax.tree_util.tree_map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8),
                                    params, m, v)
    return params, {"step": step, "m": m, "v": v}, loss


def bits(x) -> str:
    return np.asarray(x, np.float32).tobytes().hex()


def compilecast_stats() -> dict:
    try:
        import compilecast.jax
    except ImportError:
        return {}
    return compilecast.jax.stats()


report: dict[str, object] = {"devices": [str(d) for d in devices],
                             "device_kind": devices[0].device_kind,
                             "open_s": opened - T0}
if args.entry:
    from compilecast.demo.step import aot_programs

    outs = []
    for fn, abstract in aot_programs(devices):
        concrete = jax.tree_util.tree_map(
            lambda a: jax.device_put(np.ones(a.shape, a.dtype), a.sharding), abstract)
        outs.append(fn(*concrete))
    jax.block_until_ready(outs)
    report.update(programs=len(outs), first_step_s=time.time() - opened)
else:
    rng = np.random.default_rng(0)
    params = jax.device_put(init(rng))
    opt = jax.device_put({"step": np.zeros((), np.int32),
                          "m": jax.tree_util.tree_map(np.zeros_like, init(rng)),
                          "v": jax.tree_util.tree_map(np.zeros_like, init(rng))})
    batches = [jax.device_put(rng.integers(0, args.vocab, (args.batch, args.seq + 1),
                                           dtype=np.int32)) for _ in range(args.steps)]
    losses = []
    begun = time.time()
    for i, tokens in enumerate(batches):
        params, opt, loss = train_step(params, opt, tokens)
        losses.append(bits(loss))
        if i == 0:
            report["first_step_s"] = time.time() - opened
            report["compile_or_load_s"] = time.time() - begun
    report["losses"] = losses
# One backend-compile event per program JAX compiles or loads from a cache
# (each load also a cache hit): the difference is what XLA compiled.
compiled = durations.get("/jax/core/compile/backend_compile_duration", [])
hits = events.get("/jax/compilation_cache/cache_hits", 0)
report.update(wall_s=time.time() - T0, xla_compiles=len(compiled) - hits,
              jax_cache_hits=events.get("/jax/compilation_cache/cache_hits", 0),
              compilecast=compilecast_stats())
print(json.dumps(report), flush=True)
