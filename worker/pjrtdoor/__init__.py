"""The PJRT door: the interposer's worker side (the gate) and its keys."""
