"""Triton kernels, each beside its PyTorch reference (the engine calls them through a dispatcher)."""
