"""One process of a simulated pod (run by tests/test_aot.py and bench/aot_farm.py).

Usage: pod_probe.py COORDINATOR ENTRY TOPOLOGY PROCESS_ID NUM_PROCESSES DIST_ADDR

Joins a jax.distributed job of NUM_PROCESSES on DIST_ADDR (CPU, gloo), as the
processes of a real pod would, then computes every program's key as the
target's processes do (a compile-only client of TOPOLOGY stands in for the
TPU), fetches each artifact and verifies its digest. Prints one JSON line.
"""

import json
import sys
import time


def main() -> None:
    coordinator, entry, topology, pid, n, dist = sys.argv[1:7]
    start = time.monotonic()
    import jax

    if int(n) > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(dist, num_processes=int(n), process_id=int(pid))
        # Every process brings up its CPU backend now, together, as a real job
        # does at start (JAX's compile path would otherwise do it later, alone).
        jax.devices()
    from compilecast.worker.inprocess.client import CacheClient
    from compilecast.worker.jaxdoor import aot

    client = CacheClient(coordinator, timeout_s=30.0)
    programs = aot.entry_programs(entry, aot.parse_target(topology))
    found = aot.check(client, programs)
    print(json.dumps({
        "process": int(pid), "process_index": jax.process_index(),
        "keys": {p.name: p.key for p in found},
        "present": {p.name: p.present for p in found},
        "bytes": sum(p.size for p in found),
        "seconds": time.monotonic() - start,
    }), flush=True)
    if int(n) > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
