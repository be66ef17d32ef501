"""The fused MoE Triton kernels (docs/kernels.md §5) under Triton's interpreter, fp32 compute, against
an independent torch reference: each stored format dequantised by formats/ (the bit-exact
dequantisers), then every (token, slot) pair through its expert one by one (``silu(x·w1ᵀ) ⊙ (x·w3ᵀ)
· w2ᵀ`` times the routing weight, summed over the slots). Ragged expert loads, experts with no
tokens, one token, top-8 of 256, TP slices of the intermediate width and EP expert sets.
The sm_90 compile of every variant is tests/kernels/test_triton_compile.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m2serve.formats.fp4 import FP4Scheme, PackedFP4
from m2serve.formats.fp8 import PackedFP8, quantize_fp8_block
from m2serve.kernels.ops import PackedWeights
from m2serve.kernels.triton.moe import align_blocks, fused_moe

FORMATS = ("bf16", "fp8_block", "nvfp4_modelopt", "nvfp4_ct", "mxfp4")


def _one(fmt: str, n: int, k: int, g: torch.Generator):
    """One random [n, k] weight as stored in ``fmt`` (bf16 tensor / PackedFP8 / PackedFP4) and its fp32
    dequantisation by formats/."""
    if fmt == "bf16":
        w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
        return w, w.float()
    if fmt == "fp8_block":
        q, s = quantize_fp8_block(torch.randn(n, k, generator=g) / k ** 0.5)
        s = s * (1 + torch.rand(s.shape, generator=g))  # scales that are not amax / 448 exactly
        p = PackedFP8(q, s)
        return p, p.dequantize(torch.float32)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    if fmt == "mxfp4":
        scale = torch.randint(118, 126, (n, k // 32), generator=g, dtype=torch.uint8)
        scale[0, 0] = 0  # the subnormal 2^-127
        p = PackedFP4(FP4Scheme.MXFP4, packed, scale)
    else:
        scale = (torch.rand(n, k // 16, generator=g) * 0.4 + 0.05).to(torch.float8_e4m3fn)
        s2 = torch.rand((), generator=g) * 0.5 + 0.25
        if fmt == "nvfp4_ct":  # the global scale divides: 1 / s2 in fp32 is rarely exact
            p = PackedFP4(FP4Scheme.NVFP4_CT, packed, scale, (1.0 / s2).float())
        else:
            p = PackedFP4(FP4Scheme.NVFP4_MODELOPT, packed, scale, s2.float())
    return p, p.dequantize(torch.float32)


def _experts(fmt: str, E: int, H: int, I: int, seed: int = 0):
    """(w1, w3, w2 as PackedWeights stacks, and their fp32 dequantisations [E, N, K])."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((I, H), (I, H), (H, I)):
        pairs = [_one(fmt, n, k, g) for _ in range(E)]
        out.append((PackedWeights.stack([p for p, _ in pairs]), torch.stack([d for _, d in pairs])))
    return out


def _reference(h, ids, tw, dense, start=0):
    """Pair by pair in fp32: Σ_slots w · w2[e]·(silu(w1[e]·x) ⊙ w3[e]·x) over the slots held here."""
    (_, w1), (_, w3), (_, w2) = dense
    T, k = ids.shape
    out = torch.zeros(T, h.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j]) - start
            if 0 <= e < w1.shape[0]:
                x = h[t].double()
                y = (F.silu(w1[e].double() @ x) * (w3[e].double() @ x)) @ w2[e].double().T
                out[t] += float(tw[t, j]) * y
    return out


def _run(h, ids, tw, ws, start=0):
    (w1, _), (w3, _), (w2, _) = ws
    return fused_moe(h, ids, tw, w1, w3, w2, start)


def _route(T, k, E, seed, skip=()):
    """Ragged top-k ids (distinct per token) over E experts, never choosing the experts in ``skip``."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(E) if e not in skip])
    prefer = torch.rand(len(pool), generator=g) ** 3  # a few heavy experts, many light ones
    ids = torch.stack([pool[torch.multinomial(prefer, k, generator=g)] for _ in range(T)])
    tw = torch.rand(T, k, generator=g)
    return ids.to(torch.int64), tw / tw.sum(1, keepdim=True)


def _close(y, ref):
    ref = ref.float()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y - ref).abs().max().item()
    assert err <= 2e-5 * max(1.0, ref.abs().max().item()), err


def test_align_sorts_pairs_by_expert_stably_and_pads_each_run_to_the_block():
    E, start, bm = 6, 2, 4
    # 0 and 9 are other ranks' experts; local 2 and 4 (global 4, 6) get no pair
    ids = torch.tensor([3, 7, 3, 0, 5, 3, 2, 9, 5, 3, 3, 7], dtype=torch.int64)
    sorted_rows, block_expert = align_blocks(ids, E, start, bm)
    R = ids.numel()
    # hand-derived: local experts 0..5 are global 2..7
    runs = {e: [p for p in range(R) if int(ids[p]) - start == e] for e in range(E)}
    want_rows, want_blocks = [], []
    for e in range(E):
        n_blocks = -(-len(runs[e]) // bm)
        want_rows += runs[e] + [R] * (n_blocks * bm - len(runs[e]))
        want_blocks += [e] * n_blocks
    max_blocks = -(-R // bm) + min(R, E)
    assert len(block_expert) == max_blocks
    assert block_expert.tolist() == want_blocks + [-1] * (max_blocks - len(want_blocks))
    assert sorted_rows.tolist() == want_rows + [R] * (max_blocks * bm - len(want_rows))


def test_align_chunks_many_pairs_across_256_experts():
    ids = _route(40, 8, 256, seed=3)[0].reshape(-1)  # 320 pairs: five chunks of the align loop
    sorted_rows, block_expert = align_blocks(ids, 256, 0, 16)
    R = ids.numel()
    order = torch.argsort(ids, stable=True)
    got = sorted_rows[sorted_rows < R]
    assert got.tolist() == order.tolist()
    want = [e for e in sorted(set(ids.tolist())) for _ in range(-(-int((ids == e).sum()) // 16))]
    assert block_expert[block_expert >= 0].tolist() == want
    assert (block_expert[len(want):] == -1).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_ragged_loads_and_empty_experts_match_the_dequantised_reference(fmt):
    E, H, I, T, k = 8, 64, 32, 7, 3
    ws = _experts(fmt, E, H, I, seed=1)
    ids, tw = _route(T, k, E, seed=2, skip=(2, 5))
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    _close(_run(h, ids, tw, ws), _reference(h, ids, tw, ws))


@pytest.mark.parametrize("fmt", FORMATS)
def test_top8_of_256_experts(fmt):
    E, H, I, T, k = 256, 32, 32, 3, 8
    ws = _experts(fmt, E, H, I, seed=5)
    ids, tw = _route(T, k, E, seed=6)
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    _close(_run(h, ids, tw, ws), _reference(h, ids, tw, ws))


@pytest.mark.parametrize("fmt", ("bf16", "nvfp4_ct"))
def test_one_token(fmt):
    E, H, I = 16, 64, 64
    ws = _experts(fmt, E, H, I, seed=8)
    ids, tw = _route(1, 8, E, seed=9)
    h = torch.randn(1, H, generator=torch.Generator().manual_seed(10))
    _close(_run(h, ids, tw, ws), _reference(h, ids, tw, ws))


def test_prefill_block_of_64_rows():
    # R >= 64 · E_loc pairs: the launcher takes BLOCK_M 64
    E, H, I, T, k = 2, 32, 32, 64, 2
    ws = _experts("mxfp4", E, H, I, seed=11)
    ids, tw = _route(T, k, E, seed=12)
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(13))
    _close(_run(h, ids, tw, ws), _reference(h, ids, tw, ws))


def _slice(ws, lo, hi):
    """Experts' TP slice of the intermediate width [lo, hi): rows of w1 / w3, columns of w2, as stored."""
    (w1, d1), (w3, d3), (w2, d2) = ws

    def rows(w: PackedWeights):
        s = None if w.scale is None else w.scale[:, lo // w.block_n: -(-hi // w.block_n)]
        s2 = w.scale_2 if w.scale_2 is None or w.scale_2.dim() == 1 else w.scale_2[:, lo:hi]
        return PackedWeights(w.fmt, w.q[:, lo:hi], s, s2, w.block_n, w.block_k)

    def cols(w: PackedWeights):
        packed = w.q.dtype == torch.uint8
        q = w.q[:, :, lo // 2: hi // 2] if packed else w.q[:, :, lo:hi]
        s = None if w.scale is None else w.scale[:, :, lo // w.block_k: -(-hi // w.block_k)]
        return PackedWeights(w.fmt, q, s, w.scale_2, w.block_n, w.block_k)

    return [(rows(w1), d1[:, lo:hi]), (rows(w3), d3[:, lo:hi]), (cols(w2), d2[:, :, lo:hi])]


@pytest.mark.parametrize("fmt,I", [("fp8_block", 256), ("nvfp4_modelopt", 64), ("mxfp4", 64)])
def test_tp_slices_of_the_intermediate_width_sum_to_the_whole(fmt, I):
    E, H, T, k = 4, 32, 5, 2
    ws = _experts(fmt, E, H, I, seed=14)
    ids, tw = _route(T, k, E, seed=15)
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(16))
    parts = []
    for lo in (0, I // 2):  # TP 2: each rank holds half of I
        part = _slice(ws, lo, lo + I // 2)
        y = _run(h, ids, tw, part)
        _close(y, _reference(h, ids, tw, part))
        parts.append(y)
    _close(parts[0] + parts[1], _reference(h, ids, tw, ws))


@pytest.mark.parametrize("fmt", ("fp8_block", "nvfp4_ct", "mxfp4"))
def test_ep_ranks_hold_expert_ranges_and_leave_the_others_at_zero(fmt):
    E, H, I, T, k, ranks = 16, 32, 32, 6, 4, 2
    full = _experts(fmt, E, H, I, seed=17)
    ids, tw = _route(T, k, E, seed=18)
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(19))
    n = E // ranks
    total = torch.zeros(T, H)
    for r in range(ranks):
        part = slice(r * n, (r + 1) * n)
        local = [(PackedWeights(w.fmt, w.q[part], None if w.scale is None else w.scale[part],
                                None if w.scale_2 is None else w.scale_2[part], w.block_n, w.block_k),
                  d[part]) for w, d in full]
        y = _run(h, ids, tw, local, start=r * n)
        _close(y, _reference(h, ids, tw, local, start=r * n))
        total += y
    _close(total, _reference(h, ids, tw, full))


def test_bf16_activations_within_bf16_rounding():
    # the interpreter truncates bf16 stores (docs/kernels.md §1): judged to bf16 precision only
    E, H, I, T, k = 8, 64, 32, 4, 2
    ws = _experts("mxfp4", E, H, I, seed=20)
    ids, tw = _route(T, k, E, seed=21)
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(22)).bfloat16()
    ref = _reference(h.float(), ids, tw, ws).float()
    y = _run(h, ids, tw, ws)
    assert y.dtype == torch.float32
    assert (y - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_bad_shapes_and_mixed_formats_are_refused_by_name():
    ws = _experts("fp8_block", 2, 32, 32)
    mx = _experts("mxfp4", 2, 32, 32)
    h, ids, tw = torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(ValueError, match="w3: format MXFP4 differs from w1's FP8_BLOCK"):
        fused_moe(h, ids, tw, ws[0][0], mx[1][0], ws[2][0])
    with pytest.raises(ValueError, match="w1: in_features 32 does not match hidden size 64"):
        fused_moe(torch.randn(2, 64), ids, tw, ws[0][0], ws[1][0], ws[2][0])
    with pytest.raises(ValueError, match=r"ids \[2, 1\] and topk_weights \[2, 2\]"):
        fused_moe(h, ids, torch.ones(2, 2), ws[0][0], ws[1][0], ws[2][0])
    with pytest.raises(ValueError, match="300 local experts"):
        align_blocks(ids.reshape(-1), 300)


@pytest.mark.parametrize("fmt,I", [("fp8_block", 128), ("nvfp4_modelopt", 32), ("mxfp4", 32)])
def test_experts_given_the_triton_choice_run_the_fused_moe(fmt, I):
    # the per-module choice's Triton slot for experts (kernels/choice.py): forward and the EP rows
    # path through fused_moe on the module's stored buffers, against its torch reference path
    from m2serve.kernels.choice import KernelChoice, LinearImpl
    from m2serve.model.experts import MiniMaxM2Experts

    E, H, start, T, k = 4, 64, 4, 5, 3
    g = torch.Generator().manual_seed(23)
    m = MiniMaxM2Experts(H, I, start, E, dtype=torch.float32)
    for e in range(E):
        for which, (n, kk) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            m.load_expert(start + e, which, _one(fmt, n, kk, g)[0])
    m.pack_for_kernels()
    ids, tw = _route(T, k, 2 * E, seed=24)  # global ids 0..7: half held here
    h = torch.randn(T, H, generator=g)
    ref, ref_rows = m.forward_loop(h, ids, tw), m.rows_loop(h, ids[:, 0].clamp(0, E - 1))
    m.set_choice(KernelChoice(LinearImpl.TRITON, None, "triton-moe"))
    launcher, stacks = m._fused
    assert launcher is fused_moe
    calls = []
    m._fused = (lambda *a: calls.append(1) or launcher(*a), stacks)
    _close(m(h, ids, tw), ref)
    _close(m.rows(h, ids[:, 0].clamp(0, E - 1)), ref_rows)
    assert len(calls) == 2


def test_fp8_tp_slice_that_splits_a_band_runs_on_the_finer_grid():
    # issue 30: rank 1 of TP 2 over I = 384 holds rows [192, 384) of w1 / w3 and columns [192, 384) of
    # w2, 64 into a 128-wide band (docs/checkpoints.md §6): the module's kernel stacks carry the finer
    # 64-wide grid and the fused MoE decodes it; against the same slices of the whole weights'
    # dequantisation (formats/fp8.py) and a pair-by-pair fp32 loop
    from m2serve.kernels.choice import KernelChoice, LinearImpl
    from m2serve.model.experts import MiniMaxM2Experts

    E, H, I, lo, T, k = 3, 64, 384, 192, 6, 2
    g = torch.Generator().manual_seed(31)
    m = MiniMaxM2Experts(H, I - lo, 0, E, dtype=torch.float32)
    dense: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
    for e in range(E):
        for which, (n, kk) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            full, d = _one("fp8_block", n, kk, g)
            if which == "w2":
                part = PackedFP8(full.q[:, lo:], full.scale[:, lo // 128:], which, 0, lo % 128)
                dense[which].append(d[:, lo:])
            else:
                part = PackedFP8(full.q[lo:], full.scale[lo // 128:], which, lo % 128, 0)
                dense[which].append(d[lo:])
            m.load_expert(e, which, part)
    m.pack_for_kernels()
    w13, w2 = m.kernel_weights
    assert (w13.block_n, w13.block_k, w2.block_n, w2.block_k) == (64, 128, 128, 64)
    ids, tw = _route(T, k, E, seed=32)
    h = torch.randn(T, H, generator=g)
    ref = _reference(h, ids, tw, [(None, torch.stack(dense[w])) for w in ("w1", "w3", "w2")])
    _close(m.forward_loop(h, ids, tw), ref)  # the module's torch reference (offset dequantisation)
    m.set_choice(KernelChoice(LinearImpl.TRITON, None, "triton-moe"))
    _close(m(h, ids, tw), ref)
