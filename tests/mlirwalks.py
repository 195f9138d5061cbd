"""Shared by the MLIR walks' tests: the C stream's and the Python
reference's digests of one module."""

from __future__ import annotations

import hashlib

import pytest

from compilecast.worker.keylib import keys, mlircanon

native = pytest.mark.skipif(mlircanon._native is None, reason="_mlircanon extension not built")

DEFAULT_IGNORE = frozenset(keys.DEFAULT_IGNORED_ATTRIBUTES)


FIND = object()  # the walk finds the renames itself


def digest_native(module, ignore=DEFAULT_IGNORE, renames=FIND) -> str:
    """The C stream's digest; renames default: the Python private_renames."""
    assert mlircanon.bind_here() is not None
    h = hashlib.sha256()
    renames = mlircanon.private_renames(module) if renames is FIND else renames
    mlircanon._native.canonical_stream(module._CAPIPtr, h, ignore, renames)
    return h.hexdigest()


def digest_py(module, ignore=DEFAULT_IGNORE, renames=FIND) -> str:
    h = hashlib.sha256()
    renames = mlircanon.private_renames(module) if renames is FIND else renames
    with module.context:
        mlircanon.stream_py(module, h, ignore, renames)
    return h.hexdigest()
