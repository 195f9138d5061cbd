"""A wait's share-binary timeout as one value, from the door to the wait.

The operator sets the share-binary timeout in milliseconds (JAX's
`jax_share_binary_between_hosts_timeout_ms`, the chart, a worker's or a
coordinator's config), and a wait's request carries what is left of it on
the wire (`WaitRequest.timeout_ms`; 0: the server's own). Everywhere
between, it is a `Deadline`: made once where the wait begins (a door's
decision, a worker's or a replica's edge, from what the request says), and
asked what is left as the wait goes on (a data-plane wait, then a fetch, a
retry, a promotion), never turned back into a length and added again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from compilecast.errors import InvalidRequest

FOREVER = float("inf")
MOST_MS = 7 * 24 * 3600 * 1000  # the longest wait any server takes a request's word for


@dataclass(frozen=True)
class Deadline:
    """When a wait must have ended (time.monotonic's clock; inf: unbounded,
    the server's timeout applies)."""

    at: float
    length_s: float  # the whole of it, as made (for what a message says)

    @classmethod
    def after_s(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    @classmethod
    def after_ms(cls, ms: int) -> Deadline:
        """`ms` from now; 0 or less: unbounded (a request's "the server's own")."""
        return cls.after_s(ms / 1000.0) if ms > 0 else cls(FOREVER, FOREVER)

    @classmethod
    def asked(cls, ms: int, own_ms: int = 0) -> Deadline:
        """A request's `timeout_ms` as a server's edge reads it: 0 is the
        server's own share-binary timeout (`own_ms`; 0: none), more is bounded
        by it, and every wait by MOST_MS; a negative one is InvalidRequest."""
        if ms < 0:
            raise InvalidRequest(f"timeout_ms must be >= 0 (0: the server's own), not {ms}")
        most = min(own_ms, MOST_MS) if own_ms > 0 else MOST_MS
        return cls.after_ms(min(ms, most) if ms else (own_ms and most))

    @classmethod
    def of(cls, within: Deadline | float) -> Deadline:
        """A deadline, or one `within` seconds from now (a caller's length,
        taken at the API's edge)."""
        return within if isinstance(within, Deadline) else cls.after_s(within)

    @property
    def bounded(self) -> bool:
        return self.at != FOREVER

    def left_s(self) -> float:
        """Seconds left (0 once passed; inf when unbounded)."""
        return max(0.0, self.at - time.monotonic())

    def left_ms(self) -> int:
        """What a request says is left: at least 1 ms while bounded (0 on
        the wire means the server's own timeout), 0 when unbounded."""
        if not self.bounded:
            return 0
        return max(1, int((self.at - time.monotonic()) * 1000))

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def said(self) -> str:
        """Its length as a message names it ("20.0s")."""
        return f"{self.length_s:.1f}s" if self.bounded else "no limit"
