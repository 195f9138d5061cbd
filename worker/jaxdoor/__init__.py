"""The JAX door: compilecast inside a JAX process (the integration, AOT, releases)."""
