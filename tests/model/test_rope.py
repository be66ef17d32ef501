"""Partial NeoX RoPE: hand-derived facts (docs/model.md §6) and the rotation formula (§3 step 5)."""

from __future__ import annotations

import math

import torch

from m2serve.model.rope import apply_rope, rope_cos_sin, rope_inv_freq


def test_inv_freq_has_rotary_dim_over_2_entries():
    # docs/model.md §6: R/2 entries, inv_freq[0] = 1, exponent normalised by R (not D)
    for R in (64, 32):
        f = rope_inv_freq(R, 5e6)
        assert f.shape == (R // 2,) and f.dtype == torch.float32 and f[0].item() == 1.0
        j = R // 2 - 1
        assert math.isclose(f[j].item(), 5e6 ** (-2 * j / R), rel_tol=1e-6)


def test_position_zero_is_identity_and_tail_dims_untouched():
    # docs/model.md §6: at pos 0 RoPE is the identity; dims >= R are bit-identical for any pos
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 128, generator=g)
    cos, sin = rope_cos_sin(torch.tensor([0, 1, 7, 300, 4095]), rope_inv_freq(64, 5e6))
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[0], x[0])
    assert torch.equal(y[:, :, 64:], x[:, :, 64:])
    assert not torch.equal(y[1, :, :64], x[1, :, :64])


def test_rotation_pairs_are_j_and_j_plus_half():
    # docs/model.md §6: pairs (j, j + R/2) keep a² + b²; hand-derived angle pos * θ^(-2j/R)
    R, pos, theta = 64, 5, 5e6
    x = torch.zeros(1, 1, 128)
    j = 3
    x[0, 0, j], x[0, 0, j + R // 2] = 1.0, 2.0
    cos, sin = rope_cos_sin(torch.tensor([pos]), rope_inv_freq(R, theta))
    y = apply_rope(x, cos, sin)[0, 0]
    phi = pos * theta ** (-2 * j / R)
    assert math.isclose(y[j].item(), math.cos(phi) - 2 * math.sin(phi), abs_tol=1e-6)
    assert math.isclose(y[j + R // 2].item(), 2 * math.cos(phi) + math.sin(phi), abs_tol=1e-6)
    assert math.isclose(y[j] ** 2 + y[j + R // 2] ** 2, 5.0, rel_tol=1e-6)
    others = torch.ones(128, dtype=torch.bool)
    others[[j, j + R // 2]] = False
    assert torch.equal(y[others], torch.zeros(126))


def test_bf16_input_returns_bf16():
    # docs/model.md §3 step 5: math in fp32, result cast to act
    x = torch.randn(2, 4, 128).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.tensor([3, 9]), rope_inv_freq(64, 5e6))
    assert apply_rope(x, cos, sin).dtype == torch.bfloat16
