"""The worker's side of the PJRT interposer (worker/_pjrt_interposer.c).

A framework that compiles through a PJRT plugin wrapped by the interposer
sends each compile here, over the unix socket next to the worker's
(`<socket>.pjrt`): the program as the framework gave it, its serialized
CompileOptionsProto, the platform and its version, and the client's devices
with their processes. The worker keys it, asks as any process of the host
would (over its own socket, so the host cache and single-flight fetch apply)
and answers:

    HIT <key>       + the verified serialized executable
    COMPILE <key>   the interposer holds the lease: it compiles, then sends
                    "publish <seconds>" + the serialized executable, or
                    "failed <why>"; a closed connection releases the lease
    LOCAL <why>     compile without sharing

Frames: b"CCP1", a little-endian u32 header size, the header, then one (a
reply) or two (a request) blobs, each a little-endian u64 size and its bytes.

Who compiles follows JAX's per-program rule: a program whose devices (the
compile options' device assignment) span several processes is asked for as
the job's, compiled by the owner of its lowest device id while its other
processes wait; any other program first come, first served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass

from compilecast.v1 import cache_pb2 as pb

from . import hlocanon, keys
from .client import CacheClient, Identity

log = logging.getLogger(__name__)

MAGIC = b"CCP1"
MAX_HEADER = 1 << 20
MAX_BLOB = 8 << 30
KEY_VERSION = "pjrt-1"


class BadFrame(Exception):
    pass


async def read_blob(reader: asyncio.StreamReader) -> bytes:
    n = int.from_bytes(await reader.readexactly(8), "little")
    if n > MAX_BLOB:
        raise BadFrame(f"a blob of {n} bytes")
    return await reader.readexactly(n) if n else b""


async def read_head(reader: asyncio.StreamReader) -> str:
    head = await reader.readexactly(8)
    if head[:4] != MAGIC:
        raise BadFrame("not a compilecast PJRT frame")
    n = int.from_bytes(head[4:], "little")
    if n > MAX_HEADER:
        raise BadFrame(f"a header of {n} bytes")
    return (await reader.readexactly(n)).decode("utf-8", "replace")


def frame(header: str, payload: bytes = b"") -> bytes:
    h = header.encode()[:1000]
    return MAGIC + len(h).to_bytes(4, "little") + h + len(payload).to_bytes(8, "little") + payload


# -- what the compile options say ------------------------------------------------

def _message(buf: bytes, number: int) -> bytes:
    """The first occurrence of message field `number` of `buf` (b"" if none)."""
    for f, wire, _, vs, ve, _ in hlocanon.fields(buf, 0, len(buf)):
        if f == number and wire == hlocanon.LEN:
            return buf[vs:ve]
    return b""


def program_devices(compile_options: bytes) -> list[int]:
    """The device ids of the compile options' device assignment
    (CompileOptionsProto.executable_build_options.device_assignment:
    computation_devices.replica_device_ids), [] when it has none."""
    assignment = _message(_message(compile_options, 3), 9)
    ids: list[int] = []
    for f, wire, _, vs, ve, _ in hlocanon.fields(assignment, 0, len(assignment)):
        if f != 3 or wire != hlocanon.LEN:
            continue
        for g, gwire, _, gs, ge, value in hlocanon.fields(assignment, vs, ve):
            if g == 1:
                ids.extend(hlocanon.repeated_ints(assignment, gwire, gs, ge, value))
    return ids


def identity(req: dict, compile_options: bytes) -> Identity:
    """Who asks: the job's designated process for a program on several
    processes, else first come, first served."""
    client = f"{socket.gethostname()}:{int(req.get('pid', 0))}"
    owners = {}
    for pair in str(req.get("devices", "")).split(","):
        dev, _, proc = pair.partition(":")
        if dev.lstrip("-").isdigit() and proc.isdigit():
            owners[int(dev)] = int(proc)
    try:
        devices = [d for d in program_devices(compile_options) if d in owners]
    except ValueError:
        devices = []
    if len({owners[d] for d in devices}) < 2:
        return Identity(client=client)
    job = "pjrt-" + hashlib.sha256(",".join(
        f"{d}:{p}" for d, p in sorted(owners.items())).encode()).hexdigest()[:16]
    return Identity(job=job, process_id=int(req.get("process_index", 0)),
                    designated_process=owners[min(devices)], client=client)


def key_of(req: dict, program: bytes, compile_options: bytes) -> keys.Key:
    """The program's key as worker/keys.py makes it (debug metadata and names
    never change it), with the compile options as JAX's own key reads them
    (serialized maps come in any order; debug-only fields left out) and the
    platform."""
    from . import jax_adapter  # JAX's own canonical form of compile options

    key = keys.program_key(program)
    canonical = jax_adapter.canonical_compile_options(compile_options)
    key.components.update(
        compile_options=hashlib.sha256(canonical).hexdigest(),
        platform=str(req.get("platform", "")),
        platform_version=str(req.get("platform_version", "")),
        pjrt=KEY_VERSION)
    return key


@dataclass
class Answer:
    decision: str
    reason: str
    payload: bytes = b""
    key: str = ""
    lease: pb.Lease | None = None
    identity: Identity | None = None


class PjrtGate:
    """The listener of the host's interposed compiles."""

    def __init__(self, path: str, worker_target: str, *, wait_timeout_s: float,
                 count=lambda platform, outcome: None) -> None:
        self.path = path
        self.client = CacheClient(worker_target, timeout_s=10.0)
        self.wait_timeout_s = wait_timeout_s
        self.count = count
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o660)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.client.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer = None
        platform = "?"
        try:
            req = json.loads(await read_head(reader))
            platform = str(req.get("platform", "?"))[:32]
            program, options = await read_blob(reader), await read_blob(reader)
            answer = await asyncio.to_thread(self._decide, req, program, options)
            writer.write(frame(f"{answer.decision} {answer.key or answer.reason}",
                               answer.payload))
            await writer.drain()
            self.count(platform, {"HIT": "hit", "COMPILE": "compile"}.get(answer.decision, "local"))
            if answer.decision == "COMPILE":
                await self._settle(reader, writer, answer, platform)
        except (asyncio.IncompleteReadError, ConnectionError, BadFrame, ValueError) as exc:
            log.warning("an interposed compile ended early: %s", exc)
            if answer is not None and answer.decision == "COMPILE":
                await asyncio.to_thread(self._release, answer, pb.ABANDONED, str(exc))
        finally:
            writer.close()

    def _decide(self, req: dict, program: bytes, options: bytes) -> Answer:
        try:
            made = key_of(req, program, options)
            key, ident = made.value, identity(req, options)
            # The components go with it: `compilecast explain` tells two such keys apart.
            got = self.client.acquire(key, identity=ident, components=made.components,
                                      program_name=f"pjrt:{req.get('platform', '?')}"[:200])
            if got.decision == pb.HIT:
                _, data = self.client.fetch(key, got.artifact.digest)
                return Answer("HIT", "", data, key)
            if got.decision == pb.WAIT:
                event, data = self.client.wait_and_fetch(key, self.wait_timeout_s, identity=ident)
                if data is not None:
                    return Answer("HIT", "", data, key)
                got = pb.AcquireResponse(decision=event.decision, lease=event.lease,
                                         reason=event.reason)
            if got.decision == pb.COMPILE:
                self.client.keep_lease(key, got.lease)
                return Answer("COMPILE", "", b"", key, got.lease, ident)
            return Answer("LOCAL", got.reason or "compile locally")
        except Exception as exc:  # the interposer compiles: never worse than without us
            log.warning("an interposed compile is compiled locally: %s: %s",
                        type(exc).__name__, exc)
            return Answer("LOCAL", f"{type(exc).__name__}: {str(exc)[:200]}")

    async def _settle(self, reader, writer, answer: Answer, platform: str) -> None:
        head = await read_head(reader)
        data = await read_blob(reader)
        await read_blob(reader)
        word, _, rest = head.partition(" ")
        if word != "publish" or not data:
            await asyncio.to_thread(self._release, answer, pb.COMPILE_FAILED
                                    if "compile failed" in rest else pb.ABANDONED, rest)
            self.count(platform, "failed")
            return
        try:
            seconds = float(rest or 0)
        except ValueError:
            seconds = 0.0
        outcome = await asyncio.to_thread(self._publish, answer, data, seconds)
        writer.write(frame(outcome))
        await writer.drain()

    def _publish(self, answer: Answer, data: bytes, seconds: float) -> str:
        assert answer.lease is not None
        try:
            self.client.publish(answer.key, answer.lease, data, seconds,
                                identity=answer.identity)
            return f"OK published {answer.key}"
        except Exception as exc:
            self._release(answer, pb.ABANDONED, f"publish failed: {exc}")
            return f"FAILED {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            self.client.stop_lease(answer.key, answer.lease)

    def _release(self, answer: Answer, reason: int, detail: str) -> None:
        assert answer.lease is not None
        self.client.stop_lease(answer.key, answer.lease)
        with contextlib.suppress(Exception):
            self.client.release(answer.key, answer.lease, reason, detail[:1000])
