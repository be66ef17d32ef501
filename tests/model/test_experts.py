"""Grouped SwiGLU experts (spec/model.md §3 step 11, §5.2; issue 2 'must show')."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from m2serve.model import experts as experts_mod
from m2serve.model.experts import MiniMaxM2Experts
from m2serve.model.router import route

H, I, E, K = 32, 24, 8, 2


def _experts(start=0, num=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1, w3, w2 = (torch.randn(E, I, H, generator=g) / H ** 0.5, torch.randn(E, I, H, generator=g) / H ** 0.5,
                  torch.randn(E, H, I, generator=g) / I ** 0.5)
    m = MiniMaxM2Experts(H, I, start, num)
    for e in range(start, start + num):
        m.load_expert(e, "w1", w1[e])
        m.load_expert(e, "w3", w3[e])
        m.load_expert(e, "w2", w2[e])
    return m, (w1, w3, w2)


def _reference(h, ids, w, ws):
    # per-token, per-slot formula of model.md §3 step 11: Σ w_slot · W2 (silu(W1 h) ⊙ W3 h), fp32
    w1, w3, w2 = ws
    out = torch.zeros(h.shape[0], H)
    for t in range(h.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            out[t] += w[t, s] * (w2[e] @ (F.silu(w1[e] @ h[t]) * (w3[e] @ h[t])))
    return out


def test_grouped_experts_match_per_token_formula():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(12, H, generator=g)
    w, ids = route(h, torch.randn(E, H, generator=g), None, K)
    m, ws = _experts()
    out = m(h, ids, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(h, ids, w, ws), rtol=1e-5, atol=1e-5)


def test_loop_reference_matmul_count_equals_distinct_chosen_experts(monkeypatch):
    # issue 2 must-show, now of the loop reference (forward_loop; issue 17 made the forward grouped):
    # one expert_ffn (one matmul set) per ACTIVE expert, counted
    calls = []
    real = experts_mod.expert_ffn

    def counting(x, w13, w2):
        calls.append(x.shape[0])
        return real(x, w13, w2)

    monkeypatch.setattr(experts_mod, "expert_ffn", counting)
    m, _ = _experts()
    h = torch.randn(3, H)
    ids = torch.tensor([[1, 6], [6, 1], [3, 1]])  # 3 distinct of 8 experts
    m.forward_loop(h, ids, torch.full((3, 2), 0.5))
    assert len(calls) == 3 and sorted(calls) == [1, 2, 3]
    calls.clear()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(20, H, generator=g)
    w, ids = route(h, torch.randn(E, H, generator=g), None, K)
    m.forward_loop(h, ids, w)
    assert len(calls) == len(set(ids.flatten().tolist())) and sum(calls) == 20 * K


def test_expert_range_partial_sums_add_up():
    # serving.md §1 EP: two ranks holding experts [0, 4) and [4, 8) sum to the full output
    g = torch.Generator().manual_seed(5)
    h = torch.randn(10, H, generator=g)
    w, ids = route(h, torch.randn(E, H, generator=g), None, K)
    full, _ = _experts()
    lo, _ = _experts(0, 4)
    hi, _ = _experts(4, 4)
    torch.testing.assert_close(lo(h, ids, w) + hi(h, ids, w), full(h, ids, w))
