"""The XLA flags in effect, as XLA itself reads them: the `xla_flags` key component.

XLA reads `XLA_FLAGS` (and libtpu `LIBTPU_INIT_ARGS`) once per process
(xla/parse_flags_from_env.cc):
- a value whose first non-blank character is not `-` names a file, and the
  flags are read from that file;
- flags are separated by blanks; `--name="a b"` and `--name='a b'` are one
  flag whose value has the quotes removed (a backslash escapes in double quotes);
- parsing stops at the first word that does not start with `-`;
- the flags are applied in order, so when a name repeats, the last one wins.

A key that hashed the raw words sorted (JAX's cache_key does) gives
`--f=1 --f=2` and `--f=2 --f=1` one key although XLA runs them with different
values, splits quoted values into words that can be reshuffled between flags,
and keys a flag file by its path whatever it holds. Here each variable becomes
its effective flags: one `--name=value` per name, the last one given, sorted by
name, minus the dump and debug flags that cannot change the executable. Words
past the point where XLA stops are kept verbatim (they change nothing, but a
parser that disagreed with XLA's must cost a miss, never a collision).

Like XLA, a variable's value is parsed once per process: the flags of a file
are the ones it held when this process first read it.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
from collections.abc import Iterable

ENV_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# Platforms whose jobs of several processes autotune in shards unless told not to.
GPU_PLATFORMS = frozenset({"cuda", "rocm", "gpu"})
MAX_FLAG_FILE_BYTES = 1 << 20
_BLANK = " \t\r\n"
_NAME_CHARS = frozenset("-_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def split_flags(text: str) -> tuple[list[str], str]:
    """XLA's reading of a flag string: (flags with quotes removed, the rest XLA ignores)."""
    flags: list[str] = []
    n = len(text)
    b = _skip(text, 0, blank=True)
    while b < n and text[b] == "-":
        e = b
        while e < n and text[e] in _NAME_CHARS:
            e += 1
        if e + 1 < n and text[e] == "=" and text[e + 1] in "'\"":
            quote = text[e + 1]
            value = []
            i = e + 2
            while i < n and text[i] != quote:
                if quote == '"' and text[i] == "\\" and i + 1 < n:
                    i += 1
                value.append(text[i])
                i += 1
            flags.append(text[b:e + 1] + "".join(value))
            e = min(i + 1, n)  # past the closing quote, if there is one
        else:
            e = _skip(text, e, blank=False)
            flags.append(text[b:e])
        b = _skip(text, e, blank=True)
    return flags, text[b:].strip(_BLANK)


def _skip(text: str, i: int, *, blank: bool) -> int:
    """The first index from i that is (blank=False) or is not (blank=True) a blank."""
    while i < len(text) and (text[i] in _BLANK) == blank:
        i += 1
    return i


def effective(flags: Iterable[str], excluded: Iterable[str] = ()) -> list[str]:
    """One flag per name, the last given, sorted by name, without the excluded names."""
    last: dict[str, str] = {}
    for flag in flags:
        last[flag.split("=", 1)[0]] = flag
    drop = set(excluded)
    return [last[name] for name in sorted(last) if name not in drop]


@functools.lru_cache(maxsize=16)
def _read_env_value(value: str) -> tuple[tuple[str, ...], str, str]:
    """(flags, ignored rest, source) of one variable's value; a file is read once."""
    if not value.strip(_BLANK):
        return (), "", ""
    if value.lstrip(_BLANK).startswith("-"):
        flags, rest = split_flags(value)
        return tuple(flags), rest, ""
    try:
        # Only a regular file: reading a FIFO here could hang the user's process.
        with open(value, "rb", opener=_open_regular) as f:
            data = f.read(MAX_FLAG_FILE_BYTES + 1)
    except OSError as exc:
        # XLA exits the process on this; the key still tells it apart.
        return (), "", f"unreadable flag file {value}: {exc.strerror or exc}"
    if len(data) > MAX_FLAG_FILE_BYTES:
        return (), "", f"unreadable flag file {value}: over {MAX_FLAG_FILE_BYTES} bytes"
    text = data.decode("utf-8", errors="surrogateescape")
    flags, rest = split_flags(text)
    return tuple(flags), rest, f"file {value}"


def _open_regular(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"not a regular file: {path}")
    return fd


def describe(excluded: Iterable[str] = (), environ: dict[str, str] | None = None,
             argv: list[str] | None = None, prefixes: Iterable[str] = ()) -> list[str]:
    """The lines that make up the `xla_flags` component, one per flag, each
    prefixed with where XLA reads it. Command-line words that start with
    `--xla` or one of `prefixes` count too, as in JAX's key (a miss at worst)."""
    env = os.environ if environ is None else environ
    excluded = tuple(excluded)
    lines: list[str] = []
    for var in ENV_VARS:
        flags, rest, source = _read_env_value(env.get(var, ""))
        lines.extend(f"{var}: {flag}" for flag in effective(flags, excluded))
        if rest:
            lines.append(f"{var} ignored by XLA: {rest}")
        if source.startswith("unreadable"):
            lines.append(f"{var}: {source}")
    starts = ("--xla", *prefixes)
    args = [a for a in (sys.argv if argv is None else argv)[1:] if a.startswith(starts)]
    lines.extend(f"argv: {flag}" for flag in effective(args, excluded))
    return lines
