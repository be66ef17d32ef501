"""fp32 sigmoid router with selection-only bias (docs/model.md §3 step 10, §5.1, §6)."""

from __future__ import annotations

import torch

from m2serve.model.router import route


def _setup(seed=0, T=16, H=32, E=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) / H ** 0.5


def test_weights_are_renormalised_unbiased_sigmoids():
    # docs/model.md §3 step 10: ids = topk(s + b); w = s[ids] / Σ s[ids]
    h, gate = _setup()
    bias = 0.05 * torch.randn(8, generator=torch.Generator().manual_seed(9))
    w, ids = route(h, gate, bias, 2)
    s = torch.sigmoid(h @ gate.T)
    for t in range(h.shape[0]):
        want_ids = set(torch.topk(s[t] + bias, 2).indices.tolist())
        assert set(ids[t].tolist()) == want_ids
        sel = s[t, ids[t]]
        torch.testing.assert_close(w[t], sel / sel.sum())
    torch.testing.assert_close(w.sum(-1), torch.ones(h.shape[0]))
    assert w.dtype == torch.float32


def test_large_bias_forces_expert_but_weight_stays_unbiased():
    # docs/model.md §6: a large bias on expert j forces it into the top-k; its weight is its
    # unbiased sigmoid share
    h, gate = _setup(1)
    _, ids0 = route(h, gate, torch.zeros(8), 2)
    j = 5
    assert not bool((ids0 == j).any(-1).all())  # j is not already everyone's choice
    bias = torch.zeros(8)
    bias[j] = 100.0
    w, ids = route(h, gate, bias, 2)
    assert bool((ids == j).any(-1).all())
    s = torch.sigmoid(h @ gate.T)
    sel = s.gather(1, ids)
    torch.testing.assert_close(w, sel / sel.sum(-1, keepdim=True))
    assert not torch.equal(ids.sort(-1).values, ids0.sort(-1).values)


def test_equal_bias_changes_nothing():
    # docs/model.md §6: a bias equal on all experts changes nothing
    h, gate = _setup(2)
    w0, ids0 = route(h, gate, torch.zeros(8), 3)
    w1, ids1 = route(h, gate, torch.full((8,), 0.7), 3)
    assert torch.equal(ids0.sort(-1).values, ids1.sort(-1).values)
    torch.testing.assert_close(w0.sort(-1).values, w1.sort(-1).values)


def test_router_runs_in_fp32_on_bf16_input():
    # docs/model.md §5.1: logits = h.float() @ W_gᵀ with W_g fp32
    h, gate = _setup(3)
    hb = h.to(torch.bfloat16)
    w, ids = route(hb, gate, None, 2)
    s = torch.sigmoid(hb.float() @ gate.T)
    sel = s.gather(1, ids)
    torch.testing.assert_close(w, sel / sel.sum(-1, keepdim=True))
    assert set(map(tuple, ids.sort(-1).values.tolist())) == set(
        map(tuple, torch.topk(s, 2).indices.sort(-1).values.tolist()))
