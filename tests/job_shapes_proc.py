"""One process of a jax.distributed CPU job (gloo) that runs programs of every
shape a real multi-host job runs (tests/test_job_shapes.py, bench/job_shapes.py).

Usage: job_shapes_proc.py DIST_ADDR NUM_PROCESSES PROCESS_ID SHAPE[,SHAPE...]
       [--baseline] [--plugin] [--inject publish|key|profile]

Shapes, run in the order given (one CPU device a process):
  global    a program over every process's devices
  local     a jit and three eager ops on this process's own device
  stage     a program over the devices of processes 1..N-1 (process 0 skips it)
  stages    two programs at once: one over the lower half of the processes,
            one over the upper half (each process runs its half's)
  small     a program over every process's devices, under JAX's min compile time
  callback  a program over every process's devices with a host callback
  profile   JAX's FDO profile exchange for a program over every process's devices

--baseline: compilecast is not enabled. --plugin: it is enabled by
COMPILECAST_ENABLE=1 (JAX's plugin discovery), not by a call. --inject: a
failure of compilecast's own work (a publish that raises RuntimeError, a key
that raises TypeError, a profile exchange that raises KeyError).

Prints one JSON line: per shape, this process's XLA compiles (calls of JAX's
backend_compile_and_load), the change in compilecast's stats, the seconds it
took and a digest of this process's part of the results.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

ROWS, COLS = 8, 256


def _step(x):
    import jax.numpy as jnp

    for _ in range(6):
        x = jnp.tanh(x * 0.5 + 0.01) @ jnp.eye(COLS, dtype=x.dtype)
    return x


def _sharded(devices, seed: float):
    """An array of ROWS rows a device over `devices`, with this process's rows."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    mine = [d for d in devices if d.process_index == jax.process_index()]
    shards = [jax.device_put(np.full((ROWS, COLS), (seed + devices.index(d)) / 10, np.float32), d)
              for d in mine]
    return jax.make_array_from_single_device_arrays((ROWS * len(devices), COLS), sharding, shards)


def _digest(out) -> str:
    h = hashlib.sha256()
    for shard in sorted(out.addressable_shards, key=lambda s: s.device.id):
        h.update(np.asarray(shard.data).tobytes())
    return h.hexdigest()[:16]


def _over(devices, fn, seed: float) -> str:
    import jax

    return _digest(jax.jit(fn)(_sharded(devices, seed)))


def _callback_step(x):
    import jax

    jax.debug.callback(lambda v: None, x)
    return _step(x)


def _profile(cache) -> str:
    """JAX's FDO profile exchange, as its PGLE recompile calls it, for a program
    over every device (on CPU, PGLE collects an empty trace: the bytes are given)."""
    import jax
    from jax._src import compiler, distributed

    devices = np.array(jax.devices())
    lowered = jax.jit(_step).lower(_sharded(list(devices), 0.0))
    module = lowered.compiler_ir("stablehlo")
    opts = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                        device_assignment=devices.reshape(1, -1))
    opts.executable_build_options.fdo_profile = f"profile-of-{jax.process_index()}".encode()
    got = compiler._share_fdo_profiles(module, devices, opts, devices[0].client,
                                       distributed.global_state.client,
                                       min(devices, key=lambda d: d.id).process_index)
    return bytes(got).decode()


def run_shape(shape: str, cache) -> str | None:
    import jax
    import jax.numpy as jnp

    everyone = jax.devices()
    n = jax.process_count()
    me = jax.process_index()
    if shape == "global":
        return _over(everyone, _step, 1.0)
    if shape == "local":
        x = jax.device_put(np.full((ROWS, COLS), 0.5 + me, np.float32), jax.local_devices()[0])
        y = jnp.cos(jnp.sin(jax.jit(_step)(x)) * 3.0)
        return hashlib.sha256(np.asarray(y).tobytes()).hexdigest()[:16]
    if shape == "stage":
        if me == 0:
            return None
        return _over([d for d in everyone if d.process_index >= 1], _step, 2.0)
    if shape == "stages":
        lower = me < n // 2
        half = [d for d in everyone if (d.process_index < n // 2) == lower]
        return _over(half, _step, 3.0)
    if shape == "small":
        before = jax.config.jax_persistent_cache_min_compile_time_secs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e6)
        try:
            return _over(everyone, lambda x: x * 2.0 + 1.0, 4.0)
        finally:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
    if shape == "callback":
        return _over(everyone, _callback_step, 5.0)
    if shape == "profile":
        return _profile(cache)
    raise SystemExit(f"unknown shape {shape!r}")


def _inject(what: str, cache) -> None:
    if what == "publish":
        def publish(*args, **kwargs):
            raise RuntimeError("injected: the publish broke")

        cache.client.publish = publish
    elif what == "key":
        from compilecast.worker.keylib import keys

        def jax_key(*args, **kwargs):
            raise TypeError("injected: the key broke")

        keys.jax_key = jax_key
    elif what == "profile":
        def acquire(*args, **kwargs):
            raise KeyError("injected: the profile exchange broke")

        cache.client.acquire = acquire
    else:
        raise SystemExit(f"unknown injection {what!r}")


def main() -> None:
    dist, n, pid, shapes = sys.argv[1:5]
    flags = sys.argv[5:]
    import jax
    from jax._src import compiler

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(dist, num_processes=int(n), process_id=int(pid))
    jax.devices()
    compiles = [0]
    original = compiler.backend_compile_and_load

    def counted(*args, **kwargs):
        compiles[0] += 1
        return original(*args, **kwargs)

    compiler.backend_compile_and_load = counted
    cache = None
    if "--baseline" not in flags:
        from compilecast.worker.jaxdoor import jax_integration

        if "--plugin" not in flags:
            jax_integration.enable()
        cache = jax_integration.active_cache
        if cache is None:
            raise SystemExit("compilecast is not enabled")
        if "--inject" in flags:
            _inject(flags[flags.index("--inject") + 1], cache)

    def stats() -> dict:
        if cache is None:
            return {}
        cache._releases.flush()
        return {k: v for k, v in cache.stats.as_dict().items() if k not in ("reasons", "preloads")}

    report: dict = {"process": int(pid), "shapes": {}}
    for shape in shapes.split(","):
        before, compiled, start = stats(), compiles[0], time.monotonic()
        result = run_shape(shape, cache)
        after = stats()
        report["shapes"][shape] = {
            "seconds": time.monotonic() - start, "xla_compiles": compiles[0] - compiled,
            "result": result, "stats": {k: after[k] - before.get(k, 0) for k in after},
        }
    report["reasons"] = list(cache.stats.reasons) if cache is not None else []
    print(json.dumps(report), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
