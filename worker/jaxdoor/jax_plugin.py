"""Enables compilecast from the environment, without code changes.

JAX imports every module advertised under the `jax_plugins` entry-point group
when it initializes its backends (before any compile) and calls its
`initialize()`. With COMPILECAST_ENABLE=1 this turns the integration on;
otherwise it does nothing.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("compilecast.jax")


def initialize() -> None:
    if os.environ.get("COMPILECAST_ENABLE", "").lower() not in ("1", "true", "yes", "on"):
        return
    try:
        from compilecast.worker.jaxdoor.jax_integration import active_cache, enable

        if active_cache is None:
            enable()
    except Exception as exc:  # never break JAX's startup
        log.warning("compilecast: could not enable from COMPILECAST_ENABLE: %s", exc)
