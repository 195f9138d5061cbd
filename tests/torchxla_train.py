"""A PyTorch/XLA training step, as a user's script (no compilecast in it).
Prints one JSON line: torch_xla's cache counters and the loss.

    python torchxla_train.py [--pause DIR]

--pause: after a warm-up graph of its own, write DIR/ready and wait for
DIR/go before the training steps (a host that starts while another compiles).
"""

import argparse
import json
import os
import time

import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

COUNTERS = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure",
            "UncachedCompile")

ap = argparse.ArgumentParser()
ap.add_argument("--pause", default="")
args = ap.parse_args()

dev = xm.xla_device()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 1)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64).to(dev), torch.randn(32, 1).to(dev)
if args.pause:
    warm = (x * 2).sum()
    xm.mark_step()
    open(os.path.join(args.pause, "ready"), "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(args.pause, "go")):
        if time.monotonic() > deadline:
            raise SystemExit("never told to go on")
        time.sleep(0.05)
for _ in range(3):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    xm.mark_step()
print(json.dumps({"loss": loss.item(),
                  **{name: met.counter_value(name) or 0 for name in COUNTERS}}))
