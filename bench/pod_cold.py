"""A pod's cold start at scale: H hosts x M programs of one job that nobody
has compiled, asked two ways of one coordinator (and etcd), side by side in
one run:

- by stream, down the tree (WatchJob): the replica serves `--fanout`
  streams of the job and points the rest at hosts that relay the job's news
  (worker/daemon/jobrelay.py, each from a gRPC server of its own, as a
  worker's relay port serves it), and so down the tree. Every host that
  relays is the worker's own JobStream (worker/daemon/jobstream.py), 500 to
  a client process; the hosts at the leaves (they relay nothing) are, by
  default, hosts as the protocol sees them, from one Go process
  (bench/loadgen/leaves: a WatchJob stream a host, the JobStream's rules)
  that costs this machine a fraction of their CPU as Python processes
  (`--leaves python`: JobStreams too). A host waits for each program in turn
  on its stream, naming a key upstream only when nobody has claimed it
  within NAME_AFTER_S;
- per key (the path a worker takes without a stream): each host asks for
  the key and waits for it on Decide streams (compilecast/decide.py's
  Decider, as a worker's Deciders send them), program after program.

One designated process compiles the M programs in turn (`--compile-ms`
each: Acquire, the compile's time, Publish), as JAX's rule makes process 0
compile a program its devices span; with --designated-dies it dies holding
the last program's lease, and the run says when a host was given the turn.
Measured: the coordinator's and etcd's CPU-seconds, the compiles' time (the
last publish), the time until every host holds every HIT, the keys named
upstream, the streams the replica serves and the news's bytes it sent (its
/metrics), the hosts' own CPU-seconds (the relays' and the leaves'), and
when the relays and the leaves held every HIT after the last publish. The
per-key path's coordinator CPU is taken a host and program from its rows
(--per-key-programs: on fewer programs than the stream's) and set against
each stream row.

    python bench/pod_cold.py [--hosts 1200 10000] [--programs 100] [--compile-ms 50]
                             [--per-key-hosts 5000 10000] [--per-key-programs 5]
                             [--fanout 32] [--designated-dies] [--lease-ttl-s 10]
                             [--leaves go|python] [--lockstep]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, cpu_seconds, go_built, scraped

from compilecast import jobtree, wire
from compilecast.decide import Decider
from compilecast.launch import free_port
from compilecast.serving import make_server
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.daemon import jobrelay
from compilecast.worker.daemon.jobstream import NAME_AFTER_S, JobStream
from compilecast.worker.daemon.upstream import CoordinatorLink

CHANNELS = 8
HOSTS_A_CHANNEL = 100  # (a real host has a connection of its own)
HOSTS_A_PROCESS = 500  # hosts a client process holds (a real host is a process of its own)
PROFILE: list = []  # with POD_COLD_PROFILE, a process of hosts's profile of the run


def keys_of(job: str, m: int) -> list[str]:
    return [f"{job}-prog{i:06d}" for i in range(m)]


class Probe:
    """A host of the job opened after every other (so placed deepest in the
    tree), by which the designated process runs in lockstep: program N+1 is
    compiled once this host heard program N, as a JAX job's next program is
    traced only after every host ran the last (its collectives join them).
    `lags`: each program's publish to its hearing here, in seconds."""

    def __init__(self, target: str, job: str) -> None:
        self.link = CoordinatorLink(target, token="", rpc_timeout_s=60)
        self.heard: dict[str, asyncio.Event] = {}
        self.lags: list[float] = []
        self.stream = JobStream(self.link, (), job, self._published)

    def _published(self, infos: list[pb.ArtifactInfo]) -> None:
        for i in infos:
            self.heard.setdefault(i.key, asyncio.Event()).set()

    async def heard_of(self, key: str, since: float) -> None:
        await self.heard.setdefault(key, asyncio.Event()).wait()
        self.lags.append(time.monotonic() - since)

    async def close(self) -> None:
        await self.stream.close()
        await self.link.close()


async def compile_all(stub, job: str, keys: list[str], compile_s: float,
                      dies: bool = False, probe: Probe | None = None) -> float:
    """The designated process compiles and publishes each key in turn: when
    the last landed. With `dies`, it dies holding the last key's lease
    (neither publishes, renews nor releases it): when it died. With `probe`
    (lockstep), each next key once the probe heard the last."""
    me = pb.Requester(job=job, process_id=0, designated_process=0, client="designated")
    for i, k in enumerate(keys):
        a = await stub.Acquire(pb.AcquireRequest(key=k, requester=me), timeout=60)
        assert a.decision == pb.COMPILE, a
        if dies and i == len(keys) - 1:
            return time.time()
        await asyncio.sleep(compile_s)
        await publish(stub, k, a.lease, me, compile_s)
        if probe is not None:
            await probe.heard_of(k, time.monotonic())
    return time.time()


async def publish(stub, key: str, lease: pb.Lease, me: pb.Requester, compile_s: float) -> None:
    data = f"executable of {key}".encode().ljust(1024, b".")
    header = pb.PublishHeader(key=key, lease=lease, size=len(data), requester=me,
                              digest=hashlib.sha256(data).hexdigest(),
                              compile_time_seconds=compile_s)
    await stub.Publish(iter([pb.PublishChunk(header=header), wire.DataChunk(data)]), timeout=60)


class Relay(rpc.CompileCacheServicer):
    """A simulated host's relay endpoint: WatchJob of its job's subtree (as a
    worker's RelayService serves it)."""

    stream: JobStream | None = None

    async def WatchJob(self, request_iterator, context):
        async for events in jobrelay.watch(
                request_iterator, lambda job: self.stream.subtree if self.stream else None):
            yield events


async def stream_hosts(target: str, job: str, ranks: list[int], m: int, relays: int,
                       fanout: int, compile_s: float) -> None:
    """A child process: the hosts of `ranks` by stream, each the worker's own
    JobStream (worker/daemon/jobstream.py); a host of rank <= `relays` relays
    the job's news to its subtree (jobrelay.py) from a gRPC server of its own.
    Opens the relays' streams ("relays"), then on a line of stdin the
    others' ("ready"), then on another runs: prints its hosts' last end
    (time.monotonic, one clock for the machine's processes) and how many
    streams failed a wait."""
    keys = keys_of(job, m)
    links = [CoordinatorLink(target, token="", rpc_timeout_s=60)
             for _ in range(max(1, len(ranks) // HOSTS_A_CHANNEL))]
    servers: list[grpc.aio.Server] = []
    streams: dict[int, JobStream] = {}
    heard: dict[int, set[str]] = {}

    async def open_hosts(these: list[int]) -> None:
        for rank in these:
            got = heard[rank] = set()
            relay = Relay()  # type: ignore[abstract]
            address = ""
            if rank <= relays:  # (served as a worker's relay service is: wire.SERIALIZED)
                server, _ = make_server(relay)
                address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
                await server.start()
                servers.append(server)
            relay.stream = streams[rank] = JobStream(
                links[rank % len(links)], (), job,
                lambda infos, got=got: got.update(i.key for i in infos),
                relay_address=address, fanout=fanout)
        waited = 0
        while not all(streams[r].live for r in these):
            await asyncio.sleep(0.05)
            waited += 1
            if waited % 200 == 0:
                print(f"not open after {waited / 20:.0f} s: hosts "
                      f"{[r for r in these if not streams[r].live][:20]}", file=sys.stderr,
                      flush=True)

    await open_hosts([r for r in ranks if r <= relays])
    print("relays", flush=True)
    await step("leaves")
    await open_hosts([r for r in ranks if r > relays])
    print("ready", flush=True)
    await step("go")
    for profile in PROFILE:  # (the run alone: from "go" to every host's end)
        profile.enable()
    cpu0 = time.process_time()
    failed, turns = [0], []

    async def host(rank: int) -> float:
        me = pb.Requester(job=job, process_id=rank, designated_process=0, client=f"host{rank}")
        stream, got = streams[rank], heard[rank]
        for k in keys:
            if k in got:
                continue
            event = await stream.wait(pb.WaitRequest(key=k, requester=me))
            if event is not None and event.decision == pb.COMPILE:  # its turn: it compiles
                turns.append({"host": rank, "key": k, "at": time.time()})
                await asyncio.sleep(compile_s)
                await publish(stream.link.up, k, event.lease, me, compile_s)
                continue
            if event is None or event.decision != pb.HIT:  # (the stream could not serve it)
                failed[0] += 1
                raise RuntimeError(f"host {rank}: {k} ended {event}")
        return time.time()

    ends = await asyncio.gather(*(host(r) for r in ranks))
    for profile in PROFILE:
        profile.disable()
    print(json.dumps({"end": max(ends), "first_end": min(ends), "failed": failed[0], "turns": turns,
                      "cpu_s": time.process_time() - cpu0,
                      "children": {r: len(s.subtree.children) for r, s in streams.items()
                                   if s.subtree is not None and s.subtree.children}}),
          flush=True)
    await step("end")  # (its relays serve the leaves below them until every host is done)
    for s in streams.values():
        await s.close()
    for server in servers:
        await server.stop(None)
    for link in links:
        await link.close()


async def step(word: str) -> None:
    if (await asyncio.to_thread(sys.stdin.readline)).strip() != word:
        raise SystemExit("the bench went away")  # (stdin closed: the parent failed)


async def host_per_key(decider: Decider, job: str, pid: int, keys: list[str],
                       start: asyncio.Event) -> float:
    """A host without a stream: a decision and a wait a key, on a Decide
    stream upstream (as a worker's Deciders send them)."""
    me = pb.Requester(job=job, process_id=pid, designated_process=0, client=f"host{pid}")
    await start.wait()
    for k in keys:
        a = (await decider.decide([pb.AcquireRequest(key=k, requester=me)]))[0]
        if a.decision == pb.HIT:
            continue
        assert a.decision == pb.WAIT, a
        event = await decider.wait(pb.WaitRequest(key=k, requester=me, timeout_ms=600_000))
        assert event.decision == pb.HIT, event
    return time.time()


def tree_relays(hosts: int, fanout: int) -> int:
    """Hosts that relay: the nodes that have children in the tree that forms
    when every host relays and they come in rank order (the replica's
    `fanout`, then `fanout` under each of those; further hosts under those)."""
    if hosts <= fanout:
        return 0
    return fanout + min(fanout * fanout, max(0, hosts - fanout - fanout * fanout))


@dataclass
class Replica:
    """The coordinator under measure: its address, the processes whose CPU
    is counted, and its /metrics."""

    target: str
    pids: dict[str, int]
    metrics_port: int
    ip: str


async def one_run(replica: Replica, way: str, h: int, m: int, compile_s: float,
                  n: int, fanout: int, dies: bool = False, leaves: Path | None = None,
                  lockstep: bool = False) -> dict:
    job = f"cold-{way}-{h}-{n}"
    keys = keys_of(job, m)
    target = replica.target
    start = asyncio.Event()
    children: list[subprocess.Popen] = []
    stubs = [wire.stub(grpc.aio.insecure_channel(target)) for _ in range(CHANNELS)]
    probe: Probe | None = None
    deciders = [Decider(s, timeout_s=600) for s in stubs]
    relays = tree_relays(h, fanout)
    streams = 0.0
    if way == "stream":  # hosts in processes of HOSTS_A_PROCESS (as hosts are processes)
        python = relays if leaves else h  # (the worker's JobStreams; the rest: Go leaves)
        every = (python + HOSTS_A_PROCESS - 1) // HOSTS_A_PROCESS  # (ranks dealt out in turn)
        for p in range(every):
            children.append(subprocess.Popen(  # noqa: ASYNC220 (started before the clock)
                [sys.executable, __file__, "--child", target, job, f"{p + 1}:{every}:{python}",
                 str(m), str(relays), str(fanout), str(compile_s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for word, then in (("relays", "leaves"), ("ready", None)):
            if word == "ready" and leaves and python < h:  # (once the relays are open)
                children.append(subprocess.Popen(  # noqa: ASYNC220
                    [str(leaves), "-target", target, "-job", job, "-ranks", f"{python + 1}:{h}",
                     "-programs", str(m), "-name-after", f"{NAME_AFTER_S}s"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for c in children:
                assert c.stdout is not None
                line = await asyncio.to_thread(c.stdout.readline)
                if line.strip() != word:
                    raise RuntimeError(f"a process of hosts failed (rc {c.poll()}): {line!r}")
            for c in children if then else ():
                assert c.stdin is not None
                c.stdin.write(f"{then}\n")
                c.stdin.flush()
        streams = scraped(replica.metrics_port, "compilecast_coordinator_job_streams",
                          replica.ip)  # (every host's stream open)
        hosts = []
        if lockstep:  # (a host more, opened last: the deepest)
            probe = Probe(target, job)
            if await probe.stream.placed(60) == "" and h > fanout:
                print("the lockstep probe hangs from the replica", file=sys.stderr)
    else:
        hosts = [asyncio.ensure_future(host_per_key(deciders[i % CHANNELS], job, i + 1, keys,
                                                    start)) for i in range(h)]
    if way != "stream":
        probe = None
    try:
        before = {k: cpu_seconds(p) for k, p in replica.pids.items()}
        seen = {k: scraped(replica.metrics_port, k[0], replica.ip, k[1]) for k in COUNTED}
        began = time.time()
        start.set()
        for c in children:
            assert c.stdin is not None
            c.stdin.write("go\n")
            c.stdin.flush()
        compiled = await compile_all(stubs[0], job, keys, compile_s, dies,
                                     probe if lockstep else None)
        ends = list(await asyncio.gather(*hosts))
        per_relay: list[int] = []
        turns: list[dict] = []
        hosts_cpu = leaves_cpu = 0.0
        reopened = 0
        leaf_ends: list[float] = []
        relay_ends: list[float] = []
        for c in children:
            assert c.stdout is not None
            line = await asyncio.to_thread(c.stdout.readline)
            if not line:
                raise RuntimeError(f"a process of hosts failed (rc {c.wait()})")
            got = json.loads(line)
            ends.append(got["end"])
            if "hosts" in got:  # the Go leaves
                if got["failed"] or got["turns"]:
                    raise RuntimeError(f"{got['failed']} hosts at the leaves failed, "
                                       f"{got['turns']} turns came to them: {got['failures']}")
                leaves_cpu, reopened = got["cpu_s"], got["reopened"]
                leaf_ends = got["ends"]
            else:
                per_relay += got["children"].values()
                relay_ends += [got["first_end"], got["end"]]
                turns += got["turns"]
                hosts_cpu += got["cpu_s"]
        used = {k: cpu_seconds(p) - before[k] for k, p in replica.pids.items()}
        counted = {k: scraped(replica.metrics_port, k[0], replica.ip, k[1]) - seen[k]
                   for k in COUNTED}
        for c in children:  # every host done: the relays may stop
            assert c.stdin is not None
            c.stdin.write("end\n")
            c.stdin.flush()
        for c in children:
            c.wait()
    finally:  # a failed run leaves no process of hosts behind
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
        for d in deciders:
            await d.close()
        if probe is not None:
            await probe.close()
    compiles_s, all_s = compiled - began, max(ends) - began
    row = {"way": way, "hosts": h, "programs": m, "compiles_s": compiles_s, "every_hit_s": all_s,
           "over_compiles": all_s / compiles_s, "cpu_s": used}
    if way == "stream":
        row.update(named=int(counted[NAMED]), egress_bytes=int(counted[NEWS]),
                   streams_per_job=int(streams), relays=len(per_relay),
                   most_children=max(per_relay, default=0),
                   refused_publishes=int(counted[PUBLISHES] - counted[PUBLISHED]),
                   hosts_cpu_s=hosts_cpu, leaves=h - (relays if leaves else h),
                   leaves_cpu_s=leaves_cpu, leaves_reopened=reopened,
                   # after the last publish: the relays' first and last end; the
                   # leaves' first, median, 99th percentile and last
                   relays_end_s=[min(relay_ends, default=compiled) - compiled,
                                 max(relay_ends, default=compiled) - compiled],
                   leaves_end_s=[e - compiled for e in leaf_ends])
    if probe is not None and probe.lags:
        lags = sorted(probe.lags)
        row.update(lockstep=True, pure_compiles_s=m * compile_s,
                   lag_s={"min": lags[0], "median": lags[len(lags) // 2],
                          "p99": lags[min(len(lags) - 1, int(len(lags) * 0.99))],
                          "max": lags[-1]})
        print(f"lockstep: {m} programs of {compile_s * 1000:.0f} ms took {compiles_s:.1f} s "
              f"({compiles_s / (m * compile_s):.2f}x their compiles); a program's news to the "
              f"deepest host: median {row['lag_s']['median'] * 1000:.0f} ms, p99 "
              f"{row['lag_s']['p99'] * 1000:.0f} ms, max {row['lag_s']['max'] * 1000:.0f} ms",
              flush=True)
    if dies:  # the designated process died holding the last key's lease
        row["turns"] = [{"host": t["host"], "after_s": t["at"] - compiled} for t in turns]
    if dies:
        print(f"the designated process died holding {keys[-1]}: the turn went to "
              + ", ".join(f"host {t['host']} after {t['after_s']:.1f} s" for t in row["turns"])
              + f"; every host held every HIT {all_s - compiles_s:.1f} s after its death",
              flush=True)
    print(f"{way:>6}: {h:>5} hosts x {m:>5} programs: compiles {compiles_s:6.1f} s, every "
          f"host holds every HIT at {all_s:6.1f} s ({all_s / compiles_s:.3f}x); CPU-s "
          f"coordinator {used['coordinator']:.2f}, etcd {used['etcd']:.2f}"
          + (f"; {row['named']} keys named upstream; the replica served {row['streams_per_job']}"
             f" streams of the job, sent {row['egress_bytes']:,} bytes of news; {row['relays']} "
             f"relays (at most {row['most_children']} children); CPU-s of the hosts as "
             f"JobStreams {row['hosts_cpu_s']:.1f}, of the {row['leaves']} at the leaves (Go) "
             f"{row['leaves_cpu_s']:.1f}" if way == "stream" else ""),
          flush=True)
    return row


# The coordinator's counters a run reads (name, labels): its difference over the run.
NAMED = ("compilecast_coordinator_job_stream_events_total", 'event="named"')
NEWS = ("compilecast_coordinator_job_news_bytes_total", "")
PUBLISHES = ("compilecast_coordinator_publishes_total", "")
PUBLISHED = ("compilecast_coordinator_publishes_total", 'outcome="ok"')
COUNTED = (NAMED, NEWS, PUBLISHES, PUBLISHED)


async def run(args) -> dict:
    out: dict = {"stream": [], "per_key": []}
    with tempfile.TemporaryDirectory(prefix="pod-cold-") as root:
        stack = Stack(Path(root))
        try:
            port = free_port()
            target, coordinator = stack.coordinator(extra=(
                "--metrics-port", str(port), "--job-stream-fanout", str(args.fanout),
                "--lease-ttl-s", str(args.lease_ttl_s)))
            replica = Replica(target, {"coordinator": coordinator.pid,
                                       "etcd": stack.procs[0].pid}, port, stack.ip)
            compile_s = args.compile_ms / 1000
            for n, h in enumerate(args.per_key_hosts):
                out["per_key"].append(await one_run(replica, "perkey", h,
                                                    args.per_key_programs or args.programs,
                                                    compile_s, n, args.fanout))
            leaves = go_built("./leaves") if args.leaves == "go" else None
            for n, h in enumerate(args.hosts):
                out["stream"].append(await one_run(replica, "stream", h, args.programs,
                                                   compile_s, n, args.fanout,
                                                   args.designated_dies, leaves,
                                                   args.lockstep))
        finally:
            stack.close()
    return out


def report(out: dict) -> dict:
    """The per-key path's coordinator CPU-s a host and program, as its rows
    measured it (each host pays its own decision and wait for each program:
    nothing is shared across hosts or programs), at each stream row's size
    against the stream's own, measured."""
    if not out["per_key"] or not out["stream"]:
        return {}
    each = [r["cpu_s"]["coordinator"] / (r["hosts"] * r["programs"]) for r in out["per_key"]]
    mean = sum(each) / len(each)
    spread = (max(each) - min(each)) / 2
    per = {"per_key_cpu_s_a_host_program": mean, "spread": spread, "rows": []}
    for r in out["stream"]:
        n = r["hosts"] * r["programs"]
        per_key, stream = mean * n, r["cpu_s"]["coordinator"]
        per["rows"].append({"hosts": r["hosts"], "programs": r["programs"],
                            "per_key_cpu_s": per_key, "per_key_error_s": spread * n,
                            "stream_cpu_s": stream, "times": per_key / stream})
        print(f"{r['hosts']:,} hosts x {r['programs']:,} programs: per key {per_key:.0f} "
              f"+- {spread * n:.0f} coordinator CPU-s ({mean * 1e6:.0f} us a host and program, "
              f"as its rows measured it), by stream {stream:.1f} measured "
              f"({per_key / stream:.0f}x less)")
    return per


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        target, job, deal, m, relays, fanout, compile_s = sys.argv[2:9]
        p, every, h = (int(x) for x in deal.split(":"))
        run_hosts = lambda: asyncio.run(stream_hosts(  # noqa: E731
            target, job, list(range(p, h + 1, every)), int(m), int(relays), int(fanout),
            float(compile_s)))
        if out := os.environ.get("POD_COLD_PROFILE"):  # where a process of hosts spends
            import cProfile  # (its CPU, not its wall time: a loop waiting is not spending)
            PROFILE.append(cProfile.Profile(time.process_time))
            run_hosts()
            PROFILE[0].dump_stats(f"{out}.{p}")
        else:
            run_hosts()
        return
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--per-key-hosts", type=int, nargs="+", default=[30, 100])
    ap.add_argument("--programs", type=int, default=1000)
    ap.add_argument("--per-key-programs", type=int, default=0,
                    help="programs of the per-key rows (default: --programs): the per-key "
                         "path at the stream's hosts, on fewer programs")
    ap.add_argument("--compile-ms", type=float, default=20.0)
    ap.add_argument("--fanout", type=int, default=jobtree.FANOUT,
                    help="the replica's job_stream_fanout, and each relay's")
    ap.add_argument("--designated-dies", action="store_true",
                    help="by stream, the designated process dies holding the last program's "
                         "lease: when a host is given the turn, against the lease's TTL")
    ap.add_argument("--lease-ttl-s", type=int, default=10, help="the coordinator's lease_ttl_s")
    ap.add_argument("--lockstep", action="store_true",
                    help="by stream, program N+1 is compiled once a host opened last (the "
                         "deepest) heard program N, as a JAX job in lockstep: each program's "
                         "lag (median, p99, max) and the run against its compiles alone")
    ap.add_argument("--leaves", choices=("go", "python"), default="go",
                    help="the hosts at the leaves of the tree (that relay nothing): as the "
                         "protocol sees them, from Go (bench/loadgen/leaves), or each the "
                         "worker's own JobStream, as the relays are")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    out["per_key_at_stream_sizes"] = report(out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
