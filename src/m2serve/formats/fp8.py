"""FP8 block (128x128, e4m3) quantise / dequantise (docs/checkpoints.md §6, DeepSeek-V3 convention).

``weight_scale_inv`` is multiplied, despite its name: ``W[i, j] = fp32(q[i, j]) *
s[i // 128, j // 128]``, one fp32 product, then one rounding to the target dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from m2serve.config.quant import FP8_BLOCK

E4M3_MAX = 448.0


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] -> [N/b, b, K/b, b] view after zero-padding N and K up to multiples of b."""
    n, k = x.shape
    pn, pk = -(-n // block) * block, -(-k // block) * block
    if (pn, pk) != (n, k):
        x = torch.nn.functional.pad(x, (0, pk - k, 0, pn - n))
    return x.reshape(pn // block, block, pk // block, block)


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` [N, K] (any float dtype) to e4m3 with one fp32 scale per block.

    Per block (docs/checkpoints.md §8): ``s = amax / 448`` (1.0 for an all-zero block),
    ``q = e4m3(W / s)``. Returns ``q`` float8_e4m3fn [N, K] and ``weight_scale_inv`` = s, float32
    [ceil(N/b), ceil(K/b)].
    """
    n, k = w.shape
    wb = _blocks(w.float(), block)  # [N/b, b, K/b, b]
    amax = wb.abs().amax(dim=(1, 3))  # [N/b, K/b]
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (wb / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(wb.shape[0] * block, wb.shape[2] * block)[:n, :k].contiguous()
    return q, s


def quantize_fp8_act_groups(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 activation quantisation per token and per ``group`` columns (what a checkpoint's
    ``activation_scheme: dynamic`` means; the W8A8 Triton linear does the same in its kernel):
    x [M, K] (K a multiple of ``group``) -> (float8_e4m3fn [M, K], f32 scales [M, K/group]) with,
    per row and group, ``s = amax(|x|) / 448`` (1 for an all-zero group) and
    ``q = e4m3(clamp(x / s, ±448))`` (round to nearest even).
    Raises ValueError naming K and the group when they do not divide."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"activation width {k} is not a multiple of the {group}-column group")
    g = x.float().view(m, k // group, group)
    amax = g.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (g / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), s


def fp8_scale_grid(n: int, k: int, row0: int = 0, col0: int = 0, block: int = FP8_BLOCK) -> tuple[int, int]:
    """Scale-grid shape ``[ceil((row0 + n)/b), ceil((col0 + k)/b)]`` of an ``[n, k]`` slice whose first
    row / column sit ``row0`` / ``col0`` into their ``b``-wide band (docs/checkpoints.md §6 "Slices
    that split a band"); (ceil(n/b), ceil(k/b)) for a whole weight. Raises ValueError naming the
    offset unless ``0 <= row0, col0 < b``."""
    for field_name, off in (("row0", row0), ("col0", col0)):
        if not 0 <= off < block:
            raise ValueError(f"{field_name}={off} must be in [0, {block}) (the offset inside the first "
                             f"{block}-wide scale band)")
    return -(-(row0 + n) // block), -(-(col0 + k) // block)


def check_scale_grid(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK, row0: int = 0,
                     col0: int = 0) -> None:
    """Raise ValueError naming both shapes (and the offsets when not 0) unless ``scale_inv`` is the
    :func:`fp8_scale_grid` of ``q`` [N, K] at ``row0`` / ``col0``."""
    n, k = q.shape
    grid = fp8_scale_grid(n, k, row0, col0, block)
    if tuple(scale_inv.shape) != grid:
        at = f" at row0 {row0}, col0 {col0}" if row0 or col0 else ""
        raise ValueError(f"FP8 scale grid {list(scale_inv.shape)} does not match weight {[n, k]}{at} "
                         f"in {block}x{block} blocks (expected {list(grid)})")


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                         block: int | tuple[int, int] = FP8_BLOCK, row0: int = 0,
                         col0: int = 0) -> torch.Tensor:
    """``q`` e4m3 [N, K], ``scale_inv`` [ceil((row0 + N)/b), ceil((col0 + K)/b)] -> dense [N, K] of
    ``dtype``.

    fp32(q) * fp32(s) per block, then one cast (docs/checkpoints.md §6):
    ``W[i, j] = fp32(q[i, j]) · s[(row0 + i) // b_n, (col0 + j) // b_k]``. ``block`` is b (square)
    or (b_n, b_k) (a refined grid, :func:`refine_fp8_grid`, with offsets 0). ``row0`` / ``col0``: a
    TP slice's offset inside its first band. Raises ValueError naming both shapes if the scale grid
    does not cover q, or naming an offset outside [0, b).
    """
    n, k = q.shape
    bn, bk = (block, block) if isinstance(block, int) else block
    if bn == bk:
        check_scale_grid(q, scale_inv, bn, row0, col0)
    elif row0 or col0 or tuple(scale_inv.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"FP8 scale grid {list(scale_inv.shape)} does not match weight {[n, k]} in "
                         f"{bn}x{bk} blocks (expected {[-(-n // bn), -(-k // bk)]}, offsets 0)")
    s = scale_inv.float().repeat_interleave(bn, 0)[row0:row0 + n].repeat_interleave(bk, 1)[:, col0:col0 + k]
    return (q.float() * s).to(dtype)


def refine_fp8_grid(scale_inv: torch.Tensor, n: int, k: int, row0: int = 0, col0: int = 0,
                    block_n: int | None = None, block_k: int | None = None) -> tuple[torch.Tensor, int, int]:
    """The same weight's scales on a finer grid that starts at its first row and column: for kernels
    that index ``s[i // b_n, j // b_k]`` from 0 (csrc/packed_linear.cpp, the Triton fused MoE) and so
    take no offset (docs/checkpoints.md §6 "Slices that split a band").

    ``scale_inv`` [..., ceil((row0 + n)/128), ceil((col0 + k)/128)] (leading dims: stacked experts)
    -> (s' [..., ceil(n/b_n), ceil(k/b_k)], b_n, b_k) with ``s'[i, j] = s[(row0 + i·b_n) // 128,
    (col0 + j·b_k) // 128]``: each b_n x b_k block lies inside one 128 x 128 block because b_n
    divides 128 and row0 (b_k: 128 and col0), so ``fp32(q[r, c]) · s'[r // b_n, c // b_k]`` is the
    offset formula of :func:`dequantize_fp8_block`, value for value. Defaults: b_n = gcd(128, row0),
    b_k = gcd(128, col0) (128 for a zero offset). Raises ValueError naming the block and offset when
    a given b_n / b_k does not divide 128 and its offset.
    """
    bn = math.gcd(FP8_BLOCK, row0) if block_n is None else block_n
    bk = math.gcd(FP8_BLOCK, col0) if block_k is None else block_k
    for field_name, b, off in (("block_n", bn, row0), ("block_k", bk, col0)):
        if b <= 0 or FP8_BLOCK % b or off % b:
            raise ValueError(f"{field_name}={b} must divide {FP8_BLOCK} and the offset {off}")
    grid = fp8_scale_grid(n, k, row0, col0)
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(f"FP8 scale grid {list(scale_inv.shape[-2:])} does not match weight {[n, k]} at "
                         f"row0 {row0}, col0 {col0} (expected {list(grid)})")
    dev = scale_inv.device
    rows = (row0 + torch.arange(-(-n // bn), device=dev) * bn) // FP8_BLOCK
    cols = (col0 + torch.arange(-(-k // bk), device=dev) * bk) // FP8_BLOCK
    s = scale_inv.index_select(-2, rows).index_select(-1, cols).contiguous()
    return s, bn, bk


@dataclass(slots=True)
class PackedFP8:
    """One FP8 block linear weight as stored (loader dispatch; kept so by ``--weight-dequant runtime``).

    ``q`` float8_e4m3fn [N, K]; ``scale`` float32 [ceil((row0 + N)/128), ceil((col0 + K)/128)]
    (``weight_scale_inv``, multiplied): the bands the weight (or its TP slice) covers. ``row0`` /
    ``col0``: offset of the first row / column inside its first 128-wide band, 0 unless a TP slice
    starts inside one (docs/checkpoints.md §6). :meth:`dequantize` is :func:`dequantize_fp8_block`.
    """

    q: torch.Tensor
    scale: torch.Tensor
    name: str = "weight"
    row0: int = 0
    col0: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Dense [N, K] of ``dtype``, one rounding from fp32. ValueError if the grid does not cover q."""
        return dequantize_fp8_block(self.q, self.scale, dtype, FP8_BLOCK, self.row0, self.col0)

    def rows(self, start: int, end: int) -> PackedFP8:
        """Rows ``[start, end)`` of the weight (views) with the scale rows covering them and the new
        ``row0``; any start (a band may be split). The scale must be the whole weight's grid
        (ValueError naming both shapes), so that a band never hides a bad grid."""
        check_scale_grid(self.q, self.scale, FP8_BLOCK, self.row0, self.col0)
        a, b = self.row0 + start, self.row0 + end
        return PackedFP8(self.q[start:end], self.scale[a // FP8_BLOCK:-(-b // FP8_BLOCK)], self.name,
                         a % FP8_BLOCK, self.col0)
