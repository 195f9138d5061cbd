"""The key library: canonical program keys (HLO and MLIR walks) and their composition."""
