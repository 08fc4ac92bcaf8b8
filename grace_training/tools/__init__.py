"""Tools over finished runs: export an adapter into the package, low-rank distillation, averaging, interpolation."""
