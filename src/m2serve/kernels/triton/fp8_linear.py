"""Block-scaled FP8 linear ``y = x · dequant(W)ᵀ`` on the stored codes (docs/kernels.md §4).

Legend: M activation rows, N output rows of this rank's slice, K input features, Kb = ceil(K/128)
scale columns, G = 128 (the checkpoint's ``weight_block_size``, config/quant.py FP8_BLOCK).

Weights as the official release stores them: ``q`` float8_e4m3fn [N, K] and ``weight_scale_inv``
f32 [bands, Kb], one scale per 128 x 128 block, multiplied (docs/checkpoints.md §6). A TP slice may
start inside a 128-wide scale band: ``row0`` (0..127) is the offset of the slice's first row in its
first band and ``col0`` that of its first column (a row-parallel slice), and the scale rows and
columns passed are the bands covering the slice (``bands = ceil((row0 + N) / 128)``, ``Kb =
ceil((col0 + K) / 128)``). The K loop walks the global 128-column blocks the slice touches (local
columns ``kb·128 − col0 …``, masked outside [0, K)), so every K step has one scale column.

Two variants, one kernel (``W8A8`` constexpr):

- **W8A16**: activations as they are (bf16 on a GPU). Per K block of 128, ``x_blk · q_blkᵀ`` in the
  COMPUTE dtype with fp32 accumulation, times the weight scale of each output row's band. Equal to
  ``x · dequantize_fp8_block(q, s, fp32)ᵀ`` up to fp32 summation order (the scale is applied to
  the block's partial sum instead of each weight: the same products).
- **W8A8 dynamic** (``activation_scheme: dynamic``; GPUs with FP8 tensor cores, sm_89+): per token
  and per 128-column group (the weight's blocks: with ``col0`` the first group holds the
  ``128 − col0`` columns up to the band's end), ``a = amax(|x|) / 448`` (1 for an all-zero group)
  and ``xq =
  e4m3(clamp(x / a, ±448))``, computed in the kernel; then ``(xq · qᵀ)`` on FP8 tensor cores with
  fp32 accumulation, times ``a`` per row and the weight scale per column. The same quantiser in
  torch is formats/fp8.py ``quantize_fp8_act_groups`` (the CPU reference of the quantiser).

Launch: :func:`fp8_linear`. Variants registered for the sm_90 compile test (aot.py): both modes,
bf16 activations, BLOCK_M 16 (decode) and 64 (prefill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m2serve.config.engine_args import FP8_LINEAR_MODES
from m2serve.config.quant import FP8_BLOCK
from m2serve.formats.fp8 import E4M3_MAX, check_scale_grid
from m2serve.kernels.triton.aot import Variant, register
from m2serve.kernels.triton.runtime import compute_dtype

BLOCK_N = 64  # output rows per program
DECODE_ROWS = 16  # M at or below this uses BLOCK_M 16 (decode), else 64 (prefill)


@triton.jit
def _fp8_linear_kernel(x, w, ws, y, M, N, K, ROW0, COL0, stride_xm, stride_wn, stride_sn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                       W8A8: tl.constexpr, FP8_MAX: tl.constexpr, COMPUTE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    band = (rn + ROW0) // GROUP  # scale row of each output row (a band may be split across ranks)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K + COL0, GROUP)):
        k = kb * GROUP + rk - COL0  # local columns of global block kb (a split band: some < 0)
        kin = (k[None, :] >= 0) & (k[None, :] < K)
        a = tl.load(x + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & kin, other=0.0)
        b = tl.load(w + rn[:, None] * stride_wn + k[None, :], mask=(rn[:, None] < N) & kin, other=0.0)
        s_w = tl.load(ws + band * stride_sn + kb, mask=rn < N, other=0.0)
        if W8A8:
            af = a.to(tl.float32)
            amax = tl.max(tl.abs(af), axis=1)
            s_a = tl.where(amax > 0, amax / FP8_MAX, 1.0)
            aq = tl.clamp(af / s_a[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
            part = tl.dot(aq, tl.trans(b))
            acc += part * s_a[:, None] * s_w[None, :]
        else:
            part = tl.dot(a.to(COMPUTE), tl.trans(b.to(COMPUTE)))
            acc += part * s_w[None, :]
    tl.store(y + rm[:, None] * stride_ym + rn[None, :], acc.to(y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_SIGNATURE = {"x": "*bf16", "w": "*fp8e4nv", "ws": "*fp32", "y": "*bf16", "M": "i32", "N": "i32", "K": "i32",
              "ROW0": "i32", "COL0": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
              "stride_ym": "i32",
              "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "GROUP": "constexpr", "W8A8": "constexpr",
              "FP8_MAX": "constexpr", "COMPUTE": "constexpr"}

for _mode in FP8_LINEAR_MODES:
    for _bm in (DECODE_ROWS, 64):
        register(Variant(f"fp8_linear/{_mode}/bf16/m{_bm}", _fp8_linear_kernel, _SIGNATURE,
                         {"BLOCK_M": _bm, "BLOCK_N": BLOCK_N, "GROUP": FP8_BLOCK, "W8A8": _mode == "w8a8",
                          "FP8_MAX": E4M3_MAX, "COMPUTE": tl.bfloat16}, {"num_warps": 4}))


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row0: int = 0,
               mode: str = "w8a16", col0: int = 0) -> torch.Tensor:
    """x [..., K] act (bf16 on a GPU; fp32 too) through ``q`` float8_e4m3fn [N, K] with
    ``scale`` f32 [ceil((row0 + N)/128), ceil((col0 + K)/128)] -> [..., N] of x's dtype.

    ``row0`` / ``col0``: offset of q's first row / column inside its first 128-wide scale band (a
    TP slice that splits a band). ``mode``: ``"w8a16"`` or ``"w8a8"`` (module docstring). Raises
    ValueError naming the mismatch for a wrong width, scale grid, row0 / col0 or mode.
    """
    if mode not in FP8_LINEAR_MODES:
        raise ValueError(f"fp8_linear mode={mode!r}: use one of {FP8_LINEAR_MODES}")
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"activation width {x.shape[-1]} does not match the FP8 weight's in_features {k}")
    check_scale_grid(q, scale, FP8_BLOCK, row0, col0)
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = DECODE_ROWS if m <= DECODE_ROWS else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    _fp8_linear_kernel[grid](rows, q, scale, y, m, n, k, row0, col0, rows.stride(0), q.stride(0),
                             scale.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=BLOCK_N, GROUP=FP8_BLOCK,
                             W8A8=mode == "w8a8", FP8_MAX=E4M3_MAX, COMPUTE=compute_dtype(x.dtype),
                             num_warps=4)
    return y.view(*x.shape[:-1], n)
