"""Bias-free linear layer holding its weight [out, in] (uninitialised until loaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x · Wᵀ`` through F.linear; ``weight`` [out, in] (hub ``*.weight``).

    Unlike nn.Linear, construction does not initialise the (possibly huge) weight.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out], same dtype."""
        return F.linear(x, self.weight)
