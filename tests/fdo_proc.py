"""One process of a 2-process job that hands JAX's FDO-profile exchange a
profile (tests/test_e2e_jobs.py). On CPU, PGLE collects an empty trace, so the
profile bytes are given here; everything else is JAX's own path: its
`_share_fdo_profiles`, called as the PGLE recompile calls it, with the
program's module, devices and compile options.

Usage: fdo_proc.py WORKER PROCESS_ID NUM_PROCESSES DIST_ADDR PROFILE
"""

import json
import sys


def main() -> None:
    target, pid, n, dist, profile = sys.argv[1:6]
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(dist, num_processes=int(n), process_id=int(pid))
    jax.devices()
    import compilecast.jax as cc

    cache = cc.enable(target, job="fdo-job")
    # JAX's private compile path, as the PGLE recompile reaches it (test-only).
    from jax._src import compiler, distributed

    lowered = jax.jit(lambda x: (x @ x.T).sum()).lower(np.ones((64, 64), np.float32))
    module = lowered.compiler_ir("stablehlo")
    device = jax.devices()[0]
    devices = np.array([[device]])
    opts = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                        device_assignment=devices)
    opts.executable_build_options.fdo_profile = profile.encode()
    got = compiler._share_fdo_profiles(module, devices, opts, device.client,
                                       distributed.global_state.client, 0)
    print(json.dumps({"process": int(pid), "profile": bytes(got).decode(),
                      "stats": cache.stats.as_dict()}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
