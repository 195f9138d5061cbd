"""A PyTorch/XLA script for the TPU (PJRT_DEVICE=TPU), unchanged: torch_xla
loads its TPU plugin from TPU_LIBRARY_PATH."""

import torch
import torch_xla.core.xla_model as xm

dev = xm.xla_device()
x = torch.arange(16, dtype=torch.float32, device=dev).reshape(4, 4)
y = (x @ x + 1).sum()
xm.mark_step()
print("value", float(y.cpu()), dev)
