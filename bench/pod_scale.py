"""A pod's warm start at scale: H hosts x M programs of one job whose every
program is published, asked two ways of one coordinator (and etcd), side by
side in one run:

- per key (today's path without a manifest), two forms: as workers send it,
  a request per host and key over Decide streams (`--per-request`
  decisions, measured); and its most favorable form, one AcquireMany of the
  M keys a host (`--direct` decisions, measured); every key a HIT from the
  replica's memory;
- by manifest: each host asks once for the job's manifest (GetManifest),
  whose entries then answer its M keys' HITs on the host.

Hosts are workers as the protocol sees them: many to this process, over a
few channels. Measured: the coordinator's and etcd's CPU-seconds, and the
time until every host holds every HIT. The per-key path is measured at
H x M = `--direct` decisions and its cost per decision fitted; the manifest
path is measured at every H asked (up to 10,000) and its cost fitted per host
and per program. Then `--writes`: hosts that ask key by key naming the job
(AcquireRequest.manifest_job), against etcd's revision: its writes grow with
programs, not hosts x programs.

    python bench/pod_scale.py [--hosts 1000 3000 10000] [--programs 1000]
                              [--direct 1000000] [--writes 1000x100]

The bytes (a warm host's prefetch) are not in it: they fan out as any
artifact's do (bench/fanout.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, cpu_seconds, fit_line

from compilecast import wire
from compilecast.decide import Decider
from compilecast.v1 import cache_pb2 as pb

JOB = "pod-scale"
CHANNELS = 8
IN_FLIGHT = 64  # calls under way at once (as a pod's hosts ask over a few seconds)


def keys_of(m: int) -> list[str]:
    return [f"prog{i:06d}" for i in range(m)]


async def publish_job(stub, m: int) -> None:
    """M programs of JOB, compiled and published once (1 KB each)."""
    keys = keys_of(m)
    me = pb.Requester(client="bench-publisher")
    for start in range(0, m, 500):
        page = keys[start:start + 500]
        got = await stub.AcquireMany(pb.AcquireManyRequest(requests=[
            pb.AcquireRequest(key=k, requester=me, manifest_job=JOB) for k in page]),
            timeout=120)
        sends = []
        for k, a in zip(page, got.responses, strict=True):
            if a.decision != pb.COMPILE:
                continue
            data = f"executable of {k}".encode().ljust(1024, b".")
            header = pb.PublishHeader(key=k, lease=a.lease, size=len(data), requester=me,
                                      digest=hashlib.sha256(data).hexdigest(),
                                      compile_time_seconds=30.0)
            sends.append(stub.Publish(iter([pb.PublishChunk(header=header),
                                            wire.DataChunk(data)]), timeout=120))
        await asyncio.gather(*sends)


async def fan(n: int, call, lanes: int = IN_FLIGHT) -> float:
    """Run call(i) for i in range(n), `lanes` at once: the wall seconds."""
    began = time.monotonic()
    it = iter(range(n))

    async def lane() -> None:
        for i in it:
            await call(i)

    await asyncio.gather(*(lane() for _ in range(lanes)))
    return time.monotonic() - began


def measure(procs: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in procs.items()}


async def run(args) -> dict:
    out: dict = {"per_key": [], "manifest": [], "writes": {}}
    with tempfile.TemporaryDirectory(prefix="pod-scale-") as root:
        stack = Stack(Path(root))
        try:
            target, coordinator = stack.coordinator()
            procs = {"coordinator": coordinator.pid, "etcd": stack.procs[0].pid}
            channels = [grpc.aio.insecure_channel(target, options=[
                ("grpc.max_receive_message_length", 64 << 20)]) for _ in range(CHANNELS)]
            stubs = [wire.stub(ch) for ch in channels]
            m = args.programs
            await publish_job(stubs[0], m)
            host = pb.Requester(client="bench-host")
            keys = keys_of(m)
            # The per-key path: H x M = --direct decisions, one AcquireMany a host.
            h_direct = max(1, args.direct // m)
            request = pb.AcquireManyRequest(requests=[
                pb.AcquireRequest(key=k, requester=host) for k in keys])

            async def per_key(i: int, request=request, m=m) -> None:
                got = await stubs[i % CHANNELS].AcquireMany(request, timeout=600)
                assert len(got.responses) == m and got.responses[-1].decision == pb.HIT

            before = measure(procs)
            wall = await fan(h_direct, per_key)
            used = {k: v - before[k] for k, v in measure(procs).items()}
            row = {"hosts": h_direct, "programs": m, "decisions": h_direct * m,
                   "wall_s": wall, "cpu_s": used,
                   "coordinator_us_a_decision": used["coordinator"] / (h_direct * m) * 1e6}
            out["per_key"].append(row)
            print(f"per key:  {h_direct:>6} hosts x {m:>5} programs = {h_direct * m:>9,} "
                  f"decisions in {wall:6.1f} s; CPU-s coordinator {used['coordinator']:.1f}, "
                  f"etcd {used['etcd']:.1f} ({row['coordinator_us_a_decision']:.1f} us a "
                  "decision)", flush=True)
            # The per-key path as workers send it: a request a host and key, over
            # Decide streams (CHANNELS workers' worth, each coalescing its requests).
            deciders = [Decider(st, timeout_s=600) for st in stubs]
            n_req = args.per_request

            async def one_request(i: int) -> None:
                r = pb.AcquireRequest(key=keys[i % m], requester=host)
                got = await deciders[i % CHANNELS].decide([r])
                assert got[0].decision == pb.HIT

            before = measure(procs)
            wall = await fan(n_req, one_request, IN_FLIGHT * 8)
            used = {k: v - before[k] for k, v in measure(procs).items()}
            for d in deciders:
                await d.close()
            out["per_request"] = {"decisions": n_req, "wall_s": wall, "cpu_s": used,
                                  "coordinator_us_a_decision": used["coordinator"] / n_req * 1e6}
            print(f"per key, a request each: {n_req:>9,} decisions over Decide streams in "
                  f"{wall:6.1f} s; CPU-s coordinator {used['coordinator']:.1f}, etcd "
                  f"{used['etcd']:.1f} ({used['coordinator'] / n_req * 1e6:.1f} us a "
                  "decision)", flush=True)
            # The manifest path, a call a host.
            for h in args.hosts:
                async def by_manifest(i: int) -> None:
                    got = await stubs[i % CHANNELS].GetManifest(
                        pb.ManifestRequest(job=JOB), timeout=600)
                    assert len(got.entries) >= m

                before = measure(procs)
                wall = await fan(h, by_manifest)
                used = {k: v - before[k] for k, v in measure(procs).items()}
                out["manifest"].append({"hosts": h, "programs": m, "wall_s": wall,
                                        "cpu_s": used})
                print(f"manifest: {h:>6} hosts x {m:>5} programs: every host holds "
                      f"every HIT in {wall:6.1f} s; CPU-s coordinator "
                      f"{used['coordinator']:.2f}, etcd {used['etcd']:.2f}", flush=True)
            # etcd's writes for hosts that ask key by key naming the job.
            hw, mw = (int(x) for x in args.writes.split("x"))
            wkeys = keys_of(min(mw, m))  # (published: every ask a HIT, nothing but records written)

            etcd_before, keys_before = await etcd_revision(stack.etcd)
            request = pb.AcquireManyRequest(requests=[
                pb.AcquireRequest(key=k, requester=host, manifest_job=JOB + "-w")
                for k in wkeys])

            async def asking(i: int) -> None:
                await stubs[i % CHANNELS].AcquireMany(request, timeout=600)

            await fan(hw, asking)
            await asyncio.sleep(0)
            # (the records are written in the background: until they have landed)
            for _ in range(600):
                revision, keys_now = await etcd_revision(stack.etcd)
                if keys_now - keys_before >= mw:
                    break
                await asyncio.sleep(0.05)
            out["writes"] = {"hosts": hw, "programs": mw, "requests": hw * mw,
                             "etcd_revisions": revision - etcd_before,
                             "etcd_keys_written": keys_now - keys_before}
            print(f"writes:   {hw} hosts x {mw} programs asked key by key ({hw * mw:,} "
                  f"requests naming the job): etcd {keys_now - keys_before} keys written in "
                  f"{revision - etcd_before} transactions", flush=True)
            for ch in channels:
                await ch.close()
        finally:
            stack.close()
    return out


async def etcd_revision(endpoint: str) -> tuple[int, int]:
    """etcd's current revision and how many keys it holds."""
    from etcd3.etcdrpc import rpc_pb2 as epb
    from etcd3.etcdrpc import rpc_pb2_grpc as erpc

    async with grpc.aio.insecure_channel(endpoint) as ch:
        ranged: Any = epb.RangeRequest  # (etcd3's protobufs are untyped)
        resp = await erpc.KVStub(ch).Range(ranged(key=b"\0", range_end=b"\0", count_only=True),
                                           timeout=30)
        return int(resp.header.revision), int(resp.count)


def fit(out: dict) -> dict:
    """The per-key path's cost a decision (both forms); the manifest path's a
    host (least squares over the hosts measured) and what 10,000 x 1,000
    costs each way."""
    per = [r["cpu_s"]["coordinator"] / r["decisions"] for r in out["per_key"]]
    a_decision = sum(per) / len(per)
    a_request = out["per_request"]["cpu_s"]["coordinator"] / out["per_request"]["decisions"]
    rows = out["manifest"]
    base, slope = fit_line([r["hosts"] for r in rows], [r["cpu_s"]["coordinator"] for r in rows])
    m = rows[0]["programs"]
    manifest_10k = base + slope * 10_000
    per_key_10k = a_decision * 10_000 * 1_000
    per_request_10k = a_request * 10_000 * 1_000
    return {"per_key_us_a_decision": a_decision * 1e6,
            "per_request_us_a_decision": a_request * 1e6,
            "per_request_10k_x_1k_cpu_s": per_request_10k,
            "ratio_per_request": per_request_10k / manifest_10k if manifest_10k > 0 else None,
            "manifest_ms_a_host": slope * 1e3, "manifest_base_s": base, "programs": m,
            "per_key_10k_x_1k_cpu_s": per_key_10k, "manifest_10k_x_1k_cpu_s": manifest_10k,
            "ratio": per_key_10k / manifest_10k if manifest_10k > 0 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[1000, 3000, 10000])
    ap.add_argument("--programs", type=int, default=1000)
    ap.add_argument("--direct", type=int, default=1_000_000,
                    help="decisions of the per-key path measured directly")
    ap.add_argument("--per-request", type=int, default=100_000,
                    help="decisions of the per-key path as workers send it, measured")
    ap.add_argument("--writes", default="1000x100", help="HOSTSxPROGRAMS asking key by key")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    out["fit"] = f = fit(out)
    print(f"fit: per key {f['per_request_us_a_decision']:.1f} us of coordinator CPU a "
          f"decision as workers send them, {f['per_key_us_a_decision']:.1f} us batched a host; "
          f"by manifest {f['manifest_ms_a_host']:.3f} ms a host ({f['programs']} programs)")
    if f["ratio"]:
        print(f"10,000 hosts x 1,000 programs, warm, coordinator CPU-s: by manifest "
              f"{f['manifest_10k_x_1k_cpu_s']:.1f}; per key as workers send them "
              f"{f['per_request_10k_x_1k_cpu_s']:.0f} ({f['ratio_per_request']:.0f}x), "
              f"batched a host {f['per_key_10k_x_1k_cpu_s']:.0f} ({f['ratio']:.0f}x)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
