"""Pallas/Mosaic TPU kernels inside a program: what of them a key holds.

A Pallas kernel for TPU lowers to `stablehlo.custom_call @tpu_custom_call`,
whose backend_config (a JSON string) carries the kernel as base64 MLIR
bytecode under `"body"`, and that bytecode holds the kernel's locations: the
file and line of every operation. Hashed as it is, the same kernel defined at
another line, in another file or under another checkout path would change
the program's key, and the whole program would compile again.

The canonical stream (worker/keylib/mlircanon.py) therefore writes such a config as
'K' str(before) str(kernel) str(after): the config's text before the body's
base64, the digest of the kernel's own canonical stream (the same walk, so
locations are never visited; names are kept), and the text after it. Every
other byte of the config stays in the key as it is. A config with no body, or
more than one, or a body that is not base64 of MLIR bytecode jaxlib can parse,
is kept whole (`None` below): a miss at worst, never a collision.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import re
import threading
from collections import OrderedDict

log = logging.getLogger("compilecast.mosaic")

KERNEL_STREAM = b"compilecast mosaic kernel 1\n"  # what the kernel digest is of, versioned
_BODY = re.compile(rb'"body"\s*:\s*"([A-Za-z0-9+/=]*)"')
_BYTECODE_MAGIC = b"ML\xefR"
_CACHE_MAX = 256  # kernels by their base64: one program calls the same kernel many times
_cache: OrderedDict[bytes, bytes | None] = OrderedDict()
_lock = threading.Lock()
_walk_lock = threading.Lock()


def kernel_part(config: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(before, kernel digest, after) of a tpu_custom_call's backend_config,
    or None to keep it whole. The kernel hook of mlircanon.stream."""
    found = list(_BODY.finditer(config))
    if len(found) != 1:
        return None
    m = found[0]
    digest = _kernel_digest(m.group(1))
    if digest is None:
        return None
    return config[:m.start(1)], digest, config[m.end(1):]


# The body as MLIR prints the config (a string attribute: quotes are \22).
_PRINTED_BODY = re.compile(r'\\22body\\22\s*:\s*\\22([A-Za-z0-9+/=]+)\\22')


def readable(text: str) -> str:
    """Printed MLIR (explain's canonical text) with each kernel body replaced
    by its kernel digest, so that two kernels that differ only in their
    locations print alike and a kernel is one short token, not a line of
    base64."""
    def short(m: re.Match[str]) -> str:
        digest = _kernel_digest(m.group(1).encode())
        if digest is None:
            return m.group(0)
        return f"\\22body\\22: \\22<kernel {digest.hex()[:16]}>\\22"
    return _PRINTED_BODY.sub(short, text)


def _kernel_digest(b64: bytes) -> bytes | None:
    key = hashlib.sha256(b64).digest()
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    digest = _digest_uncached(b64)
    with _lock:
        _cache[key] = digest
        while len(_cache) > _CACHE_MAX:
            _cache.popitem(last=False)
    return digest


def _digest_uncached(b64: bytes) -> bytes | None:
    from ..xla import jax_adapter
    from . import mlircanon

    try:
        body = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        return None
    if not body.startswith(_BYTECODE_MAGIC):  # what Mosaic writes; MLIR's text parser would
        return None                           # take b"\0..." for an empty module
    try:
        with _walk_lock:  # kernels share one parsing context (jax_adapter)
            kernel = jax_adapter.mosaic_kernel_module(body)
            h = hashlib.sha256(KERNEL_STREAM)
            with kernel.context:
                mlircanon.stream(kernel, h, frozenset(), {})
            del kernel
    except Exception as e:  # any failure keeps the config whole
        log.info("a Pallas kernel is keyed with its locations (it did not parse: %s)", e)
        return None
    return h.digest()
