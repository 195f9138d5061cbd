"""Commands for frameworks compilecast does not hook in Python.

`compilecast run -- COMMAND`: run a training command with its framework's
own cache directory kept in sync across the fleet by the host's worker.
`compilecast pjrt-plugin`: the path of the PJRT interposer.

Today this is PyTorch/XLA's persistent cache (worker/torchdoor/torchxla.py). The
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


def interposer_path() -> str:
    """Where the PJRT interposer (worker/pjrtdoor/_pjrt_interposer.c) was built."""
    import glob

    from compilecast.worker import pjrtdoor

    found = sorted(glob.glob(os.path.join(os.path.dirname(pjrtdoor.__file__),
                                          "_pjrt_interposer*.so")))
    if not found:
        raise FileNotFoundError("the PJRT interposer was not built with this install "
                                "(a C compiler was missing?): reinstall with gcc present")
    return found[0]


def cmd_pjrt_plugin(args: argparse.Namespace) -> int:
    try:
        print(interposer_path())
    except FileNotFoundError as exc:
        print(f"compilecast pjrt-plugin: {exc}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("pjrt-plugin", help="print the path of the PJRT interposer, a PJRT "
                                           "plugin that wraps another (docs/pjrt.md)")
    p.set_defaults(fn=cmd_pjrt_plugin)

    p = sub.add_parser("run", help="run a PyTorch/XLA command with its persistent cache shared "
                                   "across the fleet (compilecast run -- python train.py)")
    p.add_argument("--worker", default=os.environ.get("COMPILECAST_WORKER")
                   or default_worker_target(), help="the host's worker (env COMPILECAST_WORKER)")
    p.add_argument("--token", default=os.environ.get("COMPILECAST_TOKEN", ""),
                   help="bearer token (env COMPILECAST_TOKEN)")
    p.add_argument("--interpose-tpu", action="store_true",
                   help="load the PJRT interposer as the TPU plugin (TPU_LIBRARY_PATH, which "
                        "torch_xla and JAX read), wrapping the real libtpu: every compile of "
                        "the job goes through the host's worker (docs/pjrt.md)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(fn=cmd_run)


def environment(command: list[str], worker: str, token: str) -> dict[str, str]:
    """The command's environment: with its cache directory the host's synced
    one, or as it was (and why, logged)."""
    from compilecast.worker.inprocess.client import CacheClient
    from compilecast.worker.torchdoor import torchxla

    client = CacheClient(worker, token=token, timeout_s=10.0)
    try:
        return torchxla.prepare(command, os.environ, client, default_home())
    except torchxla.NotTorchXla as exc:
        log.warning("running without a shared cache: %s", exc)
    except Exception as exc:
        log.warning("running without a shared cache: %s", str(exc).splitlines()[0][:300])
    finally:
        client.close()
    return dict(os.environ)


def libtpu_of(command: list[str], env: dict[str, str]) -> str:
    """The libtpu the command would load: TPU_LIBRARY_PATH, else the libtpu
    package of the command's interpreter."""
    if env.get("TPU_LIBRARY_PATH"):
        return env["TPU_LIBRARY_PATH"]
    from compilecast.worker.torchdoor import torchxla

    try:
        return torchxla.probe(torchxla.interpreter(command), "libtpu", 60.0)["path"]
    except (RuntimeError, KeyError, ValueError) as exc:
        raise FileNotFoundError(f"no libtpu ({exc}): set TPU_LIBRARY_PATH to the real "
                                "plugin") from None


def interpose_tpu(command: list[str], env: dict[str, str]) -> dict[str, str]:
    """`env` with the interposer as the TPU plugin, wrapping the real one;
    as it was (and why, logged) where either is missing."""
    try:
        real, ours = libtpu_of(command, env), interposer_path()
    except (FileNotFoundError, OSError) as exc:
        log.warning("running without the PJRT interposer: %s", exc)
        return env
    if real == ours:  # already interposed (a launcher inside a launcher)
        return env
    return {**env, "COMPILECAST_PJRT_PLUGIN": real, "TPU_LIBRARY_PATH": ours}


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("compilecast run: name the command after --, e.g. "
              "compilecast run -- python train.py", file=sys.stderr)
        return 2
    env = environment(command, args.worker, args.token)
    if args.interpose_tpu:
        env = interpose_tpu(command, {**env, "COMPILECAST_WORKER": args.worker})
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"compilecast run: cannot run {command[0]}: {exc.strerror or exc}",
              file=sys.stderr)
        return 127
    return 0  # not reached
