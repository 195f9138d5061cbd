"""A client's publishes: the holder's bytes to the coordinator or the host's
worker (over gRPC, a data plane, or handed over as a sealed memory file),
tried again when cut off, and its compile lease kept alive meanwhile: the
Publisher and the LeaseKeepers a CacheClient (worker/inprocess/client.py) is built with.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator

from compilecast import retry
from compilecast.errors import CompilecastError
from compilecast.negotiate import PROCESS_PUBLISH, Ends, Ladder, Routes, carry
from compilecast.streams import Sha256
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.wire import TRANSFER_S, DataChunk, as_chunks

from .dataplane import PUBLISH_CHUNK
from .policy import keepalive_every
from .received import Stalled, Watchdog
from .routeends import Sender, UploadTickets

log = logging.getLogger("compilecast.worker.inprocess.client")



class LeaseKeepers:
    """The compile leases a process holds, each renewed on a daemon thread of
    its own until its claim ends; and the publishes in flight (a lease that a
    publish ended is not reported as lapsed)."""

    def __init__(self, keepalive: Callable[[str, pb.Lease], int]) -> None:
        self._keepalive = keepalive
        # (key, lease id) -> its keeper's stop: a process's claims share one
        # lease, and each claim is renewed (and stopped) on its own.
        self._keepers: dict[tuple[str, int], threading.Event] = {}
        self.publishing: set[tuple[str, int]] = set()  # publishes in flight

    def keep(self, key: str, lease: pb.Lease) -> None:
        """Keep the claim on `key` alive in the background until stop(key, lease)."""
        stop = threading.Event()
        previous = self._keepers.pop((key, lease.id), None)
        if previous is not None:
            previous.set()
        self._keepers[(key, lease.id)] = stop
        interval = keepalive_every(lease)

        def run() -> None:
            while not stop.wait(interval):
                try:
                    if self._keepalive(key, lease) <= 0:
                        # A publish that landed ends the claim too: only say
                        # "lapsed" when nothing of ours ended it.
                        if not stop.is_set() and (key, lease.id) not in self.publishing:
                            log.warning("compile lease for %s lapsed", key)
                        return
                except CompilecastError as exc:
                    log.debug("keepalive for %s failed: %s", key, exc.status.name)

        threading.Thread(target=run, name=f"compilecast-keepalive-{lease.id}",
                         daemon=True).start()

    def stop(self, key: str, lease: pb.Lease) -> None:
        stop = self._keepers.pop((key, lease.id), None)
        if stop is not None:
            stop.set()

    def close(self) -> None:
        for stop in self._keepers.values():
            stop.set()


class Publisher:
    """A process's publishes to `target` (the host's worker or a coordinator):
    over the data plane or a handoff where the routes allow, else gRPC; tried
    again when cut off."""

    def __init__(self, stub: rpc.CompileCacheStub, target: str, routes: Routes,
                 keepers: LeaseKeepers, *, tickets: UploadTickets, senders: Ends[Sender],
                 stall_s: float) -> None:
        self.stub = stub
        self.target = target
        self.routes = routes
        self.keepers = keepers
        self.tickets = tickets  # an upload's ticket, and the routes it goes over:
        self.senders = senders  # a handoff to the host's worker, the coordinator's data plane
        self.stall_s = stall_s

    def publish(self, key: str, lease: pb.Lease, data: bytes,
                compile_time_s: float, recipe: pb.Recipe | None, *,
                requester: pb.Requester) -> pb.ArtifactInfo:
        """`requester`: the one the lease was taken with."""
        # The digest goes last (hashed as the bytes are sent, not before the
        # first: 0.14 s for 187 MB here) where the lease says the coordinator
        # takes it so (not one that streams uploads to their readers).
        header = pb.PublishHeader(key=key, lease=lease, size=len(data),
                                  compile_time_seconds=compile_time_s,
                                  requester=requester, recipe=recipe)
        if not lease.takes_digest_last:
            header.digest = hashlib.sha256(data).hexdigest()
        self.keepers.publishing.add((key, lease.id))
        try:
            # A replica restarting or gone (a rolling update): the lease still
            # holds and the bytes are here, so it is tried again (retry.PUBLISH),
            # on the same ladder. AlreadyPublished after a lost answer: the
            # policy's settle finds its own bytes there (policy.py).
            return carry(self.routes.ladder(PROCESS_PUBLISH, key=key),
                         lambda ladder: self._publish_via(header, data, ladder),
                         again=retry.PUBLISH, what=f"the publish of {key}")
        finally:
            self.keepers.publishing.discard((key, lease.id))

    def _publish_via(self, header: pb.PublishHeader, data: bytes,
                     ladder: Ladder) -> pb.ArtifactInfo:
        """The publish over the first route left that suits it (an upload for
        a ticket: a handoff to this host's worker, or the coordinator's data
        plane), else the Publish stream. RouteFailed where the bytes must go
        another way: an upload that broke off goes on another way at once (a
        server that went away then answers that way)."""
        sender = self.senders.first(ladder, len(data))  # (uploads suit big publishes only)
        if sender is None:
            return self._send(header, data)
        return sender.send(header, data, self.tickets.open(header))

    def _send(self, header: pb.PublishHeader, data: bytes) -> pb.ArtifactInfo:
        key = header.key
        dog = Watchdog(self.stall_s)

        def ticking():
            for message in publish_messages(header, data):
                dog.tick()
                yield message

        call = self.stub.Publish.future(as_chunks(ticking()), timeout=TRANSFER_S)
        with dog.watching(call.cancel):
            try:
                return call.result().artifact
            except CompilecastError:
                if dog.fired:
                    raise Stalled(f"publish of {key} to {self.target} moved nothing for "
                                  f"{self.stall_s:g}s") from None
                raise


def publish_messages(header: pb.PublishHeader,
                     data: bytes) -> Iterator[pb.PublishChunk | DataChunk]:
    """A Publish stream: the header, the chunks, and, when the header has no
    digest, a last message with the digest of the bytes sent (hashed as they
    go, on a thread of its own for a big artifact)."""
    yield pb.PublishChunk(header=header)
    view = memoryview(data)
    h = None if header.digest else Sha256()
    try:
        for off in range(0, len(data), PUBLISH_CHUNK):
            piece = view[off:off + PUBLISH_CHUNK]
            if h is not None:
                h.update(piece)
            yield DataChunk(piece)
        if h is not None:
            yield pb.PublishChunk(digest=h.hexdigest())
    finally:
        if h is not None:
            h.close()  # a publish cut short: its hashing thread ends too
