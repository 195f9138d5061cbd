"""One process of a 2-process jax.distributed job with JAX's automatic PGLE on,
through compilecast (tests/test_gpu_pgle.py; needs a GPU: on CPU, PGLE
collects an empty profile and JAX never exchanges one).

JAX's own path end to end: the jitted step compiles, runs its profiling runs,
then JAX recompiles it with the collected FDO profile, handing the profile of
the lowest process to the others first (`_share_fdo_profiles`, which
compilecast wraps). The process records, without changing anything:
- each profile exchange: the profile this process collected and the one it
  compiled with (sha256 and size);
- for each executable `compile_or_get_cached` returned, the sha256 of the
  cache entry it came from: the bytes this process published (JAX's put on
  process 0, compilecast's own publish elsewhere) or fetched (None: neither);
- its local shard of the result, checked against numpy.

Usage: pgle_proc.py TARGET PROCESS_ID NUM_PROCESSES DIST_ADDR JOB
Prints one JSON line. Environment: PGLE_PROC_PLAIN=1 runs a probe of the job
instead (no compilecast, no PGLE); PGLE_PROC_DUMP=1 prints what went into each
key (compile options, program); PGLE_PROC_STACKS_AFTER_S (90) when to print
every thread's stack if still running.
"""

import hashlib
import json
import sys


def _sha(data: bytes) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def _progress(what: str) -> None:
    print(f"pgle_proc: {what}", file=sys.stderr, flush=True)


def _observe(cache) -> tuple[list[dict], list[str | None]]:
    """Observers on JAX's private compile path (test-only), around
    compilecast's: the FDO profiles exchanged, and the entry behind each
    executable returned."""
    import os

    from jax._src import compiler

    from compilecast.worker.xla import jax_adapter

    exchanges: list[dict] = []
    executables: list[str | None] = []
    entry: list[str] = []  # the entry behind the executable being returned
    share = compiler._share_fdo_profiles
    compile_or_get = compiler.compile_or_get_cached
    serialize, get, put = jax_adapter.serialize, cache.get, cache.put

    def observed_serialize(*args):
        data = serialize(*args)
        entry.append(_sha(data))
        return data

    def observed_put(key, data):
        entry.append(_sha(data))
        return put(key, data)

    def observed_get(key):
        data = get(key)
        if data is not None:
            entry.append(_sha(data))
        return data

    def observed_share(computation, devices, compile_options, *rest):
        own = bytes(compile_options.executable_build_options.fdo_profile)
        got = share(computation, devices, compile_options, *rest)
        exchanges.append({"own": _sha(own), "own_bytes": len(own), "got": _sha(got),
                          "got_bytes": len(got)})
        return got

    import base64
    import inspect

    compile_params = inspect.signature(compile_or_get)

    def observed_compile(*args, **kw):
        if os.environ.get("PGLE_PROC_DUMP") == "1":  # what went into the key, to compare
            bound = compile_params.bind(*args, **kw).arguments
            options = jax_adapter.compile_options_bytes(bound["compile_options"])
            _progress(f"compile {len(executables)}: options {_sha(options)} "
                      f"{base64.b64encode(options).decode()}")
            _progress(f"compile {len(executables)}: program\n{bound['computation']}")
        entry.clear()
        executable = compile_or_get(*args, **kw)
        executables.append(entry[-1] if entry else None)
        return executable

    compiler._share_fdo_profiles = observed_share
    compiler.compile_or_get_cached = observed_compile
    jax_adapter.serialize = observed_serialize
    cache.get, cache.put = observed_get, observed_put
    return exchanges, executables


def main() -> None:
    target, pid, n, dist, job = sys.argv[1:6]
    import faulthandler
    import logging
    import os

    # A process stuck past this prints every thread's stack to stderr.
    faulthandler.dump_traceback_later(float(os.environ.get("PGLE_PROC_STACKS_AFTER_S", "90")))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger("compilecast.jax").setLevel(logging.DEBUG)  # each key's components
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")  # checked against numpy

    plain = os.environ.get("PGLE_PROC_PLAIN") == "1"  # no compilecast, no PGLE: a probe
    jax.config.update("jax_enable_pgle", not plain)
    jax.config.update("jax_pgle_profiling_runs", 2)
    jax.distributed.initialize(dist, num_processes=int(n), process_id=int(pid))
    _progress(f"initialized: {jax.devices()}")
    if plain:
        _probe(jax, np, int(n))
        return
    import compilecast.jax as cc

    cache = cc.enable(target, job=job)
    _progress("compilecast enabled")
    exchanges, executables = _observe(cache)

    x, ws, x_np, ws_np = _inputs(jax, np, int(n))

    @jax.jit
    def step(x, ws):
        for w in ws:
            x = jax.numpy.tanh(x @ w) + x
        return x

    for i in range(5):  # 2 profiled runs, then the PGLE recompile
        out = step(x, ws)
        out.block_until_ready()
        _progress(f"call {i} done")
    shard = out.addressable_shards[0]
    expected = x_np[shard.index]
    for w in ws_np:
        expected = np.tanh(expected @ w) + expected
    error = float(np.max(np.abs(np.asarray(shard.data) - expected)))

    print(json.dumps({"process": int(pid), "platform": jax.devices()[0].platform,
                      "exchanges": exchanges, "executables": executables,
                      "max_error": error, "stats": cache.stats.as_dict()}), flush=True)
    jax.distributed.shutdown()


def _inputs(jax, np, n: int):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    # Rows split across the processes, weights replicated: the partitioned
    # program needs no collective (two processes may share one GPU here).
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = NamedSharding(mesh, PartitionSpec("d"))
    whole = NamedSharding(mesh, PartitionSpec())
    rng = np.random.default_rng(0)
    width = 1024
    x_np = rng.standard_normal((512 * n, width), np.float32)
    ws_np = [rng.standard_normal((width, width), np.float32) / np.sqrt(width) for _ in range(4)]
    x = jax.make_array_from_callback(x_np.shape, rows, lambda i: x_np[i])
    ws = [jax.make_array_from_callback(w.shape, whole, lambda i, w=w: w[i]) for w in ws_np]
    return x, ws, x_np, ws_np


def _probe(jax, np, n: int) -> None:
    """The same kind of program without compilecast or PGLE."""
    x, ws, _, _ = _inputs(jax, np, n)
    out = jax.jit(lambda x, ws: sum(jax.numpy.tanh(x @ w) for w in ws))(x, ws)
    out.block_until_ready()
    _progress("probe ran")
    print(json.dumps({"probe": "ok"}), flush=True)
    jax.distributed.shutdown()

if __name__ == "__main__":
    main()
