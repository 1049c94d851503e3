"""Triton kernels, each with a typed launcher and a torch reference beside it (STYLE rule 11).

The GPU-path issue fills this package; the CPU runtime uses `braid.runtime.attention.torch_native`.
"""
