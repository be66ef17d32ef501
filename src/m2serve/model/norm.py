"""RMSNorm in HF order and the cross-head QK norm (docs/model.md §3 steps 1, 3, 9).

Legend: T tokens, W normalised width (H for hidden, Hq·D / Hkv·D for q / k on this rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-order RMSNorm: ``y = x.float() * rsqrt(mean(x², -1) + eps)``, cast to x.dtype, then * γ.

    x [T, W] act, weight [W] act -> [T, W] act (docs/model.md §3, precision trap 3).
    """
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def qk_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, global_width: int,
            reduce_sumsq: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Cross-head QK norm: ONE RMS statistic per token over all heads (docs/model.md §3 step 3).

    Two-phase so tensor parallelism only has to reduce the statistic (docs/parallelism.md §4):
    sum of squares of the local slice -> ``reduce_sumsq`` (identity on one rank) -> divide by the
    GLOBAL element count ``global_width`` (Hq·D or Hkv·D) -> rsqrt -> apply, HF cast order.
    x [T, W_local] act, weight [W_local] act -> [T, W_local] act.
    """
    y = x.float()
    sumsq = reduce_sumsq(y.pow(2).sum(-1, keepdim=True))  # [T, 1] f32
    y = y * torch.rsqrt(sumsq / global_width + eps)
    return weight * y.to(x.dtype)


def qk_norm_pair(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, q_width: int, k_width: int,
                 reduce_stats: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qk_norm` of q and k with ONE reduction of both statistics (docs/parallelism.md §4).

    q [T, Wq_local], k [T, Wk_local] act. The local fp32 sums of squares form one [T, 2] tensor
    that ``reduce_stats`` sums over the TP ranks (one all_reduce; identity on one rank); each is
    divided by its GLOBAL width (``q_width`` = Hq·D, ``k_width`` = Hkv·D), rsqrt, applied in the
    HF cast order (the same order as :func:`qk_norm`). Returns (q, k) normalised, act.
    """
    qf, kf = q.float(), k.float()
    stats = reduce_stats(torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=1))  # [T, 2] f32
    qn = qf * torch.rsqrt(stats[:, :1] / q_width + eps)
    kn = kf * torch.rsqrt(stats[:, 1:] / k_width + eps)
    return q_weight * qn.to(q.dtype), k_weight * kn.to(k.dtype)


class RMSNorm(nn.Module):
    """Holder of an RMSNorm γ [W] (hub ``*.weight``); forward is :func:`rms_norm`."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, W] act -> [T, W] act."""
        return rms_norm(x, self.weight, self.eps)
