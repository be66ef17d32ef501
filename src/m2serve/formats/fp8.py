"""FP8 block (128x128, e4m3) quantise / dequantise (docs/checkpoints.md §6, DeepSeek-V3 convention).

``weight_scale_inv`` is multiplied, despite its name: ``W[i, j] = fp32(q[i, j]) *
s[i // 128, j // 128]``, one fp32 product, then one rounding to the target dtype.
"""

from __future__ import annotations

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


def check_scale_grid(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> None:
    """Raise ValueError naming both shapes unless ``scale_inv`` is the [ceil(N/b), ceil(K/b)] grid of
    ``q`` [N, K]."""
    n, k = q.shape
    grid = (-(-n // block), -(-k // block))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"FP8 scale grid {list(scale_inv.shape)} does not match weight {[n, k]} "
                         f"in {block}x{block} blocks (expected {list(grid)})")


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                         block: int = FP8_BLOCK) -> torch.Tensor:
    """``q`` e4m3 [N, K], ``scale_inv`` [ceil(N/b), ceil(K/b)] -> dense [N, K] of ``dtype``.

    fp32(q) * fp32(s) per block, then one cast (docs/checkpoints.md §6). Raises ValueError naming
    both shapes if the scale grid does not cover q.
    """
    n, k = q.shape
    check_scale_grid(q, scale_inv, block)
    s = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (q.float() * s).to(dtype)


@dataclass(slots=True)
class PackedFP8:
    """One FP8 block linear weight as stored (loader dispatch; kept so by ``--weight-dequant runtime``).

    ``q`` float8_e4m3fn [N, K]; ``scale`` float32 [ceil(N/128), ceil(K/128)] (``weight_scale_inv``,
    multiplied). :meth:`dequantize` is :func:`dequantize_fp8_block` (docs/checkpoints.md §6).
    """

    q: torch.Tensor
    scale: torch.Tensor
    name: str = "weight"

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Dense [N, K] of ``dtype``, one rounding from fp32. ValueError if the grid does not cover q."""
        return dequantize_fp8_block(self.q, self.scale, dtype)

    def rows(self, start: int, end: int) -> PackedFP8:
        """Rows ``[start, end)`` of the weight (views) with the scale rows covering them; ``start``
        must be a multiple of the 128-row block (ValueError naming the tensor), and the scale must be
        the whole weight's grid (ValueError naming both shapes), so that a band never hides a bad grid."""
        check_scale_grid(self.q, self.scale)
        if start % FP8_BLOCK:
            raise ValueError(f"{self.name}: FP8 row slice start {start} is not a multiple of the "
                             f"{FP8_BLOCK}-block")
        return PackedFP8(self.q[start:end], self.scale[start // FP8_BLOCK:-(-end // FP8_BLOCK)], self.name)
