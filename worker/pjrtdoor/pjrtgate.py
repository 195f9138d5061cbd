"""The worker's side of the PJRT interposer (worker/pjrtdoor/_pjrt_interposer.c).

A framework that compiles through a PJRT plugin wrapped by the interposer
sends each compile here, over the unix socket next to the worker's
(`<socket>.pjrt`): the program as the framework gave it, its serialized
CompileOptionsProto, the client's devices, the plugin's build, the
environment the plugin reads and the caller's token. The gate is an adapter
over the worker's own API: it keys the compile (worker/pjrtdoor/pjrtkeys.py), then
asks the worker over its socket as any process of the host does, with the
caller's token (the same namespace, tenant and permissions), so the host
cache, the single-flight waits and fetches, the leases and the digests are
the core's. Nothing here holds a thread while it waits.

    WAITING + <s>   a heartbeat, every GATE_HEARTBEAT_S while the answer is pending,
                    its payload the seconds (text) within which the answer
                    comes (a decision: the
                    wait's share-binary timeout and a fetch's allowance; a
                    publish: its upload's), and the interposer waits no
                    longer, however many heartbeats follow
    HIT <key> <sha256>  + the verified serialized executable
    COMPILE <key>   the interposer holds the lease, + the compile options to
                    use where they differ (a GPU job's compile that waits for
                    no other process: no sharded autotuning); it compiles,
                    then sends "publish <seconds>" + the serialized
                    executable, or "failed <why>"; a closed connection
                    releases the lease. A publish is taken on this
                    connection only, for this key, under its lease.
    LOCAL <why>     compile without sharing

Frames: b"CCP2", a little-endian u32 header size, the header, a u8 count,
then that many blobs, each a little-endian u64 size and its bytes.

Bounds: a connection limit (in all, and per process), deadlines for the
header and for each blob, a worker-wide memory budget for programs and
executables in flight (past it: LOCAL), and one rate-limited log line per
kind of problem. Callers: those the worker's socket admits (the socket's
permissions; peer credentials of the same user, root, or the socket's
group).

Who compiles follows JAX's per-program rule: a program whose devices (the
compile options' device assignment) span several processes is asked for as
the job's, compiled by the owner of its lowest device id while its other
processes wait; any other program first come, first served.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import pwd
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from compilecast.deadline import Deadline
from compilecast.errors import CompilecastError
from compilecast.grpcutil import bearer
from compilecast.streams import due
from compilecast.v1 import cache_pb2 as pb

from ..inprocess import policy
from ..inprocess.aclient import AsyncCacheClient
from ..inprocess.identity import Identity
from ..keylib import hlocanon
from ..keylib.keys import Key
from ..xla import jax_adapter
from ..xla.xlaflags import GPU_PLATFORMS
from . import pjrtkeys

log = logging.getLogger(__name__)

MAGIC = b"CCP2"
MAX_HEADER = 4096
MAX_BLOBS = 6
MAX_TEXT = 16 << 20  # devices, plugin, environment, token
MAX_BLOB = 1 << 40  # a program or an executable (the memory budget bounds them first)
BLOB_PIECE = 1 << 20  # a blob is charged to the budget and timed a piece at a time
GATE_HEARTBEAT_S = 2.0
FETCH_AFTER_WAIT_S = 120.0  # a decision's fetch of the executable, after its wait
PUBLISH_ALLOWANCE_S = 60.0  # a publish's upload: this, plus its size at GateLimits.min_rate
KEYS_KEPT = 1024  # keys remembered by fingerprint


@dataclass(frozen=True)
class GateLimits:
    """What one caller, or all of them together, can make the gate hold."""

    connections: int = 256  # connections served at once; past it: LOCAL at once
    per_process: int = 16  # of those, from one process
    header_s: float = 10.0  # a request's header arrives within this
    blob_s: float = 10.0  # each blob within this, plus its size at min_rate
    min_rate: float = 4 << 20  # bytes per second a sender keeps up at least
    memory_bytes: int = 2 << 30  # programs and executables in flight, all connections
    compile_s: float = 4 * 3600.0  # the lease holder's publish arrives within this
    rpc_s: float = 10.0  # each call to the worker but the waits (which the worker bounds)


class BadFrame(Exception):
    pass


class OverBudget(Exception):
    pass


class Budget:
    """Bytes in flight across all of the gate's connections, and each
    process's share: at most `share` of the limit (a process 0: the gate's
    own, e.g. a fetch shared by several callers)."""

    def __init__(self, limit: int, share: float = 0.5) -> None:
        self.limit = limit
        self.per_process = int(limit * share)
        self.used = 0
        self.by_process: Counter[int] = Counter()

    def take(self, n: int, pid: int = 0) -> None:
        if self.used + n > self.limit:
            raise OverBudget(f"{n} bytes would take the gate past its memory budget "
                             f"({self.used} of {self.limit} in flight)")
        if pid and self.by_process[pid] + n > self.per_process:
            raise OverBudget(f"{n} bytes would take process {pid} past its share of the "
                             f"gate's memory ({self.by_process[pid]} of {self.per_process})")
        self.used += n
        if pid:
            self.by_process[pid] += n

    def give(self, n: int, pid: int = 0) -> None:
        self.used -= n
        if pid:
            self.by_process[pid] -= n
            if self.by_process[pid] <= 0:
                del self.by_process[pid]


class Complaints:
    """One log line per kind of problem per `every_s`, with how many were
    not logged."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self.last: dict[str, float] = {}
        self.quiet: Counter[str] = Counter()

    def __call__(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -self.every_s) < self.every_s:
            self.quiet[kind] += 1
            return
        self.last[kind] = now
        skipped, self.quiet[kind] = self.quiet[kind], 0
        log.warning(message + (f" ({skipped} more since the last such line)" if skipped else ""),
                    *args)


# -- frames ----------------------------------------------------------------------

def frame(header: str, payload: bytes | None = None) -> bytes:
    h = header.encode()[:1000]
    out = MAGIC + len(h).to_bytes(4, "little") + h
    if payload is None:
        return out + b"\0"
    return out + b"\x01" + len(payload).to_bytes(8, "little") + payload


class Reader:
    """Reads one connection's frames within the gate's deadlines, taking
    what it holds from the budget (given back by `close`)."""

    def __init__(self, reader: asyncio.StreamReader, limits: GateLimits, budget: Budget,
                 pid: int = 0) -> None:
        self.reader = reader
        self.limits = limits
        self.budget = budget
        self.pid = pid  # whose share the bytes held count against
        self.held = 0

    async def _exactly(self, n: int, within: float) -> bytes:
        try:
            return await asyncio.wait_for(self.reader.readexactly(n), within)
        except TimeoutError:
            raise BadFrame(f"{n} bytes did not arrive within {within:.0f}s") from None

    async def head(self, within: float) -> tuple[dict | str, int]:
        """(the header: a JSON object, or a word line; the blob count)."""
        head = await self._exactly(8, within)
        if head[:4] != MAGIC:
            raise BadFrame("not a compilecast PJRT frame")
        n = int.from_bytes(head[4:], "little")
        if n > MAX_HEADER:
            raise BadFrame(f"a header of {n} bytes")
        rest = await self._exactly(n + 1, self.limits.header_s)
        text, count = rest[:n].decode("utf-8", "replace"), rest[n]
        if count > MAX_BLOBS:
            raise BadFrame(f"{count} blobs")
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                raise BadFrame("a header that is not JSON") from None
            if not isinstance(value, dict) or any(
                    isinstance(v, dict | list) for v in value.values()):
                raise BadFrame("a header that is not a flat JSON object")
            return value, count
        return text, count

    async def blob(self, limit: int) -> bytes:
        """A blob of at most `limit` bytes. Its bytes are charged to the
        budget as they arrive, a piece at a time, and each piece is due at
        the sender's least rate: a caller that announces much and sends
        little holds little, and not for long."""
        n = int.from_bytes(await self._exactly(8, self.limits.blob_s), "little")
        if n > limit:
            raise BadFrame(f"a blob of {n} bytes")
        if n > self.budget.per_process:  # more than it could ever hold: at once
            raise OverBudget(f"a blob of {n} bytes is past a process's share of the gate's "
                             f"memory budget ({self.budget.per_process})")
        start, parts, got = time.monotonic(), [], 0
        while got < n:
            piece = min(BLOB_PIECE, n - got)
            self.budget.take(piece, self.pid)
            self.held += piece
            by = due(start, got + piece, self.limits.blob_s, self.limits.min_rate)
            parts.append(await self._exactly(piece, max(0.0, by - time.monotonic())))
            got += piece
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self.budget.give(self.held, self.pid)
        self.held = 0


# -- who compiles ---------------------------------------------------------------------

def _message(buf: bytes, number: int) -> bytes:
    """The first occurrence of message field `number` of `buf` (b"" if none)."""
    for f, wire_type, _, vs, ve, _ in hlocanon.fields(buf, 0, len(buf)):
        if f == number and wire_type == hlocanon.LEN:
            return buf[vs:ve]
    return b""


def program_devices(compile_options: bytes) -> list[int]:
    """The device ids of the compile options' device assignment
    (CompileOptionsProto.executable_build_options.device_assignment:
    computation_devices.replica_device_ids), [] when it has none."""
    assignment = _message(_message(compile_options, 3), 9)
    ids: list[int] = []
    for f, wire_type, _, vs, ve, _ in hlocanon.fields(assignment, 0, len(assignment)):
        if f != 3 or wire_type != hlocanon.LEN:
            continue
        for g, gwire, _, gs, ge, value in hlocanon.fields(assignment, vs, ve):
            if g == 1:
                ids.extend(hlocanon.repeated_ints(assignment, gwire, gs, ge, value))
    return ids


def identity(owners: dict[int, int], process_index: int, pid: int,
             compile_options: bytes) -> Identity:
    """Who asks: the job's designated process for a program on several
    processes, else first come, first served."""
    client = f"{socket.gethostname()}:{pid}"
    try:
        devices = [d for d in program_devices(compile_options) if d in owners]
    except ValueError:
        devices = []
    if len({owners[d] for d in devices}) < 2:
        return Identity(client=client)
    job = "pjrt-" + hashlib.sha256(",".join(
        f"{d}:{p}" for d, p in sorted(owners.items())).encode()).hexdigest()[:16]
    return Identity(job=job, process_id=process_index,
                    designated_process=owners[min(devices)], client=client)


# -- callers ---------------------------------------------------------------------------

def peer(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


def admitted(uid: int, gid: int, socket_gid: int) -> bool:
    """Whether a peer may use the gate: as the socket's permissions (0660)
    admit, root, the worker's own user, or a member of the socket's group."""
    if uid in (0, os.geteuid()) or gid == socket_gid:
        return True
    try:
        return socket_gid in os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
    except (KeyError, OSError):
        return False


# -- the client policy's shell -----------------------------------------------------------

class GateShell:
    """The gate as the asynchronous shell of the client policy
    (worker/inprocess/policy.py) for one interposed compile: its caller's
    credential (`md`) on every call, and the gate's shared, budgeted
    fetches."""

    def __init__(self, gate: PjrtGate, md: tuple) -> None:
        self.gate = gate
        self.client = gate.client
        self.md = md

    async def ask(self, step: policy.Ask) -> pb.AcquireResponse:
        return await self.client.acquire(step.request, self.md)

    async def await_(self, step: policy.Await) -> tuple[pb.WaitEvent, None]:
        return await self.client.wait(step.key, step.identity, step.deadline, self.md), None

    async def fetch(self, step: policy.Fetch) -> bytes:
        return await self.gate.fetch(step.key, step.digest, self.md)

    async def publish(self, step: policy.Publish) -> pb.ArtifactInfo:
        return await self.client.publish(step.key, step.lease, step.identity, step.data,
                                         step.seconds, self.md)

    async def release(self, step: policy.Release) -> None:
        await self.client.release(step.key, step.lease, step.reason, step.detail, self.md)

    async def describe(self, step: policy.Describe) -> pb.DescribeKeyResponse:
        return await self.client.describe(step.key, self.md)


# -- the gate --------------------------------------------------------------------------

@dataclass
class Answer:
    decision: str  # HIT, COMPILE, LOCAL
    reason: str = ""
    payload: bytes | None = None
    key: str = ""
    digest: str = ""
    lease: pb.Lease | None = None
    identity: Identity | None = None

    def frame(self) -> bytes:
        if self.decision == "HIT":
            return frame(f"HIT {self.key} {self.digest}", self.payload)
        if self.decision == "COMPILE":
            return frame(f"COMPILE {self.key}", self.payload)
        return frame(f"LOCAL {self.reason}"[:1000])


class PjrtGate:
    """The listener of the host's interposed compiles."""

    def __init__(self, path: str, worker_target: str, *, wait_timeout_s: float,
                 limits: GateLimits | None = None,
                 count: Callable[[str, str], None] = lambda platform, outcome: None,
                 tokens_required: bool = False) -> None:
        self.path = path
        # The worker has a credential of its own: a caller without one may
        # read (hits) but never hold a lease or publish under the worker's.
        self.tokens_required = tokens_required
        self.limits = limits or GateLimits()
        self.worker_target = worker_target
        self.upstream: AsyncCacheClient | None = None  # (a channel of the loop the gate runs on)
        self.wait_timeout_s = wait_timeout_s
        self.count = count
        self.budget = Budget(self.limits.memory_bytes)
        self.complain = Complaints()
        self.server: asyncio.AbstractServer | None = None
        self.open = 0
        self.by_process: Counter[int] = Counter()
        self.socket_gid = os.getegid()
        # Keying parses programs: CPU work, on two threads of the gate's own.
        self.keying = ThreadPoolExecutor(2, thread_name_prefix="compilecast-pjrt-key")
        self.hashing = ThreadPoolExecutor(1, thread_name_prefix="compilecast-pjrt-hash")
        self.keys: dict[str, asyncio.Future[Key]] = {}  # fingerprint -> its key, made once
        self.fetching: dict[str, asyncio.Future[bytes]] = {}  # digest -> its fetch in flight
        # digest -> [its verified bytes, the answers carrying them not written yet]
        self.payloads: dict[str, list] = {}

    async def start(self) -> None:
        # Connections past the limit are answered and closed at once, but each
        # takes a descriptor meanwhile: as many as the system lets us have.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE,
                                   (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        self.upstream = AsyncCacheClient(self.worker_target, self.limits.rpc_s)
        self.keying.submit(pjrtkeys.warm_up)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.server = await asyncio.start_unix_server(self._serve, path=self.path,
                                                      limit=1 << 16, backlog=1024)
        os.chmod(self.path, 0o660)
        self.socket_gid = os.stat(self.path).st_gid

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self.upstream is not None:
            await self.upstream.close()
        self.keying.shutdown(wait=False, cancel_futures=True)
        self.hashing.shutdown(wait=False, cancel_futures=True)

    @property
    def client(self) -> AsyncCacheClient:
        assert self.upstream is not None, "the gate is not started"
        return self.upstream

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, gid = peer(sock)
        except OSError:
            pid, uid, gid = 0, -1, -1
        if not admitted(uid, gid, self.socket_gid):
            self.complain("refused", "the PJRT gate refused uid %d (pid %d): not the "
                          "worker's user, root, or of the socket's group", uid, pid)
            writer.close()
            return
        if self.open >= self.limits.connections or \
                self.by_process[pid] >= self.limits.per_process:
            self.complain("busy", "the PJRT gate is at its connection limit (%d in all, %d "
                          "per process): a compile was sent back to compile locally",
                          self.limits.connections, self.limits.per_process)
            with contextlib.suppress(Exception):
                writer.write(frame("LOCAL the worker's PJRT gate is at its connection limit"))
                writer.close()
            return
        self.open += 1
        self.by_process[pid] += 1
        frames = Reader(reader, self.limits, self.budget, pid)
        try:
            await self._converse(frames, writer, pid, uid)
        except (asyncio.IncompleteReadError, ConnectionError, BadFrame) as exc:
            self.complain(type(exc).__name__, "an interposed compile ended early: %s",
                          str(exc)[:200] or type(exc).__name__)
        except OverBudget as exc:
            self.complain("budget", "an interposed compile is compiled locally: %s", exc)
            with contextlib.suppress(Exception):
                writer.write(frame(f"LOCAL {exc}"[:1000]))
        except Exception as exc:  # ours: the caller compiles, the gate goes on
            self.complain("error", "an interposed compile ended on an error of the gate: "
                          "%s: %s", type(exc).__name__, str(exc)[:200])
        finally:
            frames.close()
            self.open -= 1
            self.by_process[pid] -= 1
            if self.by_process[pid] <= 0:
                del self.by_process[pid]
            writer.close()

    async def _request(self, frames: Reader, pid: int, uid: int) -> pjrtkeys.Compile:
        header, count = await frames.head(self.limits.header_s)
        if not isinstance(header, dict) or header.get("op") != "compile" or count != MAX_BLOBS:
            raise BadFrame("not a compile request")
        program = await frames.blob(MAX_BLOB)
        options = await frames.blob(MAX_TEXT)
        devices, plugin, env, token = [await frames.blob(MAX_TEXT) for _ in range(4)]
        header["pid"] = pid  # the kernel's word for it, not the caller's
        return pjrtkeys.Compile(header=header, program=program, options=options,
                                devices=devices.decode("utf-8", "replace"),
                                plugin=plugin.decode("utf-8", "replace"),
                                env=pjrtkeys.parse_env(env),
                                token=token.decode("utf-8", "replace").strip(), uid=uid)

    async def _converse(self, frames: Reader, writer: asyncio.StreamWriter, pid: int,
                        uid: int) -> None:
        c = await self._request(frames, pid, uid)
        platform = c.platform[:32] or "?"
        deadline = Deadline.after_s(self.wait_timeout_s)  # (the share-binary one, made here)
        decided = asyncio.ensure_future(self._decide(c, deadline))
        answer = None
        try:
            answer = await self._with_heartbeat(
                writer, decided, deadline.left_s() + FETCH_AFTER_WAIT_S)
            writer.write(answer.frame())
            await writer.drain()
        finally:
            if answer is None and decided.done() and not decided.cancelled() \
                    and decided.exception() is None:
                answer = decided.result()  # decided, then the caller went away
            if answer is not None:
                self._sent(answer)
        assert answer is not None  # (the try answered, or raised)
        self.count(platform, {"HIT": "hit", "COMPILE": "compile"}.get(answer.decision, "local"))
        if answer.decision != "COMPILE":
            return
        md = bearer(c.token)
        assert answer.lease is not None
        keeper = asyncio.create_task(self.client.keep(answer.key, answer.lease, md))
        settled = False
        try:
            settled = await self._settle(frames, writer, answer, platform, md)
        finally:
            keeper.cancel()
            if not settled:
                with contextlib.suppress(CompilecastError):
                    await self.client.release(answer.key, answer.lease, pb.ABANDONED,
                                              "the interposed compile ended without a publish",
                                              md)

    async def _with_heartbeat(self, writer: asyncio.StreamWriter, work, within_s: float):
        """`work`'s result, with a WAITING frame every GATE_HEARTBEAT_S
        meanwhile, each saying how long the answer can still take (it ends
        within `within_s` of now)."""
        task = asyncio.ensure_future(work)
        until = time.monotonic() + within_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=GATE_HEARTBEAT_S)
                if done:
                    return task.result()
                within = max(0.0, until - time.monotonic())
                writer.write(frame("WAITING", f"{within:.0f}".encode()))
                await writer.drain()
        finally:
            task.cancel()

    async def _key(self, c: pjrtkeys.Compile) -> Key:
        """The compile's key, made once for the compiles that send the same
        inputs (a host's processes ask for the same programs at once)."""
        loop = asyncio.get_running_loop()
        print_ = await loop.run_in_executor(self.keying, pjrtkeys.fingerprint, c)
        made = self.keys.get(print_)
        if made is None:
            made = asyncio.ensure_future(self._make_key(c))
            self.keys[print_] = made
            while len(self.keys) > KEYS_KEPT:
                self.keys.pop(next(iter(self.keys)))
        try:
            return await asyncio.shield(made)
        except Exception:
            self.keys.pop(print_, None)
            raise

    async def _make_key(self, c: pjrtkeys.Compile) -> Key:
        loop = asyncio.get_running_loop()
        pid = int(c.header.get("pid") or 0)
        plugin = await loop.run_in_executor(self.keying, functools.partial(
            pjrtkeys.plugin_component, c.plugin, c.uid, pid, hash_new=False))
        if plugin is None:  # a library not hashed yet: on a thread of its own, so that
            # no compile whose library is known waits behind it
            plugin = await loop.run_in_executor(self.hashing, pjrtkeys.plugin_component,
                                                c.plugin, c.uid, pid)
        return await loop.run_in_executor(self.keying, pjrtkeys.compile_key, c, plugin)

    async def fetch(self, key: str, digest: str, md: tuple) -> bytes:
        """The verified bytes of `digest`, fetched once for the compiles that
        want them at the same moment (a host's processes load one program),
        and held in the memory budget until the last answer that carries
        them has been written (`_sent`)."""
        held = self.payloads.get(digest)
        if held is None:
            shared = self.fetching.get(digest)
            if shared is None:
                shared = asyncio.ensure_future(self.client.fetch(
                    key, digest, md, take=self.budget.take, give=self.budget.give))
                self.fetching[digest] = shared
                shared.add_done_callback(lambda _: self.fetching.pop(digest, None))
            data = await asyncio.shield(shared)
            held = self.payloads.get(digest)
            if held is None:
                self.budget.take(len(data))  # OverBudget: this compile goes LOCAL
                held = self.payloads[digest] = [data, 0]
        held[1] += 1
        return held[0]

    def _sent(self, answer: Answer) -> None:
        """A HIT's bytes written (or never to be): its hold on the budget ends
        with the last answer that carried them."""
        held = self.payloads.get(answer.digest) if answer.decision == "HIT" else None
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del self.payloads[answer.digest]
            self.budget.give(len(held[0]))

    async def _decide(self, c: pjrtkeys.Compile, deadline: Deadline) -> Answer:
        try:
            made = await self._key(c)
            ident = identity(c.owners(), int(c.header.get("process_index", 0) or 0),
                             int(c.header["pid"]), c.options)
            request = policy.acquire_request(made.value, ident, components=made.components,
                                             program_name=f"pjrt:{c.platform}")
            # The worker has a credential of its own: a caller without one may
            # read (hits) but never hold a lease or publish under the worker's.
            decided = await policy.adrive(
                policy.decide(request, ident, deadline,
                              may_publish=not (self.tokens_required and not c.token)),
                GateShell(self, bearer(c.token)))
            if decided.kind == "HIT":
                assert decided.artifact is not None
                return Answer("HIT", payload=decided.data, key=decided.key,
                              digest=decided.artifact.digest)
            if decided.kind == "COMPILE":
                options = None
                if c.platform in GPU_PLATFORMS and len(set(c.owners().values())) > 1:
                    options = jax_adapter.without_shard_autotuning(c.options)
                return Answer("COMPILE", payload=options, key=decided.key, lease=decided.lease,
                              identity=ident)
            return Answer("LOCAL", decided.reason)
        except Exception as exc:  # the interposer compiles: never worse than without us
            self.complain("decide", "an interposed compile is compiled locally: %s",
                          f"{type(exc).__name__}: {exc}"[:300])
            return Answer("LOCAL", f"{type(exc).__name__}: {str(exc)[:200]}")

    async def _settle(self, frames: Reader, writer: asyncio.StreamWriter, answer: Answer,
                      platform: str, md: tuple) -> bool:
        """The holder's outcome; True when the lease ended (a publish, or
        given back)."""
        head, count = await frames.head(self.limits.compile_s)
        word, _, rest = str(head).partition(" ")
        data = await frames.blob(MAX_BLOB) if count else b""
        assert answer.lease is not None and answer.identity is not None
        shell = GateShell(self, md)
        if word != "publish" or not data:
            reason = pb.COMPILE_FAILED if "compile failed" in rest else pb.ABANDONED
            with contextlib.suppress(CompilecastError):
                await self.client.release(answer.key, answer.lease, reason, rest, md)
            self.count(platform, "failed")
            return True
        try:
            seconds = max(0.0, float(rest or 0))
        except ValueError:
            seconds = 0.0
        settled = await self._with_heartbeat(writer, policy.adrive(policy.settle(policy.Publish(
            answer.key, answer.lease, data, seconds, answer.identity)), shell),
            PUBLISH_ALLOWANCE_S + len(data) / self.limits.min_rate)
        if not settled.published:
            writer.write(frame(f"FAILED {settled.problem}"[:1000]))
            return settled.released
        writer.write(frame(f"OK published {answer.key}"))
        await writer.drain()
        return True
