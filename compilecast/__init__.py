"""compilecast: compile each XLA program once per fleet.

Public surface: the JAX integration lives in `compilecast.jax`; the servers in
`compilecast.coordinator` and `compilecast.worker`; the wire API in
`compilecast.v1`.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
