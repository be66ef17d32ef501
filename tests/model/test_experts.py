"""Grouped SwiGLU experts (docs/model.md §3 step 11, §5.2; issue 2 'must show')."""

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
    # per-token, per-slot formula of docs/model.md §3 step 11: Σ w_slot · W2 (silu(W1 h) ⊙ W3 h), fp32
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
    # docs/parallelism.md §1 EP: two ranks holding experts [0, 4) and [4, 8) sum to the full output
    g = torch.Generator().manual_seed(5)
    h = torch.randn(10, H, generator=g)
    w, ids = route(h, torch.randn(E, H, generator=g), None, K)
    full, _ = _experts()
    lo, _ = _experts(0, 4)
    hi, _ = _experts(4, 4)
    torch.testing.assert_close(lo(h, ids, w) + hi(h, ids, w), full(h, ids, w))


def _dense_ids(T, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g)
    w, ids = route(h, torch.randn(E, H, generator=g), None, K)
    return h, ids, w


def test_grouped_forward_equals_loop_reference_bitwise_fp32_and_bf16():
    # issue 17 item 1: one grouped_mm pair for all experts = the per-active-expert loop, for the
    # full range and for partial ranges (slots of other ranks' experts sorted past offsets[-1],
    # weight 0); measured max |diff| 0 in fp32 and in bf16 on this CPU
    h, ids, w = _dense_ids(37, 8)
    for start, num in ((0, E), (0, 4), (4, 4), (6, 2)):
        m, _ = _experts(start, num)
        assert torch.equal(m(h, ids, w), m.forward_loop(h, ids, w))
        mb = m.to(torch.bfloat16)
        torch.testing.assert_close(mb(h.bfloat16(), ids, w), mb.forward_loop(h.bfloat16(), ids, w),
                                   rtol=0, atol=0)


def test_loop_fallback_and_ep_receiver_rows_equal_grouped(monkeypatch):
    # the fallback where grouped_mm does not run (has_grouped_mm False) and the EP receiving side
    # (rows(x, local ids)) give the loop reference's values
    m, _ = _experts()
    h, ids, w = _dense_ids(19, 9)
    grouped = m(h, ids, w)
    local = ids.reshape(-1)
    x = h.repeat_interleave(K, dim=0)
    assert torch.equal(m.rows(x, local), m.rows_loop(x, local))
    monkeypatch.setattr(experts_mod, "has_grouped_mm", lambda dtype, device: False)
    assert torch.equal(m(h, ids, w), grouped)


def test_expert_offsets_are_run_ends_with_not_held_last():
    # key = local expert id, E_loc = "held elsewhere": int32 ends of each expert's sorted run
    key = torch.tensor([2, 0, 4, 2, 2, 1, 4])
    offs = experts_mod.expert_offsets(key, 4)
    assert offs.dtype == torch.int32 and offs.tolist() == [1, 2, 5, 5]


def test_dense_bf16_experts_run_the_cpu_kernels_on_their_parameters(monkeypatch):
    # issue 32: dense bf16 experts on the CPU take the kernels' GEMV (each active expert's weights
    # read once per step) over their own parameters (no copy) instead of one grouped_mm GEMM per
    # expert; values within bf16 rounding of the fp32 per-token formula on the same (bf16) weights
    from m2serve.kernels.build import kernel_backend
    from m2serve.kernels.ops import WeightFormat
    from m2serve.model.kernel_choice import choose_kernels

    backend = kernel_backend()
    assert backend.available, backend.banner()  # this machine and CI build the kernels
    m, _ = _experts()
    mb = m.to(torch.bfloat16)
    mb.pack_for_kernels()
    w13, w2 = mb.kernel_weights
    assert (w13.fmt, w2.fmt) == (WeightFormat.BF16, WeightFormat.BF16)
    assert w13.q.data_ptr() == mb.w13.data_ptr() and w2.q.data_ptr() == mb.w2.data_ptr()
    assert choose_kernels(mb).counts == {("experts", "BF16", backend.name): 1}
    calls = []
    real = experts_mod.cpu_grouped_expert_ffn
    monkeypatch.setattr(experts_mod, "cpu_grouped_expert_ffn", lambda *a: calls.append(1) or real(*a))
    h, ids, w = _dense_ids(21, 10)
    hb = h.bfloat16()
    out = mb(hb, ids, w)
    assert calls == [1]
    ws = (mb.w13[:, :I].float(), mb.w13[:, I:].float(), mb.w2.float())
    ref = _reference(hb.float(), ids, w, ws)
    # gate/up, SwiGLU and w2 outputs each rounded once to bf16 (2^-8 relative): a few bf16 ulps of
    # the largest |ref| covers them; the fp32 model's outputs are O(1) here
    assert (out - ref).abs().max() <= 4 * 2**-8 * ref.abs().max()
    m32, _ = _experts()
    m32.pack_for_kernels()
    assert m32.kernel_weights is None  # fp32 dense experts stay on grouped_mm
