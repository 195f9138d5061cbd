"""PyTorch/XLA on its built-in clients (CPU, CUDA): the persistent cache
directory shared across the fleet.

torch_xla caches compiled graphs in the directory `XLA_PERSISTENT_CACHE_PATH`
names, one file per graph, named by torch's lazy-IR graph hash, written at its
final name. It has no hook: the directory is its only seam. `compilecast run`
points it at the host's synced directory of kind "torch-xla"
(worker/daemon/dirsync.py) for the job's namespace, after installing what other
hosts published there; the worker publishes the files this host writes once
they have settled.

A build whose cache cannot load what it wrote (torch_xla 2.8 and 2.9 fail to
deserialize, delete the file and compile again) gets its directory with
installs off: its files are published, none is installed, and it says why
once. Whether a build loads is probed, once per interpreter and release, on
the CPU (worker/torchdoor/torchxla_probe.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..inprocess.client import CacheClient
from ..xla import xlaflags

log = logging.getLogger(__name__)

KIND = "torch-xla"
PROBE_SCRIPT = Path(__file__).with_name("torchxla_probe.py")
PROBE_TIMEOUT_S = 600.0
SYNC_TIMEOUT_S = 60.0
CACHE_ENV = "XLA_PERSISTENT_CACHE_PATH"
# What decides which executable a graph hash stands for, besides the releases.
NAMESPACE_ENV = ("PJRT_DEVICE", "XLA_USE_SPMD", "XLA_USE_BF16", "XLA_DOWNCAST_BF16",
                 "CPU_NUM_DEVICES", "GPU_NUM_DEVICES", "TPU_ACCELERATOR_TYPE",
                 "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_VISIBLE_CHIPS")


class NotTorchXla(Exception):
    """The command's interpreter has no torch_xla."""


def interpreter(command: Sequence[str]) -> str:
    """The Python that will run `command`: its first word when that is a
    Python (`python -m torch.distributed.run ...` included); else, for a
    script launcher such as torchrun, the interpreter its `#!` line names
    (`#!/usr/bin/env python3` looked up on PATH); else the first python3 on
    PATH."""
    first = command[0] if command else ""
    if _is_python(first):
        return shutil.which(first) or first
    path = shutil.which(first) if first else None
    named = _shebang(path) if path else None
    if named:
        words = named.split()
        if os.path.basename(words[0]) == "env":  # #!/usr/bin/env [-S] python3 ...
            words = [w for w in words[1:] if not w.startswith("-")]
            if words and _is_python(words[0]):
                return shutil.which(words[0]) or words[0]
        elif _is_python(words[0]):
            return words[0]
    fallback = shutil.which("python3") or sys.executable
    log.warning("cannot tell which Python runs %s (not a Python, no #! line naming one): "
                "asking %s", first or "the command", fallback)
    return fallback


def _is_python(word: str) -> bool:
    return os.path.basename(word).startswith("python")


def _shebang(path: str) -> str | None:
    """The interpreter line of a script (without `#!`), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    return head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").strip() or None


def probe(python: str, what: str, timeout_s: float) -> dict:
    """What worker/torchdoor/torchxla_probe.py says of `python` (one JSON object)."""
    done = subprocess.run([python, str(PROBE_SCRIPT), what], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PJRT_DEVICE": "CPU"})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise RuntimeError(f"{python} {PROBE_SCRIPT.name} {what}: {last[:300]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def releases(python: str) -> dict[str, str]:
    got = probe(python, "versions", 60.0)
    if not got.get("torch_xla"):
        raise NotTorchXla(f"{python} has no torch_xla")
    return {k: str(v) for k, v in got.items()}


def cache_loads(python: str, versions: Mapping[str, str], home: Path) -> tuple[bool, str]:
    """Whether this build loads its persistent cache, and why not: probed
    once per interpreter and releases, remembered under `home`."""
    book = home / "torch-xla-probes.json"
    ident = f"{os.path.realpath(python)} torch {versions['torch']} " \
            f"torch_xla {versions['torch_xla']}"
    try:
        known = json.loads(book.read_text())
    except (OSError, ValueError):
        known = {}
    if ident not in known:
        log.info("probing whether torch_xla %s loads its persistent cache (once)",
                 versions["torch_xla"])
        known[ident] = probe(python, "loads", PROBE_TIMEOUT_S)
        home.mkdir(parents=True, exist_ok=True)
        tmp = book.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, book)
    return bool(known[ident]["loads"]), str(known[ident].get("why", ""))


def _gpu_models() -> str:
    models = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            first = info.read_text().splitlines()[0]
        except (OSError, IndexError):
            continue
        models.append(first.partition(":")[2].strip())
    return ",".join(models)


def namespace(versions: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The releases, the device settings and the XLA flags a cache file is
    valid for."""
    ns = {f"release.{k}": v for k, v in versions.items() if v}
    ns.update({f"env.{k}": environ[k] for k in NAMESPACE_ENV if environ.get(k)})
    for var in xlaflags.ENV_VARS:
        flags, _ = xlaflags.split_flags(environ.get(var, ""))
        if flags:
            ns[f"flags.{var}"] = " ".join(sorted(xlaflags.effective(flags)))[:500]
    if environ.get("PJRT_DEVICE", "").upper() in ("CUDA", "GPU"):
        ns["gpus"] = _gpu_models()[:500]
    return ns


def prepare(command: Sequence[str], environ: Mapping[str, str], client: CacheClient,
            home: Path) -> dict[str, str]:
    """The environment to run `command` in: its cache directory the host's
    synced one, brought up to date. Raises NotTorchXla, or whatever failed
    (the caller runs the command as it was)."""
    env = dict(environ)
    if env.get(CACHE_ENV):
        raise RuntimeError(f"{CACHE_ENV} is set ({env[CACHE_ENV]}): the job keeps its own "
                           "cache directory")
    python = interpreter(command)
    versions = releases(python)
    loads, why = cache_loads(python, versions, home)
    install_off = "" if loads else f"torch_xla {versions['torch_xla']}: {why}"
    if install_off:
        log.warning("%s; its cache files are published, none is installed here", install_off)
    d = client.open_directory(KIND, namespace(versions, env), install_off=install_off)
    try:
        d = client.sync_directory(KIND, d.namespace_id, timeout_s=SYNC_TIMEOUT_S).directory
    except Exception as exc:  # the entries come with the worker's next pass
        log.warning("the cache directory was not brought up to date before the start: %s", exc)
    log.info("PyTorch/XLA cache in %s (%d entries, namespace %s)", d.path, d.entries,
             d.namespace_id)
    env[CACHE_ENV] = d.path
    return env
