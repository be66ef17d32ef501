"""Launcher conventions shared by every Triton kernel (docs/kernels.md §1).

Compute dtype: a kernel takes a ``COMPUTE: tl.constexpr`` dtype into which it casts its operands
before ``tl.dot`` and elementwise math (accumulators are always fp32). The launcher sets it with
:func:`compute_dtype`: fp32 under the interpreter, whose bf16 arithmetic is broken in Triton 3.6
(a bf16 ``tl.dot`` off by ~4e10, bf16 + bf16 NaN, casts to bf16 truncate), so interpreter tests
compare fp32 math to 1e-5 and bf16 outputs within 1 bf16 ulp (the store's truncation); on CUDA
the tensors' real dtype (bf16 tensor-core dots). fp8 operands are never a compute dtype: they are
loaded and cast up (e4m3 is exact in bf16 and fp32).
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
             torch.float8_e4m3fn: tl.float8e4nv}


def interpreted() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype of a torch dtype. Raises ValueError naming a dtype no kernel takes."""
    if dtype not in TL_DTYPES:
        raise ValueError(f"dtype {dtype} has no Triton kernel (supported: {sorted(map(str, TL_DTYPES))})")
    return TL_DTYPES[dtype]


def compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """The ``COMPUTE`` constexpr for activations of ``dtype``: fp32 under the interpreter, else
    ``dtype`` itself (bf16 / fp16 / fp32). Raises ValueError for fp8 (never a compute dtype)."""
    if dtype == torch.float8_e4m3fn:
        raise ValueError("fp8 is a storage dtype, not a compute dtype: pass the activation dtype")
    return tl.float32 if interpreted() else tl_dtype(dtype)
