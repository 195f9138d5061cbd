"""`compilecast run -- COMMAND`: run a training command with its framework's
own cache directory kept in sync across the fleet by the host's worker.

Today this is PyTorch/XLA's persistent cache (worker/torchxla.py). The
command runs whatever happens: where the worker cannot be asked, or the
interpreter has no torch_xla, it runs as it was, and the reason is printed
once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from compilecast.config import default_home, default_worker_target

log = logging.getLogger("compilecast.run")


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a PyTorch/XLA command with its persistent cache shared "
                                   "across the fleet (compilecast run -- python train.py)")
    p.add_argument("--worker", default=os.environ.get("COMPILECAST_WORKER")
                   or default_worker_target(), help="the host's worker (env COMPILECAST_WORKER)")
    p.add_argument("--token", default=os.environ.get("COMPILECAST_TOKEN", ""),
                   help="bearer token (env COMPILECAST_TOKEN)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(fn=cmd_run)


def environment(command: list[str], worker: str, token: str) -> dict[str, str]:
    """The command's environment: with its cache directory the host's synced
    one, or as it was (and why, logged)."""
    from compilecast.worker import torchxla
    from compilecast.worker.client import CacheClient

    client = CacheClient(worker, token=token, timeout_s=10.0)
    try:
        return torchxla.prepare(command, os.environ, client, default_home())
    except torchxla.NotTorchXla as exc:
        log.info("%s: nothing to share", exc)
    except Exception as exc:
        log.warning("running without a shared cache: %s", str(exc).splitlines()[0][:300])
    finally:
        client.close()
    return dict(os.environ)


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("compilecast run: name the command after --, e.g. "
              "compilecast run -- python train.py", file=sys.stderr)
        return 2
    env = environment(command, args.worker, args.token)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"compilecast run: cannot run {command[0]}: {exc.strerror or exc}",
              file=sys.stderr)
        return 127
    return 0  # not reached
