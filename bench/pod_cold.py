"""A pod's cold start at scale: H hosts x M programs of one job that nobody
has compiled, asked two ways of one coordinator (and etcd), side by side in
one run:

- by stream (WatchJob): each host opens one stream for the job and says
  which process it serves; program after program, it waits for the key its
  processes need next until it hears of its publish (the job's news, sent to
  every host), naming the key upstream only when nobody has claimed it
  within NAME_AFTER_S (as a worker does: worker/daemon/jobstream.py);
- per key (the path without a stream, in its most favorable form): each
  host asks for the key (Acquire: WAIT), then waits for it (Wait, until the
  HIT), program after program.

One designated process compiles the M programs in turn (`--compile-ms`
each: Acquire, the compile's time, Publish), as JAX's rule makes process 0
compile a program its devices span. Hosts are workers as the protocol sees
them: many to this process, over a few channels. Measured: the coordinator's
and etcd's CPU-seconds, the compiles' time (the last publish), and the time
until every host holds every HIT; the per-key path's cost is fitted a
host-program, the stream's a host and a program.

    python bench/pod_cold.py [--hosts 100 300 1000] [--programs 1000]
                             [--per-key 100] [--compile-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, cpu_seconds, fit_line

from compilecast import wire
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.daemon.jobstream import NAME_AFTER_S

CHANNELS = 8
HOSTS_A_CHANNEL = 100  # (a real host has a connection of its own)
HOSTS_A_PROCESS = 500  # hosts a client process holds (a real host is a process of its own)


def keys_of(job: str, m: int) -> list[str]:
    return [f"{job}-prog{i:06d}" for i in range(m)]


async def compile_all(stub, job: str, keys: list[str], compile_s: float) -> float:
    """The designated process compiles and publishes each key in turn: when the last landed."""
    me = pb.Requester(job=job, process_id=0, designated_process=0, client="designated")
    for k in keys:
        a = await stub.Acquire(pb.AcquireRequest(key=k, requester=me), timeout=60)
        assert a.decision == pb.COMPILE, a
        await asyncio.sleep(compile_s)
        data = f"executable of {k}".encode().ljust(1024, b".")
        header = pb.PublishHeader(key=k, lease=a.lease, size=len(data), requester=me,
                                  digest=hashlib.sha256(data).hexdigest(),
                                  compile_time_seconds=compile_s)
        await stub.Publish(iter([pb.PublishChunk(header=header), wire.DataChunk(data)]),
                           timeout=60)
    return time.monotonic()


async def host_by_stream(stub, job: str, pid: int, keys: list[str], opened: asyncio.Event,
                         ready: list[int], h: int) -> float:
    """A host that waits for each key on its job's stream: when it held every HIT."""
    me = pb.Requester(job=job, process_id=pid, designated_process=0, client=f"host{pid}")
    heard: set[str] = set()
    claimed: set[str] = set()
    news = asyncio.Event()
    wants: asyncio.Queue[str | None] = asyncio.Queue()

    async def requests():
        yield pb.JobWatchRequest(job=job, requester=me)
        while (k := await wants.get()) is not None:
            yield pb.JobWatchRequest(waits=[pb.WaitRequest(key=k, requester=me)])

    call = stub.WatchJob(requests())

    async def read() -> None:
        first = True
        async for events in call:
            if first:
                first = False
                ready[0] += 1
                if ready[0] == h:
                    opened.set()
                continue
            claimed.update(events.claimed)
            heard.update(info.key for info in events.published)
            assert not events.ask and not events.turns, events
            news.set()

    reader = asyncio.ensure_future(read())
    reader.add_done_callback(lambda t: t.cancelled() or t.exception() is None or print(
        f"host {pid}: its stream failed: {t.exception()!r}", file=sys.stderr, flush=True))
    await opened.wait()
    for k in keys:
        named_at = time.monotonic() + NAME_AFTER_S
        while k not in heard:
            if reader.done():  # its stream failed or ended: this host ends with it
                raise RuntimeError(f"host {pid}: its stream ended before {k} was published")
            if k not in claimed and named_at and time.monotonic() >= named_at:
                wants.put_nowait(k)
                named[0] += 1
                named_at = 0.0
            news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), NAME_AFTER_S)
    done = time.monotonic()
    wants.put_nowait(None)
    call.cancel()
    reader.cancel()
    return done


named = [0]  # keys the hosts named upstream (nobody had claimed them yet)


async def host_per_key(stub, job: str, pid: int, keys: list[str], start: asyncio.Event) -> float:
    me = pb.Requester(job=job, process_id=pid, designated_process=0, client=f"host{pid}")
    await start.wait()
    for k in keys:
        a = await stub.Acquire(pb.AcquireRequest(key=k, requester=me), timeout=600)
        if a.decision == pb.HIT:
            continue
        assert a.decision == pb.WAIT, a
        async for event in stub.Wait(pb.WaitRequest(key=k, requester=me), timeout=600):
            if event.decision == pb.HIT:
                break
            assert event.decision == pb.WAIT, event
    return time.monotonic()


async def stream_hosts(target: str, job: str, first: int, h: int, m: int) -> None:
    """A child process: hosts first..first+h-1 by stream. Prints "ready" when
    every stream is open, starts on a line of stdin, and prints its hosts'
    last end (time.monotonic, one clock for the machine's processes) and the
    keys they named."""
    keys = keys_of(job, m)
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, h // HOSTS_A_CHANNEL))]
    stubs = [wire.stub(ch) for ch in channels]
    opened, ready = asyncio.Event(), [0]
    hosts = [asyncio.ensure_future(host_by_stream(stubs[i % len(stubs)], job, first + i, keys,
                                                  opened, ready, h)) for i in range(h)]
    await opened.wait()
    print("ready", flush=True)
    if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
        raise SystemExit("the bench went away")  # (stdin closed: the parent failed)
    ends = await asyncio.gather(*hosts)
    print(json.dumps({"end": max(ends), "named": named[0]}), flush=True)


async def one_run(stubs, target: str, procs, way: str, h: int, m: int, compile_s: float,
                  n: int) -> dict:
    job = f"cold-{way}-{h}-{n}"
    keys = keys_of(job, m)
    start = asyncio.Event()
    children: list[subprocess.Popen] = []
    if way == "stream":  # hosts in processes of HOSTS_A_PROCESS (as hosts are processes)
        for first in range(0, h, HOSTS_A_PROCESS):
            children.append(subprocess.Popen(  # noqa: ASYNC220 (started before the clock)
                [sys.executable, __file__, "--child", target, job, str(first + 1),
                 str(min(HOSTS_A_PROCESS, h - first)), str(m)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for c in children:
            assert c.stdout is not None
            line = await asyncio.to_thread(c.stdout.readline)
            assert line.strip() == "ready", line
        hosts = []
    else:
        hosts = [asyncio.ensure_future(host_per_key(stubs[i % CHANNELS], job, i + 1, keys,
                                                    start)) for i in range(h)]
    try:
        before = {k: cpu_seconds(p) for k, p in procs.items()}
        began = time.monotonic()
        start.set()
        for c in children:
            assert c.stdin is not None
            c.stdin.write("go\n")
            c.stdin.flush()
        compiled = await compile_all(stubs[0], job, keys, compile_s)
        ends = list(await asyncio.gather(*hosts))
        named_here = 0
        for c in children:
            assert c.stdout is not None
            line = await asyncio.to_thread(c.stdout.readline)
            if not line:
                raise RuntimeError(f"a process of hosts failed (rc {c.wait()})")
            got = json.loads(line)
            ends.append(got["end"])
            named_here += got["named"]
            c.wait()
    finally:  # a failed run leaves no process of hosts behind
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    used = {k: cpu_seconds(p) - before[k] for k, p in procs.items()}
    compiles_s, all_s = compiled - began, max(ends) - began
    row = {"way": way, "hosts": h, "programs": m, "compiles_s": compiles_s, "every_hit_s": all_s,
           "over_compiles": all_s / compiles_s, "cpu_s": used, "named": named_here}
    print(f"{way:>6}: {h:>5} hosts x {m:>5} programs: compiles {compiles_s:6.1f} s, every "
          f"host holds every HIT at {all_s:6.1f} s ({all_s / compiles_s:.3f}x); CPU-s "
          f"coordinator {used['coordinator']:.2f}, etcd {used['etcd']:.2f}"
          + (f"; {named_here} keys named upstream" if way == "stream" else ""), flush=True)
    return row


def cpu_line(rows: list[dict]) -> tuple[float, float]:
    """Coordinator CPU-s = base + slope x hosts."""
    return fit_line([r["hosts"] for r in rows], [r["cpu_s"]["coordinator"] for r in rows])


async def run(args) -> dict:
    out: dict = {"stream": [], "per_key": []}
    with tempfile.TemporaryDirectory(prefix="pod-cold-") as root:
        stack = Stack(Path(root))
        try:
            target, coordinator = stack.coordinator()
            procs = {"coordinator": coordinator.pid, "etcd": stack.procs[0].pid}
            channels = [grpc.aio.insecure_channel(target) for _ in range(CHANNELS)]
            stubs = [wire.stub(ch) for ch in channels]
            compile_s = args.compile_ms / 1000
            for n, h in enumerate(args.per_key_hosts):
                out["per_key"].append(await one_run(stubs, target, procs, "perkey", h, args.programs,
                                                    compile_s, n))
            for n, h in enumerate(args.hosts):
                out["stream"].append(await one_run(stubs, target, procs, "stream", h, args.programs,
                                                   compile_s, n))
            for ch in channels:
                await ch.close()
        finally:
            stack.close()
    return out


def report(out: dict, m: int) -> dict:
    """Each path's coordinator CPU-s fitted as base + slope x hosts (the base:
    the designated process's compiles and the replica's own waits), and
    10,000 hosts x M programs each way."""
    pk_base, pk_slope = cpu_line(out["per_key"])
    st_base, st_slope = cpu_line(out["stream"])
    per_key_10k, stream_10k = pk_base + pk_slope * 10_000, st_base + st_slope * 10_000
    fitted = {"per_key_ms_a_host": pk_slope * 1e3, "per_key_base_s": pk_base,
              "stream_ms_a_host": st_slope * 1e3, "stream_base_s": st_base,
              "per_key_10k_cpu_s": per_key_10k, "stream_10k_cpu_s": stream_10k}
    print(f"fit: per key {pk_slope * 1e3:.0f} ms of coordinator CPU a host ({m} programs: "
          f"{pk_slope / m * 1e6:.0f} us a host-program) + {pk_base:.1f} s; by stream "
          f"{st_slope * 1e3:.2f} ms a host + {st_base:.1f} s")
    print(f"10,000 hosts x {m:,} programs, cold, coordinator CPU-s: by stream "
          f"{stream_10k:.0f}; per key {per_key_10k:.0f} ({per_key_10k / stream_10k:.0f}x)")
    return fitted


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        target, job, first, h, m = sys.argv[2:7]
        asyncio.run(stream_hosts(target, job, int(first), int(h), int(m)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--per-key-hosts", type=int, nargs="+", default=[30, 100])
    ap.add_argument("--programs", type=int, default=1000)
    ap.add_argument("--compile-ms", type=float, default=20.0)
    args = ap.parse_args()
    out = asyncio.run(run(args))
    out["fit"] = report(out, args.programs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
