"""The JAX integration: `compilecast.jax.enable()`.

    import compilecast.jax
    compilecast.jax.enable()      # before the first compile

or, without code changes, set COMPILECAST_ENABLE=1 in the environment (JAX's
plugin discovery then enables it). See docs/jax.md.
"""

from compilecast.worker.jaxdoor.jax_integration import disable, enable, stats

__all__ = ["disable", "enable", "stats"]
