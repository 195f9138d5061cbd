"""Whether a synced directory's file is whole, by its format.

A framework that writes its cache files in place (torch_xla) leaves a file
cut short when it dies mid-write; settling time alone cannot tell. A file is
published only when its kind's format parses to its end:

- `torch-xla`: a serialized PJRT executable as torch_xla writes it, an
  ExecutableAndOptionsProto (field 1: the executable, field 2: its compile
  options), every field of it and of the executable's top level ending
  where the file says it does;
- `xla-autotune`: an AutotuneResult as XLA prints it (a text proto): UTF-8
  lines of `name: value`, `name {` and `}`, the braces balanced, ending with
  a newline.

Other kinds have no check of their own.
"""

from __future__ import annotations

import re

from ..keylib import hlocanon

TEXT_LINE = re.compile(r'\s*(?:[A-Za-z_\[][\w.\[\]/]*\s*(?::\s*\S.*|:?\s*\{)|\})\s*\Z')


def _message(data: bytes | memoryview, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(field, wire type, value start, value end) of a protobuf message,
    ValueError when a field runs past `end`."""
    return [(f, w, vs, ve) for f, w, _, vs, ve, _ in hlocanon.fields(data, start, end)]


def torch_xla_entry(data: bytes) -> str:
    """Why `data` is not a whole torch_xla cache entry ("" when it is)."""
    try:
        fields = _message(data, 0, len(data))
    except ValueError as exc:
        return f"not a whole protobuf message ({exc})"
    found = {f: (w, vs, ve) for f, w, vs, ve in fields}
    for number, what in ((1, "executable"), (2, "compile options")):
        if number not in found or found[number][0] != hlocanon.LEN:
            return f"no {what} (field {number})"
    _, vs, ve = found[1]
    try:
        if not _message(data, vs, ve):
            return "an empty executable"
    except ValueError as exc:
        return f"the executable is not whole ({exc})"
    return ""


def xla_autotune_entry(data: bytes) -> str:
    """Why `data` is not a whole autotune result text proto ("" when it is)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    if not text.endswith("\n"):
        return "does not end with a newline"
    depth = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not TEXT_LINE.match(line):
            return f"line {number} is not a text proto field"
        depth += line.rstrip().endswith("{") - (line.strip() == "}")
        if depth < 0:
            return f"line {number} closes a brace never opened"
    return "" if depth == 0 else f"{depth} braces left open"


CHECKS = {"torch-xla": torch_xla_entry, "xla-autotune": xla_autotune_entry}


def why_not_whole(kind: str, data: bytes) -> str:
    """Why a file of `kind` is not whole, "" when it is (or the kind has no
    check)."""
    check = CHECKS.get(kind)
    return check(data) if check else ""
