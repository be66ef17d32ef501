"""RMSNorm cast order and the cross-head QK norm (docs/model.md §3 steps 1, 3; §5.3; §6)."""

from __future__ import annotations

import torch

from m2serve.model.norm import qk_norm, rms_norm


def _ident(x):
    return x


def test_rms_norm_hf_order_cast_then_gamma():
    # docs/model.md §5.3: y = (x.float() * rsqrt(mean(x²) + eps)).to(act) * γ, γ in act
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    gamma = (1 + torch.randn(64, generator=g)).to(torch.bfloat16)
    xf = x.float()
    want = gamma * (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    got = rms_norm(x, gamma, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    normed = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)
    wrong_order = (normed * gamma.float()).to(torch.bfloat16)
    assert not torch.equal(got, wrong_order)  # the cast order is observable in bf16


def test_qk_norm_is_one_rms_over_all_heads():
    # docs/model.md §6: scaling a token's whole q leaves it unchanged; changing head 0 changes head 5
    g = torch.Generator().manual_seed(2)
    heads, D = 6, 16
    q = torch.randn(3, heads * D, generator=g)
    gamma = 1 + 0.3 * torch.randn(heads * D, generator=g)
    y = qk_norm(q, gamma, 1e-6, heads * D, _ident)
    torch.testing.assert_close(qk_norm(3.7 * q, gamma, 1e-6, heads * D, _ident), y)
    q2 = q.clone()
    q2[:, :D] *= 5  # head 0 only
    y2 = qk_norm(q2, gamma, 1e-6, heads * D, _ident)
    assert not torch.allclose(y2[:, 5 * D:], y[:, 5 * D:])
    # a per-head norm (rejected qk_norm_type) gives different output
    per_head = torch.cat([rms_norm(q[:, h * D:(h + 1) * D], gamma[h * D:(h + 1) * D], 1e-6)
                          for h in range(heads)], dim=-1)
    assert not torch.allclose(per_head, y, atol=1e-3)
    # and the whole-width statistic equals an RMSNorm over the flattened vector
    torch.testing.assert_close(y, rms_norm(q, gamma, 1e-6))


def test_qk_norm_two_phase_with_global_count():
    # docs/parallelism.md §4: two ranks' local sums of squares, reduced, divided by the GLOBAL width
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8 * 16, generator=g)
    gamma = 1 + 0.3 * torch.randn(8 * 16, generator=g)
    full = qk_norm(q, gamma, 1e-6, 128, _ident)
    halves = (slice(0, 64), slice(64, 128))
    total = sum(q[:, s].pow(2).sum(-1, keepdim=True) for s in halves)
    parts = [qk_norm(q[:, s], gamma[s], 1e-6, 128, lambda _: total) for s in halves]
    torch.testing.assert_close(torch.cat(parts, dim=-1), full)
