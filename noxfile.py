"""The version matrix (docs: README, "Supported versions").

- `make test` is the default row: the whole suite on Python 3.11 with JAX 0.10.2,
  in the project's virtualenv.
- `nox -s jax_latest`: the JAX-facing suites (end to end, job shapes, keys, the
  JAX adapter, the PJRT interposer and its gate) on Python 3.12 and 3.13 with the
  newest JAX and jaxlib on the package index, each in a virtualenv of its own
  under .nox/. An interpreter this machine lacks is skipped, and said so.

Interpreters are found on PATH or among pyenv's versions.
"""

from __future__ import annotations

import glob
import os

import nox

nox.options.sessions = ["jax_latest"]
nox.options.error_on_missing_interpreters = False

JAX_FACING = ["tests/test_e2e_jax.py", "tests/test_job_shapes.py", "tests/test_keys.py",
              "tests/test_jax_adapter.py", "tests/test_pjrt_interposer.py",
              "tests/test_pjrt_gate.py", "tests/test_key_edges.py", "tests/test_preload.py"]


def _pyenv_on_path(*versions: str) -> None:
    """Put pyenv's interpreters of `versions` first on PATH (its shims answer
    only for the global version)."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    dirs = [sorted(glob.glob(os.path.join(root, "versions", f"{v}.*", "bin")))[-1:]
            for v in versions]
    os.environ["PATH"] = os.pathsep.join([d for found in dirs for d in found]
                                         + [os.environ.get("PATH", "")])


PYTHONS = ["3.12", "3.13"]
_pyenv_on_path(*PYTHONS)


@nox.session(python=PYTHONS)
def jax_latest(session: nox.Session) -> None:
    """The JAX-facing suites with the newest JAX and jaxlib."""
    session.install("-e", ".[test]")
    # XLA's CPU PJRT plugin on PyPI says jax<=0.11.2 but runs the interposer's
    # programs on the newest JAX too (the interposer's tests here show whether
    # it still does): the newest JAX goes in after it.
    session.install("--upgrade", "jax", "jaxlib")
    session.run("python", "-c", "import sys, jax, jaxlib; print('python', "
                "sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                *(session.posargs or JAX_FACING))
