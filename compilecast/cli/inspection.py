"""The commands that look: `compilecast status`, `key` and `explain`, and the one-line errors every command says."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from compilecast.errors import CompilecastError, DeadlineExceeded, Unavailable


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_status(args: argparse.Namespace) -> int:
    from compilecast.grpcutil import TlsFiles
    from compilecast.worker.inprocess.client import CacheClient

    client = CacheClient(args.worker, timeout_s=args.timeout, token=args.token,
                         tls=TlsFiles(args.ca_file))
    try:
        st = client.status()
    except CompilecastError as exc:
        print(f"worker {args.worker}: {_unreachable(exc, WORKER_HINT)}")
        return 2
    finally:
        client.close()
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(st, always_print_fields_with_no_presence=True), indent=2))
    else:
        _print_status(st, args.worker)
    return 0 if st.upstream_healthy else 1


def _print_status(st, worker: str) -> None:
    total = st.hits + st.misses
    ratio = f"{100.0 * st.hits / total:.1f}%" if total else "n/a"
    print(f"worker       {worker}: healthy")
    health = "healthy" if st.upstream_healthy else "UNHEALTHY"
    print(f"upstream     {st.upstream}: {health}"
          + (f" ({st.upstream_problem})" if st.upstream_problem else ""))
    bound = f" of {human_size(st.store_max_bytes)}" if st.store_max_bytes else ", unbounded"
    print(f"artifacts    {st.artifacts} ({human_size(st.store_bytes)} stored{bound}; "
          f"{st.revoked} revoked)")
    if st.store:
        print(f"store        {st.store}")
    if st.bucket_local_hits or st.bucket_local_misses or st.bucket_errors:
        reads = st.bucket_local_hits + st.bucket_local_misses
        print(f"bucket       {st.bucket_local_hits} of {reads} reads from the local cache, "
              f"{st.bucket_errors} failed requests")
    if st.host_cache_max_bytes:
        full = (f"; {st.host_uncached} passed on without a copy, the disk being full"
                if st.host_uncached else "")
        print(f"host cache   {human_size(st.host_cache_bytes)} of {human_size(st.host_cache_max_bytes)}"
              f" (disk: {human_size(st.host_disk_free_bytes)} free, "
              f"{human_size(st.host_cache_min_free_bytes)} kept free for jobs{full})")
    print(f"in flight    {st.compiles_in_flight} compiles, {st.waiters} waiters "
          f"(upstream: one per host and key; a job's streams: one per key); "
          f"{st.waiting_here} processes waiting here")
    print(f"lookups      {st.hits} hits, {st.misses} misses (hit ratio {ratio})")
    if st.coordinator_loop_busy:  # 0: an older coordinator, or one just started
        gap = (f"; asks workers for {st.decide_gap_ms} ms between Decide messages"
               if st.decide_gap_ms else "")
        print(f"load         the coordinator's event loop used "
              f"{100 * st.coordinator_loop_busy:.0f}% of a core lately{gap}")
    if st.etcd_writes_sampled:  # 0: an older coordinator, or none written yet
        print(f"etcd         the coordinator's latest {st.etcd_writes_sampled} write "
              f"transactions took p50 {st.etcd_write_p50_ms:.1f} ms, "
              f"p99 {st.etcd_write_p99_ms:.1f} ms")
    print(f"saved        {st.compile_seconds_saved:.1f} s of compile time")
    for f in st.in_flight:
        print(f"  compiling  {f.key}  by {f.holder}  for {f.age_seconds:.0f}s, "
              f"{f.waiters} waiting")
    if st.tasks_queued or st.tasks_running or st.tasks_done or st.tasks_failed:
        print(f"farm         {st.tasks_queued} queued, {st.tasks_running} running, "
              f"{st.tasks_done} done, {st.tasks_failed} failed")
    for j in st.jobs:
        print(f"job          {j.job or '(no job)'}: {j.compiles_in_flight} compiling, "
              f"{j.waiters} waiting")
    for m in st.recent_misses:
        why = ("new program" if list(m.differing) == ["new_program"]
               else f"{', '.join(m.differing)} changed")
        print(f"miss         {m.key[:24]}  {m.program_name or '?'}  ({why})  "
              f"{m.age_seconds:.0f}s ago")
    _print_pjrt(st)
    _print_directories(st)
    _print_prefetches(st)


def _tree_place(p) -> str:
    """Where a job's stream hangs in the tree of the job's news."""
    if not p.stream_open:
        return ""
    said = [f"from relay {p.stream_via}" if p.stream_via else "from the coordinator"]
    if p.stream_children:
        said.append(f"relayed to {p.stream_children:,} peers")
    if p.stream_resumes or p.stream_restarts:
        said.append(f"resumed {p.stream_resumes:,}x, started over {p.stream_restarts:,}x")
    return " (" + ", ".join(said) + ")"


def _print_prefetches(st) -> None:
    for p in st.prefetches:
        gb = 1e9
        print(f"job          {p.job}: {p.artifacts_done:,}/{p.artifacts_total:,} artifacts, "
              f"{p.bytes_done / gb:.1f} of {p.bytes_total / gb:.1f} GB"
              + (f" ({p.stopped})" if p.stopped else "")
              + (f"; its stream open, {p.stream_waits:,} waits on it" if p.stream_open else "")
              + _tree_place(p))
    if st.manifest_hits:
        print(f"manifest     {st.manifest_hits:,} hits answered from the jobs' manifests")


def _print_pjrt(st) -> None:
    for p in st.pjrt_compiles:
        print(f"pjrt         {p.platform}: {p.hits} hits, {p.compiles} compiled under the "
              f"lease, {p.local} compiled without sharing, {p.failed} not published")


def _print_directories(st) -> None:
    for d in st.directories:
        off = "; ".join(f"{what} off: {why}" for what, why in
                        (("publishes", d.publish_off), ("installs", d.install_off)) if why)
        print(f"directory    {d.kind} {d.namespace_id}: {d.entries} entries, {human_size(d.bytes)}; "
              f"{d.published} published, {d.installed} installed, {d.refused} refused"
              + (f" ({off})" if off else ""))
        print(f"  namespace  {d.namespace}")
        print(f"  path       {d.path}")


def _file_key(path: str, include_metadata: bool, *, keep_text: bool = False):
    """The key of a program file, under the same configuration (environment)
    as the JAX integration's keys."""
    import dataclasses

    from compilecast.worker.keylib.keys import KeyConfig, program_key

    try:
        cfg = KeyConfig.from_env()
    except ValueError as exc:
        raise CliError(f"key configuration: {exc}") from None
    if include_metadata:
        cfg = dataclasses.replace(cfg, include_metadata=True)
    try:
        if path == "-":  # standard input, as sha256sum reads it
            data = sys.stdin.buffer.read(MAX_PROGRAM_STREAM_BYTES + 1)
        else:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_PROGRAM_FILE_BYTES:
                    raise _Unreadable(f"cannot key {path}: {size} bytes, over "
                                      f"{MAX_PROGRAM_FILE_BYTES >> 30} GiB")
                data = f.read(MAX_PROGRAM_STREAM_BYTES + 1 if not size else size + 1)
    except OSError as exc:
        raise _Unreadable(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:  # a name the OS cannot take (a NUL byte)
        raise _Unreadable(f"cannot read {path!r}: {exc}") from None
    if len(data) > MAX_PROGRAM_STREAM_BYTES and (path == "-" or not os.path.isfile(path)):
        raise _Unreadable(f"cannot key {path}: more than {MAX_PROGRAM_STREAM_BYTES >> 30} GiB "
                          "from a stream or device")
    return program_key(data, cfg, keep_text=keep_text)


# The most `compilecast key` reads: a regular file's size is known before it
# is read; a stream or a device (/dev/zero) is read up to the smaller bound.
MAX_PROGRAM_FILE_BYTES = 16 << 30
MAX_PROGRAM_STREAM_BYTES = 2 << 30


class CliError(Exception):
    """A readable command-line error (exit status 2)."""


class _Unreadable(CliError):
    """A program file that cannot be read."""


def cmd_key(args: argparse.Namespace) -> int:
    """One line per file, like sha256sum: a file that cannot be read, or is
    not a program, is said on stderr and the others are still keyed; exit
    status 1 if any could not be. With --raw, a file that is not a program
    is keyed by its bytes instead (and marked so)."""
    failed = 0
    for path in args.files:
        try:
            key = _file_key(path, args.include_metadata)
        except _Unreadable as exc:
            print(f"compilecast: {exc}", file=sys.stderr)
            failed += 1
            continue
        if key.unparsed and not args.raw:
            print(f"compilecast: {path}: not a program ({key.unparsed}); --raw keys its bytes",
                  file=sys.stderr)
            failed += 1
            continue
        note = f"  (unparsed, keyed by raw bytes: {key.unparsed})" if key.unparsed else ""
        print(f"{key.value}  {path}{note}", flush=True)
    return 1 if failed else 0


def _seen_key(key: str, worker: str):
    """A Key built from what the coordinator recorded about `key`, and a
    line that says what it is."""
    import time

    from compilecast.worker.inprocess.client import CacheClient
    from compilecast.worker.keylib.keys import Key

    client = CacheClient(worker)
    try:
        d = client.describe(key)
    except Unavailable as exc:
        raise rpc_failed(f"{key}: worker {worker}", exc, WORKER_HINT) from None
    except CompilecastError as exc:
        raise CliError(f"{key}: {exc}") from None
    finally:
        client.close()

    def utc(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))

    about = d.program_name or "(no program name)"
    if d.first_seen_unix:  # (a key published without components has no record)
        about += f", first seen {utc(d.first_seen_unix)}"
    if d.HasField("artifact"):
        about += f", published {utc(d.artifact.created_unix)} ({human_size(d.artifact.size)})"
    return Key(components=dict(d.key_components)), about


def _explain_operand(arg: str, args: argparse.Namespace):
    """(key, its Key, what it is): a key the coordinator has seen, or a file."""
    from compilecast.worker.keylib.keys import KEY_PREFIX

    if arg.startswith(KEY_PREFIX) and not Path(arg).exists():
        # The key as asked: what was recorded of it may be partial (a
        # client need not send its components).
        return (arg, *_seen_key(arg, args.worker))
    k = _file_key(arg, args.include_metadata, keep_text=True)
    return k.value, k, arg


def cmd_explain(args: argparse.Namespace) -> int:
    from compilecast.worker.keylib.keys import explain

    (ka, a, about_a), (kb, b, about_b) = (_explain_operand(x, args) for x in (args.a, args.b))
    if ka == kb:
        print(f"same key {ka}")
        return 0
    print(f"{ka}  {about_a}")
    print(f"{kb}  {about_b}")
    for key, k in ((ka, a), (kb, b)):
        if not k.components:
            print(f"no components were recorded for {key} (its client sent none): "
                  "what differs cannot be told")
    for line in explain(a, b):
        print(line)
    return 1


WORKER_HINT = ("is `compilecast up` or `compilecast worker` running? "
               "(--worker or COMPILECAST_WORKER names another)")
SERVER_HINT = ("is a coordinator or worker listening there? "
               "(--coordinator or COMPILECAST_COORDINATOR names another)")


def _unreachable(exc: CompilecastError, hint: str) -> str:
    """Why a call failed: for a server that could not be asked, why and
    where to look ("unreachable: no socket at that path; is ... running?");
    for one that answered with an error (an INTERNAL, a coordinator's status
    relayed by a worker as UNAVAILABLE), what it answered, without the hint."""
    from compilecast.grpcutil import rpc_problem, unreachable

    problem = rpc_problem(exc)
    if problem.startswith("unreachable") or isinstance(exc, DeadlineExceeded):
        return f"{unreachable(exc)}; {hint}"
    return problem


def rpc_failed(target: str, exc: CompilecastError, hint: str = SERVER_HINT) -> CliError:
    """A failed call to `target` as a CliError; an unreachable one with `hint`."""
    return CliError(f"{target}: {_unreachable(exc, hint)}")
