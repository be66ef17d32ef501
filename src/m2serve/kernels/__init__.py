"""Packed-weight CPU kernels (C++, registered as torch.library ops) and their pure-PyTorch fallback.

Layer: ``config <- formats <- kernels <- model``. build.py compiles, caches and loads the C++
(csrc/packed_linear.cpp) and picks the ISA; ops.py holds the linears over weights as stored.
"""
