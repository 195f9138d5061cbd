"""One host of bench/aot_farm.py's simulated pod.

Usage: _pod_process.py MODE COORDINATOR TOPOLOGY PROCESS_ID N DIST_ADDR T0 [ENTRY [GO]]

MODE local:     compile every program here (no compilecast)
     one:       process 0 compiles every program, the others only take part in the
                job (the same programs as the job compiles, one compile at a time)
     share:     compilecast at job start: process 0 compiles and publishes, the
                others wait and fetch and verify as the publish starts (streamed)
     share-after: the same, but the others fetch only once the publish is done
     prewarmed: fetch and verify every program (the farm compiled them)
Prints one JSON line; `ready` is seconds from T0 (the common start) until
this process holds every executable's verified bytes. With GO (a time after
every process has started and lowered its programs), the processes wait for
it and `ready` counts from GO instead; `late` says how far past GO this
process finished lowering (0 when it was in time). With BENCH_HOST_CGROUP
(a cgroup of the cpu controller, bench/_netem.quota) the process joins it at GO,
after its start-up and lowering: from then on it has that many cores of its
own, as a pod's host has.
"""

import json
import os
import sys
import time


def main() -> None:
    mode, coordinator, topology, pid, n, dist, t0 = sys.argv[1:8]
    entry = sys.argv[8] if len(sys.argv) > 8 else "aot_job:programs"
    go = float(sys.argv[9]) if len(sys.argv) > 9 else 0.0
    pid, n, t0 = int(pid), int(n), float(t0)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The processes that only wait reach the job's shutdown barrier long before
    # one compiling on a host of a fraction of a core (BENCH_HOST_CGROUP) is done:
    # JAX's default of 5 minutes there would fail the job.
    jax.distributed.initialize(dist, num_processes=n, process_id=pid,
                               shutdown_timeout_seconds=3600)
    # Every process brings up its CPU backend now, together, as a real job
    # does at start (JAX's compile path would otherwise do it later, alone).
    jax.devices()
    from compilecast.launch import time_calls
    from compilecast.worker.inprocess.client import CacheClient, Identity
    from compilecast.worker.jaxdoor import aot

    programs = aot.entry_programs(entry, aot.parse_target(topology))
    # A process makes its client and settles its key path at start-up, as
    # compilecast.enable() does before the first compile (the channel
    # connects on the first call).
    client = None if mode in ("local", "one") else CacheClient(
        coordinator, timeout_s=60.0,
        identity=Identity(job="bench-pod", process_id=pid, designated_process=0))
    if client is not None:
        aot.prepare()  # as enable() does: the first key's once-per-process work
    lowered = time.time() - t0
    late = max(0.0, time.time() - go) if go else 0.0
    if go:
        time.sleep(max(0.0, go - time.time()))
        t0 = go
    if cgroup := os.environ.get("BENCH_HOST_CGROUP"):
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))  # every thread of the process (cgroup v1)
    compiles, nbytes = 0, 0
    phases: dict[str, float] = {}
    time_calls(aot, phases, t0, ("compile_entry",))
    if mode == "one" and pid != 0:
        pass  # in the job, idle: process 0 compiles alone (the baseline for this job's programs)
    elif mode in ("local", "one"):
        for p in programs:
            _, data, _ = aot.compile_entry(p.trigger)
            compiles, nbytes = compiles + 1, nbytes + len(data)
    else:
        assert client is not None  # (made for every mode but these two)
        time_calls(client, phases, t0)
        if mode in ("share", "share-after"):
            for p in programs:
                # share: waiters fetch (and verify) as the holder starts publishing.
                out = aot.compile_and_share(client, p, fetch=mode == "share")
                compiles += out.status == "published"
                if out.status != "published" and out.data is None:
                    out.data = client.fetch(out.key)[1]  # verified against its digest
                nbytes += len(out.data) if out.data is not None else out.size
        else:
            found = aot.check(client, programs)  # fetch + verify every artifact
            assert all(f.present for f in found), found
            nbytes = sum(f.size for f in found)
    print(json.dumps({"process": pid, "mode": mode, "ready": time.time() - t0,
                      "lowered": lowered, "late": late, "compiles": compiles, "bytes": nbytes,
                      "phases": phases}),
          flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
