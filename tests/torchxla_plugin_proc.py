"""torch_xla on a dynamic PJRT plugin ($PJRT_PLUGIN_PATH: the interposer):
one small graph, as a user's script would run it."""

import os

import torch
import torch_xla.core.xla_model as xm
import torch_xla.experimental.plugins as plugins


class Interposed(plugins.DevicePlugin):
    def library_path(self):
        return os.environ["PJRT_PLUGIN_PATH"]


plugins.use_dynamic_plugins()
plugins.register_plugin("CCPLUG", Interposed())
os.environ["PJRT_DEVICE"] = "CCPLUG"
dev = xm.xla_device()
x = torch.arange(16, dtype=torch.float32, device=dev).reshape(4, 4)
y = (x @ x + 1).sum()
xm.mark_step()
print("value", float(y.cpu()))
