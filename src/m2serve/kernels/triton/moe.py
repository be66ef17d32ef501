"""Fused MoE on the stored expert codes: align, w13 + SwiGLU, w2 + routing weight (docs/kernels.md §5).

Legend: T tokens, k top-k, R = T·k (token, slot) pairs (pair ``p`` is token ``p // k``, slot
``p % k``), H hidden, E_loc experts held here (global ids ``[start, start + E_loc)``: an EP rank's
set), I this rank's intermediate width (a TP slice), BM the block of pair rows a program takes,
``max_blocks = ceil(R / BM) + min(R, E_loc)`` (every held expert adds at most one partly filled
block), P = max_blocks · BM padded positions.

Three launches, none of whose grids depends on the routing (no host read of counts):

1. **align** (one program): counts the pairs of each local expert, rounds every count up to BM,
   and writes ``sorted_rows`` int32 [P] (expert ``e`` owns the positions ``[start_e, start_e +
   padded_e)``; its pairs fill the first ``count_e`` of them in pair order, a stable sort; the rest
   hold the sentinel R) and ``block_expert`` int32 [max_blocks] (the local expert of each block, -1
   past the last one). Pairs routed to experts not held here are left out.
2. **w13**: grid (max_blocks, ceil(I / BLOCK_N)); a program gathers its block's token rows, runs
   them through ``w1`` and ``w3`` of its expert (the weights decoded tile by tile in the kernel)
   and stores ``silu(x·w1ᵀ) ⊙ (x·w3ᵀ)`` (docs/model.md §3 step 11) into ``inter`` [P, I] (act dtype).
3. **w2**: grid (max_blocks, ceil(H / BLOCK_N)); ``inter · w2ᵀ`` times the pair's routing weight,
   stored fp32 into row ``pair`` of ``out`` [R, H] (zeros first: pairs not held here stay 0).

The top-k weighted sum is then ``out.view(T, k, H).sum(1)`` (fp32, as MiniMaxM2Experts.forward
returns it). Blocks whose expert is -1 return at once: their cost is a load and a branch.

Weights are kernels/ops.py :class:`PackedWeights` stacks (w1, w3 [E_loc, I, H] and w2 [E_loc, H, I]
as the experts hold them, model/experts.py), decoded in the kernel with the formulas of formats/
(docs/checkpoints.md §5-§6), each element in fp32 and then one cast to the COMPUTE dtype (the
dequantisers' one rounding): BF16 dense; FP8_BLOCK ``fp32(q) · s[n // 128, k // 128]``;
NVFP4 ModelOpt ``e2m1 · (fp32(s) · scale_2)``; NVFP4 compressed-tensors ``e2m1 · (fp32(s) /
global)`` (an IEEE division, ``div_rn``, as compressed-tensors computes it); MXFP4 ``e2m1 ·
2^(e - 127)``. Activations stay in their dtype (W4A16 / W8A16). Differences from the torch path
(grouped_mm): the gate and up products are not rounded to the act dtype before SwiGLU and the w2
product is weighted in fp32 before any rounding (both only more precise).

Launch: :func:`fused_moe`. Variants registered for the sm_90 compile test (aot.py): align per
E_PAD in :data:`ALIGN_EXPERT_PADS`; w13 and w2 per format, bf16 activations, BM 16 and 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m2serve.config.quant import FP8_BLOCK, MXFP4_GROUP, NVFP4_GROUP
from m2serve.kernels.ops import PackedWeights, WeightFormat
from m2serve.kernels.triton.aot import Variant, register
from m2serve.kernels.triton.runtime import compute_dtype

BLOCK_N = 64  # output columns per program
BLOCK_K = 64  # reduction step
DECODE_BLOCK_M, PREFILL_BLOCK_M = 16, 64  # BM 64 once the pairs average >= 64 per local expert
ALIGN_CHUNK = 64  # pairs / positions the align program handles per step
ALIGN_EXPERT_PADS = (32, 64, 128, 256)  # E_PAD (next power of two >= E_loc) of registered align variants



@triton.jit
def _align_kernel(ids, sorted_rows, block_expert, R, START, E_LOC, MAX_BLOCKS, BM,
                  E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    lane = tl.arange(0, CHUNK)
    ex = tl.arange(0, E_PAD)
    in_range = ex < E_LOC
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(0, tl.cdiv(R, CHUNK)):
        r = c * CHUNK + lane
        loc = tl.where(r < R, tl.load(ids + r, mask=r < R, other=0) - START, -1).to(tl.int32)
        hit = (loc[:, None] == ex[None, :]) & in_range[None, :]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)  # end position of each expert's run (inclusive prefix sum)
    starts = ends - padded
    block_ends = ends // BM
    for c in range(0, tl.cdiv(MAX_BLOCKS, CHUNK)):
        b = c * CHUNK + lane
        e_b = tl.sum((block_ends[None, :] <= b[:, None]).to(tl.int32), axis=1)  # experts ending by b
        tl.store(block_expert + b, tl.where(e_b < E_LOC, e_b, -1), mask=b < MAX_BLOCKS)
    # padding positions get the sentinel R (disjoint from the pair positions written below)
    for c in range(0, tl.cdiv(MAX_BLOCKS * BM, CHUNK)):
        p = c * CHUNK + lane
        e_p = tl.sum((ends[None, :] <= p[:, None]).to(tl.int32), axis=1)
        own = ex[None, :] == e_p[:, None]
        first = tl.sum(tl.where(own, starts[None, :], 0), axis=1)
        n = tl.sum(tl.where(own, counts[None, :], 0), axis=1)
        pad = (e_p >= E_LOC) | (p - first >= n)
        tl.store(sorted_rows + p, tl.zeros_like(p) + R, mask=pad & (p < MAX_BLOCKS * BM))
    seen = tl.zeros([E_PAD], dtype=tl.int32)  # pairs of each expert placed by earlier chunks
    for c in range(0, tl.cdiv(R, CHUNK)):
        r = c * CHUNK + lane
        loc = tl.where(r < R, tl.load(ids + r, mask=r < R, other=0) - START, -1).to(tl.int32)
        hit = (loc[:, None] == ex[None, :]) & in_range[None, :]
        held = tl.sum(hit.to(tl.int32), axis=1) > 0
        same_earlier = (loc[:, None] == loc[None, :]) & (lane[None, :] < lane[:, None])
        before = tl.sum(same_earlier.to(tl.int32), axis=1)  # earlier pairs of the chunk, same expert
        base = tl.sum(tl.where(hit, (starts + seen)[None, :], 0), axis=1)
        tl.store(sorted_rows + base + before, r, mask=held)
        seen += tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _e2m1(nib):
    """E2M1 code (int32 0..15) -> fp32: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa."""
    ex = (nib >> 1) & 3
    m = (nib & 1).to(tl.float32)
    mag = tl.where(ex == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(ex - 1, 0)).to(tl.float32))
    return tl.where((nib >> 3) == 1, -mag, mag)


@triton.jit
def _weight_tile(q, s, g, e, rn, rk, N, K, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sk,
                 stride_ge, stride_gn, FMT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                 COMPUTE: tl.constexpr):
    """Expert ``e``'s W[rn, rk] transposed: [len(rk), len(rn)] in COMPUTE (0 outside N x K)."""
    mask = (rk[:, None] < K) & (rn[None, :] < N)
    qe = q + e.to(tl.int64) * stride_qe
    se = s + e.to(tl.int64) * stride_se
    if FMT == 0:  # BF16 (dense)
        w = tl.load(qe + rn[None, :] * stride_qn + rk[:, None] * stride_qk, mask=mask, other=0.0)
        w = w.to(tl.float32)
    elif FMT == 1:  # FP8_BLOCK
        code = tl.load(qe + rn[None, :] * stride_qn + rk[:, None] * stride_qk, mask=mask, other=0.0)
        sc = tl.load(se + (rn[None, :] // GROUP_N) * stride_sn + (rk[:, None] // GROUP_K) * stride_sk,
                     mask=mask, other=0.0)
        w = code.to(tl.float32) * sc
    else:  # FP4: byte j of a row holds column 2j (low nibble) and 2j + 1 (high nibble)
        byte = tl.load(qe + rn[None, :] * stride_qn + (rk[:, None] // 2) * stride_qk, mask=mask, other=0)
        val = _e2m1((byte.to(tl.int32) >> ((rk[:, None] % 2) * 4)) & 15)
        s_ptr = se + rn[None, :] * stride_sn + (rk[:, None] // GROUP_K) * stride_sk
        if FMT == 4:  # MXFP4: E8M0 byte -> 2^(e - 127), exactly, through the fp32 exponent field
            eb = tl.load(s_ptr, mask=mask, other=127).to(tl.int32)
            pow2 = (eb << 23).to(tl.float32, bitcast=True)
            block = tl.where(eb == 0, 5.877471754111438e-39, pow2)  # code 0: 2^-127
        else:
            sc = tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32)
            g2 = tl.load(g + e.to(tl.int64) * stride_ge + rn * stride_gn, mask=rn < N, other=1.0)
            if FMT == 2:  # NVFP4 ModelOpt: weight_scale_2 multiplies
                block = sc * g2[None, :]
            else:  # NVFP4 compressed-tensors: weight_global_scale divides (IEEE division)
                block = tl.math.div_rn(sc, tl.broadcast_to(g2[None, :], sc.shape))
        w = val * block
    return w.to(COMPUTE)


@triton.jit
def _moe_w13_kernel(x, sorted_rows, block_expert, w1, w3, s1, s3, g1, g3, inter, R, H, I, TOP_K,
                    stride_xt, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sk,
                    stride_ge, stride_gn, stride_it, FMT: tl.constexpr, GROUP_N: tl.constexpr,
                    GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert + pid_m)
    if e < 0:
        return
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_rows + pos)
    valid = pair < R
    tok = (pair // TOP_K).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(H, BLOCK_K)):
        rk = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(x + tok[:, None] * stride_xt + rk[None, :], mask=valid[:, None] & (rk[None, :] < H),
                    other=0.0).to(COMPUTE)
        gate += tl.dot(a, _weight_tile(w1, s1, g1, e, rn, rk, I, H, stride_qe, stride_qn, stride_qk,
                                       stride_se, stride_sn, stride_sk, stride_ge, stride_gn, FMT, GROUP_N,
                                       GROUP_K, COMPUTE))
        up += tl.dot(a, _weight_tile(w3, s3, g3, e, rn, rk, I, H, stride_qe, stride_qn, stride_qk,
                                     stride_se, stride_sn, stride_sk, stride_ge, stride_gn, FMT, GROUP_N,
                                     GROUP_K, COMPUTE))
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    tl.store(inter + pos[:, None] * stride_it + rn[None, :], act.to(inter.dtype.element_ty),
             mask=valid[:, None] & (rn[None, :] < I))


@triton.jit
def _moe_w2_kernel(inter, sorted_rows, block_expert, topk_w, w2, s2, g2, out, R, H, I,
                   stride_it, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sk,
                   stride_ge, stride_gn, stride_ot, FMT: tl.constexpr, GROUP_N: tl.constexpr,
                   GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert + pid_m)
    if e < 0:
        return
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_rows + pos)
    valid = pair < R
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(I, BLOCK_K)):
        rk = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(inter + pos[:, None] * stride_it + rk[None, :], mask=valid[:, None] & (rk[None, :] < I),
                    other=0.0).to(COMPUTE)
        acc += tl.dot(a, _weight_tile(w2, s2, g2, e, rn, rk, H, I, stride_qe, stride_qn, stride_qk,
                                      stride_se, stride_sn, stride_sk, stride_ge, stride_gn, FMT, GROUP_N,
                                      GROUP_K, COMPUTE))
    wt = tl.load(topk_w + pair, mask=valid, other=0.0)
    tl.store(out + pair[:, None].to(tl.int64) * stride_ot + rn[None, :], acc * wt[:, None],
             mask=valid[:, None] & (rn[None, :] < H))


# ---- variants (aot.py): the types each format's launch passes, bf16 activations on a GPU --------------

# (codes, scale, scale_2) pointer types per format
_PTR = {WeightFormat.BF16: ("*bf16", "*fp32", "*fp32"),
        WeightFormat.FP8_BLOCK: ("*fp8e4nv", "*fp32", "*fp32"),
        WeightFormat.NVFP4_MODELOPT: ("*u8", "*fp8e4nv", "*fp32"),
        WeightFormat.NVFP4_CT: ("*u8", "*fp8e4nv", "*fp32"),
        WeightFormat.MXFP4: ("*u8", "*u8", "*fp32")}
# (GROUP_N, GROUP_K): the stored format's scale block (formats/, config/quant.py)
_GROUPS = {WeightFormat.BF16: (1, 1), WeightFormat.FP8_BLOCK: (FP8_BLOCK, FP8_BLOCK),
           WeightFormat.NVFP4_MODELOPT: (1, NVFP4_GROUP), WeightFormat.NVFP4_CT: (1, NVFP4_GROUP),
           WeightFormat.MXFP4: (1, MXFP4_GROUP)}
_STRIDES = ("stride_qe", "stride_qn", "stride_qk", "stride_se", "stride_sn", "stride_sk", "stride_ge",
            "stride_gn")
_CONSTS = ("FMT", "GROUP_N", "GROUP_K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "COMPUTE")

for _ep in ALIGN_EXPERT_PADS:
    register(Variant(f"moe_align/e{_ep}", _align_kernel,
                     {"ids": "*i64", "sorted_rows": "*i32", "block_expert": "*i32", "R": "i32",
                      "START": "i32", "E_LOC": "i32", "MAX_BLOCKS": "i32", "BM": "i32", "E_PAD": "constexpr",
                      "CHUNK": "constexpr"},
                     {"E_PAD": _ep, "CHUNK": ALIGN_CHUNK}, {"num_warps": 4}))

for _fmt, (_q, _s, _g) in _PTR.items():
    for _bm in (DECODE_BLOCK_M, PREFILL_BLOCK_M):
        _c = {"FMT": int(_fmt), "GROUP_N": _GROUPS[_fmt][0], "GROUP_K": _GROUPS[_fmt][1], "BLOCK_M": _bm,
              "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "COMPUTE": tl.bfloat16}
        register(Variant(f"moe_w13/{_fmt.name.lower()}/bf16/m{_bm}", _moe_w13_kernel, {
            "x": "*bf16", "sorted_rows": "*i32", "block_expert": "*i32", "w1": _q, "w3": _q, "s1": _s,
            "s3": _s, "g1": _g, "g3": _g, "inter": "*bf16", "R": "i32", "H": "i32", "I": "i32",
            "TOP_K": "i32", "stride_xt": "i32", **dict.fromkeys(_STRIDES, "i32"), "stride_it": "i32",
            **dict.fromkeys(_CONSTS, "constexpr")}, _c, {"num_warps": 4}))
        register(Variant(f"moe_w2/{_fmt.name.lower()}/bf16/m{_bm}", _moe_w2_kernel, {
            "inter": "*bf16", "sorted_rows": "*i32", "block_expert": "*i32", "topk_w": "*fp32", "w2": _q,
            "s2": _s, "g2": _g, "out": "*fp32", "R": "i32", "H": "i32", "I": "i32", "stride_it": "i32",
            **dict.fromkeys(_STRIDES, "i32"), "stride_ot": "i32", **dict.fromkeys(_CONSTS, "constexpr")},
            _c, {"num_warps": 4}))

# FP8 TP slices that split a 128-row band run on a finer grid (formats/fp8.py refine_fp8_grid): the
# expert shape I = 1,536 over 8 ranks gives 64-row blocks along I (w13's rows, w2's columns), decode only
_q, _s, _g = _PTR[WeightFormat.FP8_BLOCK]
_c = {"FMT": int(WeightFormat.FP8_BLOCK), "BLOCK_M": DECODE_BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K,
      "COMPUTE": tl.bfloat16}
_SPLIT = FP8_BLOCK // 2
register(Variant(f"moe_w13/fp8_block_n{_SPLIT}/bf16/m{DECODE_BLOCK_M}", _moe_w13_kernel, {
    "x": "*bf16", "sorted_rows": "*i32", "block_expert": "*i32", "w1": _q, "w3": _q, "s1": _s,
    "s3": _s, "g1": _g, "g3": _g, "inter": "*bf16", "R": "i32", "H": "i32", "I": "i32",
    "TOP_K": "i32", "stride_xt": "i32", **dict.fromkeys(_STRIDES, "i32"), "stride_it": "i32",
    **dict.fromkeys(_CONSTS, "constexpr")}, {**_c, "GROUP_N": _SPLIT, "GROUP_K": FP8_BLOCK},
    {"num_warps": 4}))
register(Variant(f"moe_w2/fp8_block_k{_SPLIT}/bf16/m{DECODE_BLOCK_M}", _moe_w2_kernel, {
    "inter": "*bf16", "sorted_rows": "*i32", "block_expert": "*i32", "topk_w": "*fp32", "w2": _q,
    "s2": _s, "g2": _g, "out": "*fp32", "R": "i32", "H": "i32", "I": "i32", "stride_it": "i32",
    **dict.fromkeys(_STRIDES, "i32"), "stride_ot": "i32", **dict.fromkeys(_CONSTS, "constexpr")},
    {**_c, "GROUP_N": FP8_BLOCK, "GROUP_K": _SPLIT}, {"num_warps": 4}))


# ---- launcher ---------------------------------------------------------------------------------------------

def _operands(w: PackedWeights, name: str, dummy: torch.Tensor) -> tuple[list, list[int]]:
    """(codes, scale, scale_2) tensors and their 8 strides (e, n, k of the codes and of the scale;
    e, n of scale_2: 0 where a tensor is absent or one value per expert)."""
    q = w.q
    if q.dim() != 3:
        raise ValueError(f"{name}: stacked expert weights must be [E, N, K], found {list(q.shape)}")
    s = w.scale if w.scale is not None else dummy
    g = w.scale_2 if w.scale_2 is not None else dummy
    s_str = list(s.stride()) if w.scale is not None else [0, 0, 0]
    if w.scale_2 is None:
        g_str = [0, 0]
    elif g.dim() == 1:
        g_str = [g.stride(0), 0]
    else:
        g_str = [g.stride(0), g.stride(1)]
    return [q, s, g], [*q.stride(), *s_str, *g_str]


def _check(w: PackedWeights, name: str, fmt: WeightFormat, experts: int, n: int, k: int) -> None:
    if w.fmt is not fmt:
        raise ValueError(f"{name}: format {w.fmt.name} differs from w1's {fmt.name}")
    if (w.num_experts, w.out_features, w.in_features) != (experts, n, k):
        raise ValueError(f"{name}: [{w.num_experts}, {w.out_features}, {w.in_features}] where "
                         f"[{experts}, {n}, {k}] is expected")
    if fmt is WeightFormat.FP8_BLOCK:  # 128 x 128, or a finer grid of a split band (formats/fp8.py)
        if FP8_BLOCK % w.block_n or FP8_BLOCK % w.block_k:
            raise ValueError(f"{name}: FP8 blocks ({w.block_n}, {w.block_k}) do not divide {FP8_BLOCK}")
    elif (w.block_n, w.block_k) != _GROUPS[fmt] and fmt is not WeightFormat.BF16:
        raise ValueError(f"{name}: {fmt.name} blocks ({w.block_n}, {w.block_k}), the kernel decodes "
                         f"{_GROUPS[fmt]}")


def fused_moe(h: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, w1: PackedWeights,
              w3: PackedWeights, w2: PackedWeights, start: int = 0) -> torch.Tensor:
    """The experts' block (docs/model.md §3 step 11) on the stored codes, in three launches.

    h [T, H] act (bf16 on a GPU; fp32 too), ids [T, k] int64 global expert ids, topk_weights [T, k]
    f32; w1 / w3 :class:`PackedWeights` [E_loc, I, H] (gate / up rows of this rank's I slice), w2
    [E_loc, H, I], one format (BF16 dense codes of any float dtype, FP8_BLOCK, NVFP4_MODELOPT,
    NVFP4_CT, MXFP4; FP8 on its 128 x 128 grid or, for a TP slice that splits a band, the finer grid
    of formats/fp8.py ``refine_fp8_grid``, block sizes dividing 128, decoded per launch);
    ``start``: global id of local expert 0 (EP). Returns [T, H] f32: ``Σ_slots
    w_slot · expert(h)`` over the slots whose expert is held here (others add 0), as
    MiniMaxM2Experts.forward. Raises ValueError naming the weight and the mismatch for mixed
    formats, shapes that do not fit h or each other, or blocks the kernel does not decode, and for
    an E_loc beyond the largest registered align width.
    """
    fmt = w1.fmt
    E, I = w1.num_experts, w1.out_features
    T, H = h.shape
    if w1.in_features != H:
        raise ValueError(f"w1: in_features {w1.in_features} does not match hidden size {H}")
    _check(w1, "w1", fmt, E, I, H)
    _check(w3, "w3", fmt, E, I, H)
    _check(w2, "w2", fmt, E, H, I)
    if (w1.block_n, w1.block_k) != (w3.block_n, w3.block_k):
        raise ValueError(f"w3: blocks ({w3.block_n}, {w3.block_k}) differ from w1's "
                         f"({w1.block_n}, {w1.block_k})")
    if ids.shape != topk_weights.shape or ids.shape[0] != T:
        raise ValueError(f"ids {list(ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
                         f"[T={T}, k]")
    if (w1.q.stride(), getattr(w1.scale, "stride", tuple)()) != (w3.q.stride(),
                                                                 getattr(w3.scale, "stride", tuple)()):
        raise ValueError("w1 and w3 must share strides (both views of one w13, or both contiguous)")
    k = ids.shape[1]
    R = T * k
    bm = PREFILL_BLOCK_M if R >= PREFILL_BLOCK_M * E else DECODE_BLOCK_M
    sorted_rows, block_expert = align_blocks(ids, E, start, bm)
    max_blocks = block_expert.numel()
    dev = h.device
    x = h.contiguous()
    flat_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    dummy = torch.ones(1, dtype=torch.float32, device=dev)
    (q1, s1, g1), strides13 = _operands(w1, "w1", dummy)
    (q3, s3, g3), _ = _operands(w3, "w3", dummy)
    (q2, s2, g2), strides2 = _operands(w2, "w2", dummy)
    consts = {"FMT": int(fmt), "GROUP_N": _GROUPS[fmt][0], "GROUP_K": _GROUPS[fmt][1], "BLOCK_M": bm,
              "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "COMPUTE": compute_dtype(h.dtype)}
    fp8 = fmt is WeightFormat.FP8_BLOCK  # each launch decodes its weights' own grid
    c13 = {**consts, "GROUP_N": w1.block_n, "GROUP_K": w1.block_k} if fp8 else consts
    c2 = {**consts, "GROUP_N": w2.block_n, "GROUP_K": w2.block_k} if fp8 else consts
    inter = torch.empty(max_blocks * bm, I, dtype=h.dtype, device=dev)
    _moe_w13_kernel[(max_blocks, triton.cdiv(I, BLOCK_N))](
        x, sorted_rows, block_expert, q1, q3, s1, s3, g1, g3, inter, R, H, I, k, x.stride(0), *strides13,
        inter.stride(0), **c13, num_warps=4)
    out = torch.zeros(R, H, dtype=torch.float32, device=dev)
    _moe_w2_kernel[(max_blocks, triton.cdiv(H, BLOCK_N))](
        inter, sorted_rows, block_expert, flat_w, q2, s2, g2, out, R, H, I, inter.stride(0), *strides2,
        out.stride(0), **c2, num_warps=4)
    return out.view(T, k, H).sum(1)


def align_blocks(ids: torch.Tensor, num_local: int, start: int = 0,
                 block_m: int = DECODE_BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The align launch alone (what :func:`fused_moe` runs first): ids [R] int64 global ids ->
    (sorted_rows int32 [max_blocks · block_m], block_expert int32 [max_blocks]) as the module
    docstring defines them. Raises ValueError for ``num_local`` beyond the registered widths."""
    if num_local > ALIGN_EXPERT_PADS[-1]:
        raise ValueError(f"{num_local} local experts: the align kernel is registered up to "
                         f"{ALIGN_EXPERT_PADS[-1]}")
    R = ids.numel()
    max_blocks = triton.cdiv(R, block_m) + min(R, num_local)
    sorted_rows = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    e_pad = next(p for p in ALIGN_EXPERT_PADS if p >= num_local)
    _align_kernel[(1,)](ids.reshape(-1).to(torch.int64).contiguous(), sorted_rows, block_expert, R, start,
                        num_local, max_blocks, block_m, E_PAD=e_pad, CHUNK=ALIGN_CHUNK, num_warps=4)
    return sorted_rows, block_expert
