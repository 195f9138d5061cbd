"""A worker's relay data plane: what it passes on to peer workers, over plain
TCP with sendfile.

Relayed over gRPC, every 512 KiB costs the relaying worker a Python message
(the chunk queued, framed and sent) on top of its own download; on a pod each
host's worker does that for the next host while the host's jobs want its
cores. So a peer's relay Fetch that takes a data ticket (FetchRequest.
accept_data_ticket) is answered with one, as the coordinator answers a
fetch (coordinator/dataplane.py): FetchChunk.data_ticket, ":port" of this
listener (the peer dials the host it reached the relay on) and a one-time
token, issued only over the relay's own Fetch call and its checks. A ticket
stands for a file this worker sends as it stands, with no Python touching
the bytes:
- a download in progress whose host cache file is stored raw, sent as far as
  it is written and on as it grows (the file a host's processes follow;
  `Fill.readable`);
- a committed blob this worker wrote or verified (DiskBlobStore.open_sendable),
  raw, or as the zstd stream it keeps to a peer that decodes it.
The connection carries what the coordinator's data plane carries (RAW_MAGIC
then the artifact, or one zstd stream), so the peer reads it with the same
code (worker/daemon/dataplane.py, RelayFill) and verifies the digest. A
download that fails, or whose file stops being kept, ends the connection
short: the peer fetches the rest from the coordinator, from where it got to.
Offered only where the relay's gRPC port is plaintext too: the token stands
in for the peer's credential for one artifact.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from compilecast.streams import RAW_MAGIC
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import (
    DATA_PLANE_REQUEST,
    REQUEST_S,
    TICKET_S,
    UNACKED_S,
    TicketServer,
    data_plane_request,
)

log = logging.getLogger(__name__)

MAX_RELAY_TICKETS = 1024  # outstanding tickets (each holds an open file); past it, gRPC
MAX_RELAY_CONNECTIONS = 256  # open at once; past it a connection is closed at once
WAIT_S = 10.0  # a growing file that does not grow for this long: its download is checked again


@dataclass
class _Ticket:
    file: Any  # open for reading
    size: int  # the file's length once whole
    fill: Any  # worker/daemon/service.py's Fill it grows with, or None: the file is whole
    expires: float


class RelayPlane(TicketServer):
    name = "relay data plane"

    def __init__(self, listen: str, counter: Counter) -> None:
        super().__init__(listen)
        self.counter = counter  # by result: offered, sent, short, refused

    def offer(self, file, size: int, fill=None) -> pb.DataTicket | None:
        """A ticket for `file` (whole at `size` bytes; with `fill`, growing
        as that download writes it), or None when too many are out (the
        file is closed then: the fetch goes over gRPC). The ticket owns the
        file from here."""
        self._expire_tickets()
        if len(self._tickets) >= MAX_RELAY_TICKETS:
            file.close()
            return None
        self.counter.labels("offered").inc()
        return self._issue(self._tickets, _Ticket(file, size, fill, time.monotonic() + TICKET_S))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._sends.add(task)
        ticket = None
        try:
            request = None
            if len(self._sends) <= MAX_RELAY_CONNECTIONS:
                request = await data_plane_request(reader, writer, REQUEST_S, UNACKED_S)
            self._expire_tickets()
            if request is not None and request[0] == DATA_PLANE_REQUEST:
                ticket = self._tickets.pop(request[1], None)
            if ticket is None:
                log.info("relay data plane: refused a connection from %s (no such ticket)",
                         writer.get_extra_info("peername"))
                self.counter.labels("refused").inc()
                return
            try:
                sent = await _send(writer.transport, ticket)
            except (OSError, RuntimeError) as exc:
                log.info("relay data plane: a send broke off (%s)", exc)
                sent = -1
            self.counter.labels("sent" if sent == ticket.size else "short").inc()
        finally:
            if ticket is not None:
                ticket.file.close()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._sends.discard(task)


def _whole(fill) -> bool:
    """Whether a finished download verified and committed its file."""
    return fill.done.done() and fill.done.exception() is None and fill.kept


async def _send(transport, ticket: _Ticket) -> int:
    """Send the ticket's file, following its download while it grows; the
    bytes sent (short of `size` where the download failed, or its file
    stopped being kept)."""
    loop = asyncio.get_running_loop()
    sent, fill = 0, ticket.fill
    while sent < ticket.size:
        if fill is None or (fill.finished and _whole(fill)):
            ready = ticket.size
        elif (written := fill.readable()) is not None:
            ready = len(RAW_MAGIC) + written
        else:  # failed, or no longer written raw (no room left on the disk)
            break
        if ready > sent:
            sent += await loop.sendfile(transport, ticket.file, sent, ready - sent)
        elif fill is not None:
            await fill.changed(WAIT_S)
    return sent
