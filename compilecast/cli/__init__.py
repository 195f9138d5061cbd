"""The `compilecast` command line. Thin: parse, load config, call in."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from compilecast import __version__
from compilecast.config import (
    ConfigError,
    CoordinatorConfig,
    WorkerConfig,
    check_address,
    default_worker_target,
    env_name,
    flag_name,
    load,
    read_small_file,
)
from compilecast.errors import CompilecastError, Unauthenticated

from . import run as cli_run
from .inspection import (
    CliError,
    cmd_explain,
    cmd_key,
    cmd_status,
    human_size,
    rpc_failed,
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(),
               "logger": record.name, "msg": record.getMessage()}
        for field in ("key", "job", "process_id"):
            if hasattr(record, field):
                out[field] = getattr(record, field)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # gRPC's own debug lines (one per event loop lookup) would drown ours.
    logging.getLogger("grpc").setLevel(max(root.level, logging.INFO))


def _add_config_flags(p: argparse.ArgumentParser, cls: type) -> None:
    p.add_argument("--config", help="YAML file of settings")
    for f in dataclasses.fields(cls):
        p.add_argument(flag_name(f.name), dest=f.name, default=None,
                       help=f"{f.metadata.get('help', '')} (env {env_name(f.name)})")


def _load(cls: type, args: argparse.Namespace):
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return load(cls, flags=flags, file=args.config)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from compilecast.coordinator.server import run

    cfg, _ = _load(CoordinatorConfig, args)
    run(cfg)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from compilecast.worker.daemon.server import run

    cfg, _ = _load(WorkerConfig, args)
    run(cfg)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """The effective settings and their sources, then every problem (exit 1
    when there is any)."""
    cls = CoordinatorConfig if args.role == "coordinator" else WorkerConfig
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    problems: list[str] = []
    cfg, sources = load(cls, flags=flags, file=args.config, validate=False, problems=problems)
    for f in dataclasses.fields(cls):
        print(f"{f.name} = {getattr(cfg, f.name)!r}    # {sources[f.name]}")
    problems += cfg.problems()
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


def cmd_up(args: argparse.Namespace) -> int:
    from compilecast.up import default_up_config, run

    cfg = default_up_config()
    if args.home:
        cfg.home = Path(args.home)
    for name in ("etcd_port", "etcd_peer_port", "coordinator_port",
                 "coordinator_metrics_port", "worker_metrics_port", "etcd_compaction_retention"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.no_tcp = args.no_tcp
    cfg.otlp_endpoint = args.otlp_endpoint
    cfg.job = args.job
    return run(cfg)


def _client(args: argparse.Namespace, timeout_s: float = 30.0):
    from compilecast.grpcutil import TlsFiles
    from compilecast.worker.inprocess.client import CacheClient

    token = args.token
    if args.token_file:
        try:
            token = read_small_file(args.token_file, "--token-file").decode("utf-8").strip()
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        except ValueError as exc:  # not UTF-8
            raise CliError(f"cannot read --token-file: {exc}") from None
    try:
        return CacheClient(args.coordinator, timeout_s=timeout_s, token=token,
                           tls=TlsFiles(args.ca_file, args.cert_file, args.key_file))
    except Unauthenticated as exc:  # a token no header can carry
        raise CliError(str(exc)) from None


def _wait_tasks(client, ids: list[str], timeout_s: float) -> int:
    """Print task progress until all are settled; 0 when all are done."""
    import time

    from compilecast.v1 import cache_pb2 as pb

    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        tasks = client.tasks(ids)
        states = [t.state for t in tasks]
        counts = {pb.TaskState.Name(s).lower(): states.count(s) for s in set(states)}
        if counts != last:
            print("tasks: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), flush=True)
            last = counts
        if all(s in (pb.DONE, pb.FAILED) for s in states) and len(tasks) == len(ids):
            for t in tasks:
                print(f"{pb.TaskState.Name(t.state):6}  {t.program_name:30}  {t.target:16}  "
                      f"{t.key[:24]:24}  {t.detail}")
            return 0 if all(s == pb.DONE for s in states) else 1
        if time.monotonic() > deadline:
            print(f"compilecast: {len(ids)} tasks not settled after {timeout_s:.0f}s",
                  file=sys.stderr)
            return 1
        time.sleep(0.5)


def cmd_precompile(args: argparse.Namespace) -> int:
    from compilecast.worker.jaxdoor import aot

    try:
        target = aot.parse_target(args.topology, args.platform)
    except aot.AotError as exc:
        raise CliError(str(exc)) from None
    client = _client(args)
    try:
        if args.farm:  # queue the work; farm workers compile it
            if args.replay:
                ids = client.submit(replay_job=args.replay, target=target)
            else:
                ids = client.submit([p.recipe for p in
                                     aot.entry_programs(args.entry, target, args.job)])
            print(f"queued {len(ids)} compile tasks for {aot.describe_target(target)}")
            for t in ids:
                print(t)
            return _wait_tasks(client, ids, args.timeout) if args.wait else 0
        if args.replay:
            programs = []
            for r in client.list_recipes(args.replay):
                r.target.CopyFrom(target)
                r.key = ""
                programs.append(aot.recipe_program(r))
            if not programs:
                raise CliError(f"no recipes recorded for job {args.replay}")
        else:
            programs = aot.entry_programs(args.entry, target, args.job)
        if args.check:
            found = aot.check(client, programs, fetch=not args.no_fetch)
            for p in found:
                print(f"{'present' if p.present else 'MISSING'}  {p.key}  {p.name}  {p.size}")
            return 0 if all(p.present for p in found) else 1
        failed = 0
        for prog in programs:
            try:
                out = aot.compile_and_share(client, prog)
                print(f"{out.status:20}  {out.key}  {out.name}  {out.seconds:.1f}s  {out.size}",
                      flush=True)
            except aot.AotError as exc:
                failed += 1
                print(f"FAILED  {prog.name}: {exc}", file=sys.stderr)
        return 1 if failed else 0
    except aot.AotError as exc:
        raise CliError(str(exc)) from exc
    except CompilecastError as exc:
        raise rpc_failed(args.coordinator, exc) from exc
    finally:
        client.close()


LS_ORDER = {"key": lambda a: a.artifact.key, "size": lambda a: -a.artifact.size,
            "age": lambda a: a.artifact.created_unix,
            "compile": lambda a: -a.artifact.compile_time_seconds}


def cmd_ls(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        listed = list(client.list_artifacts())
    except CompilecastError as exc:
        raise rpc_failed(args.coordinator, exc) from exc
    finally:
        client.close()
    if args.program:
        listed = [a for a in listed if a.program_name.startswith(args.program)]
    listed.sort(key=LS_ORDER[args.sort])
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps([MessageToDict(a) for a in listed], indent=2))
        return 0
    now = time.time()
    for a in listed:
        art = a.artifact
        age = max(0.0, now - art.created_unix) / 3600
        print(f"{art.key}  {human_size(art.size):>10}  {art.compile_time_seconds:8.1f}s  "
              f"{age:7.1f}h  {a.program_name or '-'}")
    total = sum(a.artifact.size for a in listed)
    compile_s = sum(a.artifact.compile_time_seconds for a in listed)
    print(f"{len(listed)} artifacts, {human_size(total)}, {compile_s:.1f} s of compiles "
          "(columns: key, size, compile time, age, program)")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    if not args.keys and not args.digest:
        raise CliError("name the keys (or --digest) to purge")
    client = _client(args)
    try:
        resp = client.purge(args.keys, args.digest, args.reason, dry_run=args.dry_run)
    except CompilecastError as exc:
        raise rpc_failed(args.coordinator, exc) from exc
    finally:
        client.close()
    purged, revoked, after = (("would purge   ", "would revoke  ", "") if args.dry_run else
                              ("purged   ", "revoked  ", "  (workers drop it from their host caches)"))
    for key in resp.purged:
        print(f"{purged}{key}")
    for key in resp.missing:
        print(f"missing  {key}  (no artifact under it)")
    for digest in resp.revoked:
        print(f"{revoked}{digest}{after}")
    if args.dry_run:
        print("dry run: nothing changed")
    return 1 if resp.missing else 0


def cmd_farm(args: argparse.Namespace) -> int:
    import signal
    import socket
    import threading

    from compilecast.worker.jaxdoor import aot

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = _client(args)
    name = args.name or f"{socket.gethostname()}:{os.getpid()}"
    farm = aot.FarmWorker(client, name, args.concurrency or aot.default_concurrency(),
                          heartbeat_file=args.heartbeat_file)
    logging.getLogger("compilecast").info("farm worker %s: %d concurrent compiles, coordinator %s",
                                          name, farm.concurrency, args.coordinator)
    try:
        farm.run(stop, max_tasks=args.max_tasks)
    finally:
        client.close()
    return 0


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=os.environ.get("COMPILECAST_COORDINATOR")
                   or default_worker_target(),
                   help="coordinator (or worker) address (env COMPILECAST_COORDINATOR)")
    p.add_argument("--token", default=os.environ.get("COMPILECAST_TOKEN", ""),
                   help="bearer token with publish permission (env COMPILECAST_TOKEN)")
    p.add_argument("--token-file", default="", help="file holding the bearer token")
    p.add_argument("--ca-file", default="", help="CA to verify a TLS server")
    p.add_argument("--cert-file", default="", help="client certificate (mTLS)")
    p.add_argument("--key-file", default="", help="client key (mTLS)")


def _port(raw: str) -> int:
    """A port flag's value: 0-65535 (0: any free port)."""
    try:
        port = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port in 0-65535")
    return port


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="compilecast", description=__doc__)
    ap.add_argument("--version", action="version", version=f"compilecast {__version__}")
    ap.add_argument("--log-level", default="info", type=str.lower,
                    choices=("debug", "info", "warning", "error", "critical"))
    ap.add_argument("--log-format", choices=("text", "json"), default="text")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_servers(sub)
    _add_inspect(sub)
    _add_ahead_of_time(sub)
    _add_admin(sub)
    cli_run.add_parser(sub)
    p = sub.add_parser("config", help="print the effective configuration and its sources")
    roles = p.add_subparsers(dest="role", required=True)
    for role, cls in (("coordinator", CoordinatorConfig), ("worker", WorkerConfig)):
        rp = roles.add_parser(role)
        _add_config_flags(rp, cls)
        rp.set_defaults(fn=cmd_config)
    return ap


def _add_servers(sub) -> None:
    """up, coordinator, worker."""
    p = sub.add_parser("up", help="run etcd, a coordinator and a worker on this machine")
    p.add_argument("--home", help="data directory (default ~/.cache/compilecast)")
    for name in ("etcd_port", "etcd_peer_port", "coordinator_port",
                 "coordinator_metrics_port", "worker_metrics_port"):
        p.add_argument(flag_name(name), dest=name, type=_port, default=None)
    p.add_argument("--etcd-compaction-retention", default=None,
                   help="history the local etcd keeps before compacting it (default 1h)")
    p.add_argument("--no-tcp", action="store_true",
                   help="every endpoint on a unix socket under the home (mode 0700): etcd, "
                        "the coordinator and the worker; data plane and metrics off")
    p.add_argument("--otlp-endpoint", default="",
                   help="an OpenTelemetry collector (OTLP/HTTP) the coordinator and the worker "
                        "trace to (default: $COMPILECAST_OTLP_ENDPOINT)")
    p.add_argument("--job", default="",
                   help="the job this host runs: its manifest's artifacts are prefetched into "
                        "the host cache at start, its keys' HITs answered by the worker "
                        "(default: $COMPILECAST_JOB)")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("coordinator", help="run a coordinator replica")
    _add_config_flags(p, CoordinatorConfig)
    p.set_defaults(fn=cmd_coordinator)

    p = sub.add_parser("worker", help="run the per-host worker daemon")
    _add_config_flags(p, WorkerConfig)
    p.set_defaults(fn=cmd_worker)


def _add_inspect(sub) -> None:
    """status, key, explain, ls."""
    p = sub.add_parser("status", help="health and counters of the local worker and coordinator")
    p.add_argument("--worker", default=default_worker_target())
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--token", default=os.environ.get("COMPILECAST_TOKEN", ""),
                   help="bearer token (env COMPILECAST_TOKEN)")
    p.add_argument("--ca-file", default="", help="CA to verify a TLS server")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("key", help="print the canonical key of program files (like sha256sum)")
    p.add_argument("files", nargs="+",
                   help="HloProto/HloModuleProto, StableHLO text, MLIR bytecode or a "
                        "StableHLO portable artifact (- for stdin)")
    p.add_argument("--include-metadata", action="store_true",
                   help="keep debug metadata and names in the key")
    p.add_argument("--raw", action="store_true",
                   help="key a file that is not a program by its raw bytes instead of failing")
    p.set_defaults(fn=cmd_key)

    p = sub.add_parser("explain", help="say which key components of two programs (files, or "
                                       "keys the coordinator has seen) differ")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--include-metadata", action="store_true")
    p.add_argument("--worker", default=default_worker_target())
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("ls", help="list the published artifacts of your tenant")
    p.add_argument("--sort", choices=sorted(LS_ORDER), default="key",
                   help="key, size (largest first), age (oldest first) or compile "
                        "(longest compile first)")
    p.add_argument("--program", default="", help="only programs whose name starts with this")
    p.add_argument("--json", action="store_true")
    _add_client_flags(p)
    p.set_defaults(fn=cmd_ls)


def _add_ahead_of_time(sub) -> None:
    """precompile, farm."""
    p = sub.add_parser("precompile", help="compile programs for a target ahead of time and "
                                          "publish them under the keys its processes compute")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--entry", help="package.module:function returning (jitted, abstract args) "
                                     "pairs for the target's devices")
    src.add_argument("--replay", metavar="JOB", help="recompile what was recorded for JOB")
    p.add_argument("--topology", default="local",
                   help="compile-only topology: a Cloud TPU accelerator type (v5litepod-16, "
                        "v4-32) or v5e:4x4, then options ,chips_per_host_bounds=AxBxC "
                        ",wrap=true.true.false ,num_slices=N (default: this machine's devices)")
    p.add_argument("--platform", default="tpu", choices=("tpu", "gpu", "cpu"))
    p.add_argument("--job", default="", help="job the programs belong to (recorded)")
    p.add_argument("--farm", action="store_true", help="queue the compiles for the farm")
    p.add_argument("--wait", action="store_true", help="with --farm: wait until all settle")
    p.add_argument("--timeout", type=float, default=3600.0, help="with --wait: seconds")
    p.add_argument("--check", action="store_true",
                   help="compile nothing: report whether each key is present, as the "
                        "target's processes will find it")
    p.add_argument("--no-fetch", action="store_true",
                   help="with --check: ask for presence only, do not fetch and verify")
    _add_client_flags(p)
    p.set_defaults(fn=cmd_precompile)

    p = sub.add_parser("farm", help="run a compile-farm worker (takes queued compiles)")
    p.add_argument("--concurrency", type=int, default=0,
                   help="concurrent compiles (default: cores, at most one per 4 GiB)")
    p.add_argument("--name", default="", help="this worker's name (default host:pid)")
    p.add_argument("--max-tasks", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--heartbeat-file", default="",
                   help="touched every loop (a liveness probe checks its age)")
    _add_client_flags(p)
    p.set_defaults(fn=cmd_farm)


def _add_admin(sub) -> None:
    """purge."""
    p = sub.add_parser("purge", help="take artifacts out of service: remove their keys and "
                                     "revoke their bytes (admin permission)")
    p.add_argument("keys", nargs="*", help="keys whose artifacts go")
    p.add_argument("--digest", action="append", default=[],
                   help="also every key whose artifact has this sha256 (repeatable)")
    p.add_argument("--reason", default="", help="why (kept with the revocation)")
    p.add_argument("--dry-run", action="store_true",
                   help="say which keys and digests would go; change nothing")
    _add_client_flags(p)
    p.set_defaults(fn=cmd_purge)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        for flag in ("worker", "coordinator"):  # (as the servers' flags are checked)
            if isinstance(getattr(args, flag, None), str) and getattr(args, flag):
                check_address(getattr(args, flag), f"--{flag}")
        return int(args.fn(args) or 0)
    except ConfigError as exc:
        print(f"compilecast: configuration error: {exc}", file=sys.stderr)
        return 2
    except CliError as exc:
        print(f"compilecast: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from compilecast.serving import ListenError
        from compilecast.up import UpError

        if isinstance(exc, UpError):
            print(f"compilecast up: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, ListenError):
            print(f"compilecast {args.command}: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, OSError) and exc.filename:  # e.g. a data directory it cannot make
            print(f"compilecast {args.command}: cannot use {exc.filename}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 1
        # Anything else is a bug of ours, not the user's input: one line, and
        # the traceback where asked for.
        logging.getLogger("compilecast").debug("compilecast %s failed", args.command,
                                               exc_info=True)
        print(f"compilecast {args.command}: failed: {type(exc).__name__}: {exc} "
              "(--log-level debug shows where)", file=sys.stderr)
        return 1


