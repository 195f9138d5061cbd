"""One JAX process of the demo and the end-to-end tests: runs the demo
training step and prints a JSON report on its last line.

Usage: python -m compilecast.demo.proc LAYERS WIDTH [--no-compilecast] [--start-at T] [--phases]
Environment: COMPILECAST_WORKER (the worker), JAX_* as usual (JAX_PLATFORMS: cpu unless set).
"""

from __future__ import annotations

import argparse
import json
import os
import time

began = time.time()  # (the process's start, as near as Python gets to it)

ap = argparse.ArgumentParser()
ap.add_argument("layers", type=int)
ap.add_argument("width", type=int)
ap.add_argument("--no-compilecast", action="store_true")
ap.add_argument("--start-at", type=float, default=0.0, help="unix time to start compiling")
ap.add_argument("--distributed", default="", help="coordinator_address,num_processes,process_id")
ap.add_argument("--phases", action="store_true",
                help="report when compilecast's calls began and ended (from the start)")
args = ap.parse_args()

import jax  # noqa: E402

jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
if args.distributed:
    addr, n, pid = args.distributed.split(",")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(addr, num_processes=int(n), process_id=int(pid))

from jax import monitoring  # noqa: E402

from compilecast.demo.step import make_inputs, make_step, result_digest  # noqa: E402

events: dict[str, int] = {}


def _count(event: str, **kwargs: str | int) -> None:
    events[event] = events.get(event, 0) + 1


monitoring.register_event_listener(_count)

phases: dict[str, float] = {}
if not args.no_compilecast:
    import compilecast.jax

    cache = compilecast.jax.enable()
    assert cache is not None
    if args.phases:
        from compilecast.launch import time_calls

        start = args.start_at or time.time()
        time_calls(cache, phases, start, ("compile",))  # the compile under a lease
        time_calls(cache.client, phases, start, ("acquire", "wait", "fetch", "wait_and_fetch",
                                                 "publish"))

jax.devices()  # (the devices open at start, as a job's mesh opens them)
params, x, y = make_inputs(args.layers, args.width)
step = make_step()
if args.distributed:
    # One program over every device of the job: batch sharded, params replicated.
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = x.shape[0] // jax.process_count()
    lo = jax.process_index() * rows

    def shard(a, spec):
        local = a[lo:lo + rows] if spec == P("data") else a
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local, a.shape)

    params = jax.tree_util.tree_map(lambda a: shard(a, P()), params)
    x, y = shard(x, P("data")), shard(y, P("data"))
late = 0.0
if args.start_at:
    late = max(0.0, time.time() - args.start_at)  # still importing at the common start
    time.sleep(max(0.0, args.start_at - time.time()))
t0 = time.monotonic()
new_params, loss = step(params, x, y)
jax.block_until_ready(loss)
elapsed = time.monotonic() - t0

requests = events.get("/jax/compilation_cache/compile_requests_use_cache", 0)
hits = events.get("/jax/compilation_cache/cache_hits", 0)
if args.distributed:  # replicated outputs: every process holds a full copy
    new_params = jax.tree_util.tree_map(lambda a: a.addressable_data(0), new_params)
    loss = loss.addressable_data(0)
report = {
    "digest": result_digest(new_params, loss),
    "loss": float(loss),
    "seconds": elapsed,
    "to_first_step_s": time.time() - began,
    "late_s": late,
    # JAX's own accounting: compile requests that missed the cache were compiled by XLA.
    "xla_compiles": requests - hits if not args.no_compilecast else 1,
    "jax_cache_hits": hits,
    "compilecast": compilecast.jax.stats() if not args.no_compilecast else {},
    **({"phases": phases} if args.phases else {}),
}
print(json.dumps(report))
