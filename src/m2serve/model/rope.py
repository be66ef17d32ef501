"""Partial NeoX rotary position embedding (docs/model.md §3 step 5).

Legend: T tokens, Hh heads, D head_dim, R rotary_dim (rotated dims [0, R); [R, D) untouched).
"""

from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``inv_freq[j] = 1 / θ^(2j/R)``, j < R/2, in fp32 — exponent normalised by R, not D.

    -> [R/2] f32 (docs/model.md §3 step 5, precision trap 5).
    """
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int64 [T], inv_freq [R/2] f32 -> (cos, sin), each [T, R/2] f32."""
    phi = positions.float()[:, None] * inv_freq[None, :]
    return phi.cos(), phi.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (j, j + R/2) of dims [0, R) by the angle of each token; copy dims [R, D).

    x [T, Hh, D] act, cos/sin [T, R/2] f32 -> [T, Hh, D] act. Math in fp32, one cast
    (rotate-half, not interleaved; docs/model.md §3 step 5).
    """
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    a = x[..., :half].float()
    b = x[..., half: 2 * half].float()
    rot = torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)
    return torch.cat((rot, x[..., 2 * half:]), dim=-1)
