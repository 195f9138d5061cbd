"""The worker's Decide streams upstream: one per caller credential
(compilecast/decide.py's `Decider`), the least recently used closed past
MAX_DECIDERS once its waits have ended."""

from __future__ import annotations

import collections
import logging

from compilecast.decide import Decider
from compilecast.serving import Background

from .upstream import CoordinatorLink

log = logging.getLogger(__name__)

MAX_DECIDERS = 64  # upstream Decide streams kept open (one per caller credential)


class Deciders:
    """`gap_s`: between two messages of a Decide stream upstream."""

    def __init__(self, link: CoordinatorLink, background: Background, *, gap_s: float) -> None:
        self.link = link
        self.background = background
        self.gap_s = gap_s
        self.open: collections.OrderedDict[tuple, Decider] = collections.OrderedDict()
        self.retiring: set[Decider] = set()  # evicted, closed once their waits end

    def of(self, md: tuple) -> Decider:
        """The Decide stream to the coordinator for one upstream credential."""
        decider = self.open.pop(md, None)
        if decider is None:
            decider = Decider(self.link.decisions, md, timeout_s=self.link.rpc_timeout_s,
                              gap_s=self.gap_s)
            if len(self.open) >= MAX_DECIDERS:  # the least recently used goes
                _, old = self.open.popitem(last=False)
                self.retiring.add(old)  # closed at shutdown too, if its waits last that long
                self.background.spawn(self._retire(old))
        self.open[md] = decider
        return decider

    def credentials(self) -> list[tuple]:
        """The credentials of the streams open now (the per-job tokens in use)."""
        return list(self.open)

    async def _retire(self, decider: Decider) -> None:
        """Close a stream no longer used once its waits have ended (they may
        last the share-binary timeout: cutting them would fail them)."""
        try:
            await decider.close(when_idle=True)
        finally:
            self.retiring.discard(decider)

    async def close(self) -> None:
        for decider in [*self.open.values(), *self.retiring]:
            await decider.close()
