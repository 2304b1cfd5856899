"""Pieces of `benchmarks/train_throughput.py`: the shared shapes and accounting (`common`), one module per
framework (`d9d_peer`, `hf_peer`, `titan_peer`) and the GPU-time breakdown behind `--profile` (`profile`).

Every row runs in its own subprocess (see the script), so the peers never share an allocator or a
compile cache and one row's crash or out-of-memory leaves the others standing.
"""
