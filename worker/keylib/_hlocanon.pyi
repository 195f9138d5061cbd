# The C fast path of worker/keylib/hlocanon.py (worker/keylib/_hlocanon.c): the same bytes
# as canonical_hlo_py, ValueError for a malformed module.
from typing import Any

def canonical_hlo(data: bytes | memoryview, drops: tuple[int, ...] = (),
                  attributes: tuple[bytes, ...] = (), kernel: Any = None, /) -> bytes: ...
def canonical_hlo_sha256(data: bytes | memoryview, drops: tuple[int, ...] = (),
                         attributes: tuple[bytes, ...] = (), kernel: Any = None, /) -> str: ...
