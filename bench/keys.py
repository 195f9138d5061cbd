"""Key computation time against sha256 of the same serialized module.

    python bench/keys.py [--sizes-mb 0.1 1 10 100] [--nested]
    python bench/keys.py --side-by-side-layers 29 240 2400 14400 [--rounds 21]

For each target size it builds a real JAX program (op-heavy: a deep MLP
training step, with --nested one whose layers call a nested jit, so the module
has private functions; or constant-heavy for the largest sizes), serializes it as MLIR
bytecode and as an HloModuleProto, and times side by side, in one process:
  sha256      hashlib.sha256 over the serialized bytes
  cc-key      compilecast's canonical program key (parse, canonicalize, hash)
  jax-key     JAX's own canonicalization (strip-debuginfo + bytecode), bytecode only
and, as the JAX integration computes keys, on the module JAX holds in memory
(no parsing; sha256 of its bytecode as the reference): row "in-memory", which
also times writing that bytecode and hashing it (what hashing a module in
memory costs at the least) and the Python reference walk (what a host without
the C walk pays).
Peak RSS of each key computation is measured in a fresh subprocess.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def build(size_mb: float, nested: bool = False) -> tuple[bytes, bytes, str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from compilecast.demo.step import make_inputs, make_step

    if size_mb >= 5:  # constant-heavy: one big baked-in table
        table = np.random.default_rng(0).standard_normal(int(size_mb * 2**20 / 4),
                                                          dtype=np.float32)
        lowered = jax.jit(lambda x: x + jnp.asarray(table).sum()).lower(jnp.ones(4))
        kind = "constants"
    elif nested:  # op-heavy, each layer a call to a nested jit: private functions
        layers = max(2, int(size_mb * 2400))
        params, x, y = make_inputs(layers, 64, batch=8)
        layer = jax.jit(lambda h, w, b: jnp.tanh(h @ w + b))

        def loss_fn(params, x, y):
            h = x
            for w, b in params:
                h = layer(h, w, b)
            return jnp.mean((h - y) ** 2)

        def step(params, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads), loss

        lowered = jax.jit(step).lower(params, x, y)
        kind = f"calls ({layers} layers)"
    else:  # op-heavy: MLIR bytecode takes ~420 bytes per layer of this training step
        layers = max(2, int(size_mb * 2400))
        params, x, y = make_inputs(layers, 64, batch=8)
        lowered = make_step().lower(params, x, y)
        kind = f"ops ({layers} layers)"
    hlo = hlo_of(lowered)
    return module_bytes(lowered.compiler_ir("stablehlo")), hlo, kind, lowered.compiler_ir(
        "stablehlo")


def module_bytes(module) -> bytes:
    out = io.BytesIO()
    module.operation.write_bytecode(file=out)
    return out.getvalue()


def python_walk(module) -> bytes:
    """The in-memory key's program stream by the Python reference walk."""
    from compilecast.worker.keylib import mlircanon
    from compilecast.worker.keylib.keys import KeyConfig

    cfg = KeyConfig()
    h = hashlib.sha256()
    with module.context:
        mlircanon.stream_py(module, h, frozenset(cfg.ignore_attributes),
                            None if cfg.rename_private_functions else {})
    return h.digest()


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def jax_canonical(data) -> str:
    from jax._src import cache_key

    from compilecast.worker.xla import jax_adapter

    if not isinstance(data, bytes):  # a module in memory
        with data.context:
            return hashlib.sha256(cache_key._canonicalize_ir(data, cache_key.IgnoreCallbacks.NO)
                                  ).hexdigest()
    with jax_adapter.mlir_context():
        module = jax_adapter.ir.Module.parse(data)
        return hashlib.sha256(cache_key._canonicalize_ir(module, cache_key.IgnoreCallbacks.NO)
                              ).hexdigest()


PEAK_PROBE = """
import sys, threading, time
import compilecast.worker.keylib.keys as k
from compilecast.worker.xla import jax_adapter
jax_adapter.mlir_context()
data = open(sys.argv[1], "rb").read()

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

base, peak, done = rss(), [0.0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)

t = threading.Thread(target=sample)
t.start()
k.program_key(data)
done.set()
t.join()
print(max(peak[0], rss()) - base)
"""


def hlo_proto(layers: int) -> bytes:
    """The op-heavy training step of `layers` layers as an HloModuleProto."""
    from compilecast.demo.step import make_inputs, make_step

    params, x, y = make_inputs(layers, 64, batch=8)
    return hlo_of(make_step().lower(params, x, y))


def hlo_of(lowered: Any) -> bytes:
    """A lowered program's HloModuleProto, serialized."""
    hlo = lowered.compiler_ir("hlo")
    assert hlo is not None, "this JAX lowers no HLO"
    return hlo.as_serialized_hlo_module_proto()


def side_by_side(layer_counts: list[int], rounds: int) -> list[dict]:
    """Key and sha256 of each op-heavy HLO proto, alternating in this process,
    CPU time of this thread (this shared machine's stolen time and other
    processes stay out of it); all sizes in order, then again in reverse."""
    from compilecast.worker.keylib.keys import program_key

    protos = {n: hlo_proto(n) for n in layer_counts}
    rows = []
    for order in (layer_counts, layer_counts[::-1]):
        for n in order:
            data = protos[n]
            program_key(data)
            keys, shas = [], []
            for _ in range(rounds if len(data) < 50 << 20 else max(3, rounds // 3)):
                t0 = time.thread_time()
                program_key(data)
                t1 = time.thread_time()
                hashlib.sha256(data).digest()
                t2 = time.thread_time()
                keys.append(t1 - t0)
                shas.append(t2 - t1)
            ratios = [k / s for k, s in zip(keys, shas, strict=True)]
            row = {"layers": n, "bytes": len(data), "sha256_median_s": statistics.median(shas),
                   "key_median_s": statistics.median(keys),
                   "ratio_median": statistics.median(ratios), "ratio_best": min(ratios)}
            rows.append(row)
            print(f"HloModuleProto {n:6d} layers {len(data) / 1e6:7.2f} MB  sha256 median "
                  f"{row['sha256_median_s'] * 1e3:8.2f} ms  key median "
                  f"{row['key_median_s'] * 1e3:8.2f} ms  key / sha256: median "
                  f"{row['ratio_median']:.2f}x, best {row['ratio_best']:.2f}x "
                  f"({len(ratios)} rounds)", flush=True)
    return rows


def peak_rss_mb(path: str) -> float:
    """RSS the key computation adds on top of a process that has read the
    file and imported everything (sampled every 2 ms)."""
    return float(subprocess.check_output([sys.executable, "-c", PEAK_PROBE, path]).decode())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[0.1, 1, 10, 100])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nested", action="store_true",
                    help="op-heavy programs whose layers call a nested jit (private functions)")
    ap.add_argument("--side-by-side-layers", type=int, nargs="+", metavar="LAYERS",
                    help="instead: op-heavy HLO protos of these many layers (240: 0.83 MB, "
                         "14400: 52 MB), key and sha256 alternating, CPU time, medians")
    ap.add_argument("--rounds", type=int, default=21,
                    help="with --side-by-side-layers: rounds per proto (a third over 50 MB)")
    args = ap.parse_args()
    if args.side_by_side_layers:
        print(json.dumps({"side_by_side": side_by_side(args.side_by_side_layers, args.rounds)}))
        return

    from compilecast.worker.keylib import mlircanon
    from compilecast.worker.keylib.keys import KeyConfig, program_digest, program_key

    native = mlircanon.native_ready(wait=True)  # the self-test, once, before timing
    print("MLIR programs keyed by the C path (worker/keylib/_mlircanon.c)" if native else
          "MLIR programs keyed by the Python reference walk (no C path here)", flush=True)
    rows = []
    for size in args.sizes_mb:
        bc, hlo, kind, module = build(size, args.nested)
        for fmt, data in (("mlir-bytecode", bc), ("hlo-proto", hlo), ("in-memory", module)):
            raw = bc if fmt == "in-memory" else data
            sha = best_of(lambda d=raw: hashlib.sha256(d).digest(), args.repeat)
            serialized = py_walk = float("nan")
            if fmt == "in-memory":
                ours = best_of(lambda m=data: program_digest(m, KeyConfig()), args.repeat)
                # What a host without the C walk pays (no compiler, or no verdict yet).
                py_walk = best_of(lambda m=data: python_walk(m), args.repeat)
                # What hashing the module JAX holds takes at the least: writing it out first.
                serialized = best_of(lambda m=data: hashlib.sha256(module_bytes(m)).digest(),
                                     args.repeat)
            else:
                ours = best_of(lambda d=data: program_key(d), args.repeat)
            theirs = best_of(lambda d=data: jax_canonical(d), args.repeat) \
                if fmt != "hlo-proto" else float("nan")
            if fmt == "in-memory":
                rss = float("nan")
            else:
                with tempfile.NamedTemporaryFile(suffix=".bin") as f:
                    f.write(data)
                    f.flush()
                    rss = peak_rss_mb(f.name)
            data = raw
            row = {"target_mb": size, "kind": kind, "format": fmt,
                   "bytes": len(data), "sha256_s": sha, "cc_key_s": ours,
                   "cc_vs_sha256": ours / sha, "jax_key_s": theirs,
                   "jax_vs_sha256": theirs / sha, "key_peak_rss_mb": rss,
                   "write_and_sha256_s": serialized, "python_walk_s": py_walk}
            rows.append(row)
            print(f"{fmt:14s} {len(data) / 2**20:8.2f} MB {kind:22s} sha256 {sha * 1e3:9.2f} ms  "
                  f"cc-key {ours * 1e3:9.2f} ms ({ours / sha:7.1f}x)  "
                  f"jax-key {theirs * 1e3:9.2f} ms ({theirs / sha:7.1f}x)  "
                  f"peak +{rss:.0f} MB" + (f"  write+sha256 {serialized * 1e3:.2f} ms "
                                           f"(cc {ours / serialized:.2f}x)  python walk "
                                           f"{py_walk * 1e3:.1f} ms ({py_walk / sha:.0f}x)"
                                           if fmt == "in-memory" else ""), flush=True)
    print(json.dumps({"native_mlir_walk": native, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rows": rows}))


if __name__ == "__main__":
    main()
