"""Fan-out of one artifact to many workers: a relay tree per artifact.

When N workers fetch the same artifact at once (every host of a pod after
one compile), the coordinator streams it to the first and points each later
one at an earlier one, breadth first with `fanout` children per worker: a
tree of depth log_fanout(N) whose inner workers pass chunks on as they
arrive (worker/daemon/service.py streams a download to readers that join while it
runs). The coordinator sends about one copy instead of N.

In memory and per replica: a replica that restarts, or another replica,
just starts another tree (another copy). A worker that cannot get the
artifact from its peer asks again without a relay address and gets the bytes
from the coordinator, resuming at the offset it had reached; a worker asking
again is never redirected again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _Node:
    address: str
    since: float
    children: int = 0


MAX_TREES = 4096


class RelayTrees:
    """`chain_bytes`: the first size // chain_bytes workers of an artifact
    of `size` bytes form a chain (each relays to the next); later ones join
    breadth-first, `fanout` peers per worker. Where host links are the
    limit, a chain gives every host a whole link and costs a message's time
    per hop; a tree halves the link at every branch. So the chain wins while
    it is short next to the artifact, and gives way to the tree after."""

    def __init__(self, fanout: int = 2, window_s: float = 300.0, chain_bytes: int = 0) -> None:
        self.fanout = max(1, fanout)
        self.window_s = window_s
        self.chain_bytes = chain_bytes
        self._trees: dict[tuple[str, str], list[_Node]] = {}

    def assign(self, artifact: tuple[str, str], address: str, size: int = 0) -> str | None:
        """The peer `address` should fetch `artifact` (of `size` bytes) from,
        or None: from us. `artifact` is (tenant, digest)."""
        now = time.monotonic()
        if artifact not in self._trees and len(self._trees) >= MAX_TREES:
            self._expire(now)
        nodes = self._trees[artifact] = [n for n in self._trees.get(artifact, ())
                                         if now - n.since < self.window_s]
        if any(n.address == address for n in nodes):
            return None  # asking again: its peer failed it, or it lost the blob
        chained = self.chain_bytes and nodes and len(nodes) < size // self.chain_bytes \
            and not nodes[-1].children
        parent = nodes[-1] if chained else next(
            (n for n in nodes if n.children < self.fanout), None)
        nodes.append(_Node(address, now))
        if parent is None:
            return None
        parent.children += 1
        return parent.address

    def _expire(self, now: float) -> None:
        for k in [k for k, nodes in self._trees.items()
                  if not nodes or now - nodes[-1].since >= self.window_s]:
            del self._trees[k]
        while len(self._trees) >= MAX_TREES:  # all busy: drop the oldest
            del self._trees[next(iter(self._trees))]
