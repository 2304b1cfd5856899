"""Custom compute kernels, each beside the pure-PyTorch reference it is tested against.

Triton is imported only when a Triton backend is actually chosen, so CPU-only installs (and machines
without Triton) use the reference paths without importing it.
"""
