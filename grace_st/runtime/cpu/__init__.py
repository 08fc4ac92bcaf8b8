"""The CPU kernels behind the decode step: the native step (C), packed linear layers, int8 weights."""
