"""Validation of request fields shared by the coordinator and the worker."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from compilecast.errors import InvalidRequest

if TYPE_CHECKING:
    from compilecast.v1 import cache_pb2 as pb

KEY_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}\Z")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}\Z")
JOB_RE = re.compile(r"^[A-Za-z0-9._:-]{0,128}\Z")
MAX_CLIENT_LEN = 256
MAX_DETAIL_LEN = 1024
MAX_PURGE_NAMES = 10_000  # keys and digests one Purge names
PURGE_PAGE = 1_000  # what a client names in one Purge, sending more in pages
MAX_SECONDS_PER_HIT = 86_400.0  # the compile time one hit can be said to have saved


def key(value: str) -> str:
    if not value:
        raise InvalidRequest("key is empty")
    if not KEY_RE.match(value):
        raise InvalidRequest(
            f"key {value[:80]!r} is invalid: use 1-200 characters of [A-Za-z0-9._-]"
        )
    if value in (".", ".."):
        raise InvalidRequest("key may not be '.' or '..'")
    return value


def digest(value: str) -> str:
    if not DIGEST_RE.match(value):
        raise InvalidRequest(
            f"digest {value[:80]!r} is invalid: expected 64 lowercase hex characters (sha256)"
        )
    return value


def requester(req: pb.Requester) -> None:
    job(req.job, "requester.job")
    if req.job and (req.process_id < 0 or req.designated_process < 0):
        raise InvalidRequest("requester.process_id and designated_process must be >= 0")
    if len(req.client) > MAX_CLIENT_LEN:
        raise InvalidRequest(f"requester.client is longer than {MAX_CLIENT_LEN} characters")


def lease(lease: pb.Lease) -> None:
    if lease.id <= 0:
        raise InvalidRequest("lease.id is missing: pass the lease returned with COMPILE")
    if lease.revision <= 0:
        raise InvalidRequest("lease.revision is missing: pass the lease returned with COMPILE")


MAX_COMPONENTS = 32
COMPONENT_NAME_RE = re.compile(r"^[a-z0-9_]{1,64}\Z")
PROGRAM_NAME_RE = re.compile(r"^[\x21-\x7e]{0,200}\Z")
# All of a request's component names at once, joined by newlines.
_COMPONENT_NAMES_RE = re.compile(r"[a-z0-9_]{1,64}(?:\n[a-z0-9_]{1,64})*")
MAX_COMPONENT_LEN = 128
# (joined component names, program name) pairs that passed: a client sends
# the same names and program names again and again (cleared when full).
_NAMED_OK: set[tuple[str, str]] = set()
_NAMED_OK_MAX = 4096


def components(comps: Mapping[str, str], program_name: str) -> None:
    """Every request may carry them (the JAX integration's do, hits
    included): the names checked with one match (once for each set of
    names and program name seen), the values by indexing (a protobuf map's
    items() is several times slower)."""
    names = list(comps)
    if len(names) > MAX_COMPONENTS:
        raise InvalidRequest(f"at most {MAX_COMPONENTS} key_components, got {len(names)}")
    joined = "\n".join(names)
    if (joined, program_name) not in _NAMED_OK:
        if names and (not _COMPONENT_NAMES_RE.fullmatch(joined)
                      or joined.count("\n") >= len(names)):
            name = next(n for n in names if not COMPONENT_NAME_RE.match(n))
            raise InvalidRequest(
                f"key component name {name[:80]!r} is invalid: use [a-z0-9_]{{1,64}}")
        if not PROGRAM_NAME_RE.match(program_name):
            raise InvalidRequest("program_name must be at most 200 printable ASCII characters")
        if len(_NAMED_OK) >= _NAMED_OK_MAX:
            _NAMED_OK.clear()
        _NAMED_OK.add((joined, program_name))
    if names and max([len(comps[n]) for n in names]) > MAX_COMPONENT_LEN:
        name = next(n for n in names if len(comps[n]) > MAX_COMPONENT_LEN)
        raise InvalidRequest(f"key component {name} is longer than {MAX_COMPONENT_LEN} characters")


def acquire_request(r: pb.AcquireRequest) -> None:
    key(r.key)
    requester(r.requester)
    components(r.key_components, r.program_name)
    job(r.manifest_job, "manifest_job")


def relay_address(address: str) -> str:
    """A peer worker's host:port, as a request names where it relays."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(address) > 256 \
            or any(c.isspace() or c == "/" for c in address):
        raise InvalidRequest(f"relay_address {address[:80]!r} is invalid: use host:port")
    return address


def job(value: str, what: str = "job") -> str:
    """A job's name (a manifest's, a recipe's): at most 128 of [A-Za-z0-9._:-],
    not dots alone (a name "." or ".." reads as a path)."""
    if not JOB_RE.match(value) or (value and not value.strip(".")):
        raise InvalidRequest(f"{what} {value[:80]!r} is invalid: use at most 128 of "
                             "[A-Za-z0-9._:-], not dots alone")
    return value


def publish_header(header: pb.PublishHeader, max_size: int) -> str:
    """Check a Publish header (coordinator and worker alike); returns the key.
    An empty digest comes last (PublishChunk.digest; coordinator.service's
    publish_stream checks it)."""
    from compilecast.errors import TooLarge

    k = key(header.key)
    lease(header.lease)
    if header.digest:
        digest(header.digest)
    requester(header.requester)
    if header.size <= 0:
        raise InvalidRequest("size must be > 0")
    if header.size > max_size:
        raise TooLarge(f"artifact of {header.size} bytes exceeds the limit of {max_size}")
    if not 0 <= header.compile_time_seconds < 1e7:
        raise InvalidRequest("compile_time_seconds must be in [0, 1e7)")
    return k


MAX_RECIPE_BYTES = 3 << 20
PLATFORMS = ("tpu", "gpu", "cpu")
TOPOLOGY_RE = re.compile(r"^[A-Za-z0-9:._x,=-]{0,128}\Z")
ENTRY_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]{0,199}:[A-Za-z_][A-Za-z0-9_]{0,99})?\Z")
TASK_ID_RE = re.compile(r"^[0-9]{20}-[0-9a-f]{8}\Z")


def target(t: pb.Target) -> None:
    if t.platform not in PLATFORMS:
        raise InvalidRequest(f"target.platform {t.platform[:20]!r} is invalid: use one of "
                             f"{', '.join(PLATFORMS)}")
    if not TOPOLOGY_RE.match(t.topology):
        raise InvalidRequest(f"target.topology {t.topology[:80]!r} is invalid "
                             "(a name such as v5e:2x2 or v5litepod-16,num_slices=2, at most 128 characters)")


def recipe(r: pb.Recipe, *, need_target: bool) -> None:
    """A recipe is either an entry point or a lowered program, bounded in size."""
    from compilecast.errors import TooLarge

    if r.key:
        key(r.key)
    job(r.job, "recipe.job")
    if not PROGRAM_NAME_RE.match(r.program_name):
        raise InvalidRequest("recipe.program_name must be at most 200 printable ASCII characters")
    if not ENTRY_RE.match(r.entry):
        raise InvalidRequest(f"recipe.entry {r.entry[:80]!r} is invalid: use package.module:function")
    if not r.entry and not r.program:
        raise InvalidRequest("a recipe needs an entry point or a program")
    if r.entry_index < 0:
        raise InvalidRequest("recipe.entry_index must be >= 0")
    if r.ByteSize() > MAX_RECIPE_BYTES:
        raise TooLarge(f"recipe of {r.ByteSize()} bytes exceeds the limit of {MAX_RECIPE_BYTES}")
    if need_target or r.HasField("target"):
        target(r.target)


def task_id(value: str) -> str:
    if not TASK_ID_RE.match(value):
        raise InvalidRequest(f"task_id {value[:80]!r} is invalid")
    return value
