"""The PyTorch/XLA door: torch_xla's persistent cache shared through the worker."""
