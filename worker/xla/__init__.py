"""What the worker reads of JAX's and XLA's internals: one adapter, checked at import."""
