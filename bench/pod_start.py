"""A pod's job start, decisions and waits only: P processes of one job (process
0 designated) each go through the same M programs. For each, process 0 gets
COMPILE, "compiles" for --compile-s and publishes a small artifact; the
others get WAIT, Wait, and are woken with HIT. Time until every process has
a HIT for every program, against M x compile-s, and where the CPU went.

    python bench/pod_start.py [--processes 1000] [--programs 5] [--compile-s 1.0]
                              [--wait-calls] [--per-host K]
                              [--components N [--components-from designated|all]]

The processes are tasks of one grpc.aio load generator, over 8 Decide
streams (as 8 workers send them) for their decisions and their waits; with
--wait-calls, each wait is a Wait call of its own instead (as before waits
went over the stream). With --per-host K, K processes share a host: its
requests and waits for one key go upstream as one, as a worker sends them
(--solo-decisions: only its waits, as before requests were shared). All of
it on the machine's 2 cores with the coordinator and etcd. With --components
N, requests carry N key components, as the JAX integration's do: from the
designated process only (what CacheClient sends), or with
--components-from all from every process (as it sent before).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, cpu_seconds, own_cpu_seconds

from compilecast.config import CoordinatorConfig
from compilecast.decide import Decider
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.daemon.decisions import HostDecisions
from compilecast.worker.daemon.waits import HostWaits

ARTIFACT = b"executable" * 1000


async def run(target: str, processes: int, programs: int, compile_s: float,
              tag: str, wait_calls: bool, per_host: int,
              solo_decisions: bool = False, components: int = 0,
              components_from_all: bool = False) -> dict[str, float]:
    channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
    stubs = [rpc.CompileCacheStub(c) for c in channels]
    deciders = [Decider(s, timeout_s=120) for s in stubs]
    # Each host's worker shares its processes' waits for one key (worker/daemon/waits.py).
    hosts = [HostWaits() for _ in range((processes + per_host - 1) // per_host)]
    # And its processes' requests (worker/daemon/decisions.py).
    shared = [HostDecisions() for _ in hosts]
    counts = {"compile": 0, "wait_hit": 0, "acquire_hit": 0, "other": 0}

    async def process(i: int) -> None:
        host = i // per_host
        who = pb.Requester(job=f"pod-{tag}", process_id=i, designated_process=0,
                           client=f"host{host}")
        stub = stubs[host % len(stubs)]
        decider = deciders[host % len(deciders)]

        async def upstream(req: pb.WaitRequest, until: bool) -> pb.WaitEvent:
            return await decider.wait(req, until_publishing=until)

        for m in range(programs):
            key = f"{tag}-program-{m}"
            comps = {}
            if components and (i == 0 or components_from_all):  # one job: one configuration
                comps = {name: hashlib.sha256(f"{key}/{name}".encode()).hexdigest()
                         for name in ["program", *(f"component_{j}" for j in
                                                   range(1, components))]}
            ask = [pb.AcquireRequest(key=key, requester=who, program_name=f"program-{m}",
                                     key_components=comps)]
            if per_host > 1 and not solo_decisions:
                resp = (await shared[host].decide(None, ask, decider.decide))[0][0]
            else:
                resp = (await decider.decide(ask))[0]
            if resp.decision == pb.COMPILE:
                counts["compile"] += 1
                await asyncio.sleep(compile_s)

                async def chunks(key=key, resp=resp):
                    yield pb.PublishChunk(header=pb.PublishHeader(
                        key=key, lease=resp.lease, digest=hashlib.sha256(ARTIFACT).hexdigest(),
                        size=len(ARTIFACT), compile_time_seconds=compile_s, requester=who))
                    yield pb.PublishChunk(data=ARTIFACT)

                await stub.Publish(chunks(), timeout=60)
            elif resp.decision == pb.HIT:
                counts["acquire_hit"] += 1
            elif resp.decision == pb.WAIT:
                wait = pb.WaitRequest(key=key, requester=who, timeout_ms=120_000)
                if wait_calls:
                    async for event in stub.Wait(wait, timeout=130):
                        if event.decision != pb.WAIT:
                            break
                else:
                    event = await hosts[host].wait(None, wait, False, upstream)
                counts["wait_hit" if event.decision == pb.HIT else "other"] += 1
            else:
                counts["other"] += 1

    t0 = time.monotonic()
    await asyncio.gather(*(process(i) for i in range(processes)))
    wall = time.monotonic() - t0
    for d in deciders:
        await d.close()
    for c in channels:
        await c.close()
    return {"wall": wall, **counts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=1000)
    ap.add_argument("--programs", type=int, default=5)
    ap.add_argument("--compile-s", type=float, default=1.0)
    ap.add_argument("--wait-calls", action="store_true",
                    help="one Wait call per wait instead of a message on the Decide stream")
    ap.add_argument("--per-host", type=int, default=1,
                    help="processes per host (one per GPU): a host's requests and waits for "
                         "one key go upstream as one")
    ap.add_argument("--solo-decisions", action="store_true",
                    help="with --per-host, each process sends its own requests (only waits "
                         "are shared)")
    ap.add_argument("--components", type=int, default=0,
                    help="key components a request carries (the JAX integration sends 11)")
    ap.add_argument("--components-from", choices=("designated", "all"), default="designated",
                    help="which processes send them: the designated one (as CacheClient "
                         "does) or every one")
    ap.add_argument("--busy-gap-ms", type=float, default=CoordinatorConfig.decide_busy_gap_ms,
                    help="the coordinator's decide_busy_gap_ms (0: it never asks for a gap)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cc-podstart-"))
    stack = Stack(root)
    try:
        target, coord = stack.coordinator(extra=("--decide-busy-gap-ms", str(args.busy_gap_ms)))
        pids = {"etcd": stack.procs[0].pid, "coordinator": coord.pid}
        before = {n: cpu_seconds(p) for n, p in pids.items()}
        c0 = own_cpu_seconds()
        row = asyncio.run(run(target, args.processes, args.programs, args.compile_s, "a",
                              args.wait_calls, args.per_host, args.solo_decisions,
                              args.components, args.components_from == "all"))
        used = {n: cpu_seconds(p) - before[n] for n, p in pids.items()}
        used["load generator"] = own_cpu_seconds() - c0
        ideal = args.programs * args.compile_s
        how = "Wait calls" if args.wait_calls else "waits on the Decide streams"
        how += f", {args.per_host} per host" if args.per_host > 1 else ""
        how += " (only waits shared)" if args.per_host > 1 and args.solo_decisions else ""
        how += (f", {args.components} components from {args.components_from}"
                if args.components else "")
        print(f"{args.processes} processes x {args.programs} programs, compile {args.compile_s} s, "
              f"{how}: "
              f"all done in {row['wall']:.2f} s ({row['wall'] / ideal:.2f}x the {ideal:.1f} s of "
              f"compiles); compiles {row['compile']}, woken with HIT {row['wait_hit']}, HIT at "
              f"once {row['acquire_hit']}, other {row['other']}; CPU seconds: " +
              ", ".join(f"{n} {v:.1f}" for n, v in used.items()))
    finally:
        stack.close()


if __name__ == "__main__":
    main()
