"""Paged attention in Triton: decode rows and prefill chunks of any lengths in one launch
(docs/kernels.md §3).

Legend (as model/attention.py): T new tokens of the step, B requests, n_b / L_b new tokens /
context (cached + new) of request b, P pages, S page size, Hq / Hkv query / KV heads on this rank
(a TP slice is just fewer of both), G = Hq / Hkv, D head_dim.

Math: ``model/attention.py attend``. New token i of request b sits at position
``p = L_b - n_b + i`` and attends causally to keys ``0..p`` of its context (lower-right causal
with a cached prefix); query head h reads KV head h // G; ``o = softmax(q·kᵀ · scale) · v``, with
fp8 pages read as ``e4m3 · k_scale`` / ``e4m3 · v_scale`` (the scales folded into the score
scale and the output).

Work split. One program owns one *query tile* of one request and one KV head: BLOCK_M rows that
are BLOCK_Q = BLOCK_M // G consecutive new tokens times the G query heads sharing that KV head
(GQA folded into the rows, so each K/V tile is read once for G heads). The grid is
``(T // BLOCK_Q + B, Hkv, splits)``, an upper bound on the tiles of any ragged batch that needs
no device read: request b's tiles start at index ``query_starts[b] // BLOCK_Q + b`` and a program
finds its request by binary search over ``query_starts`` (programs past a request's last tile
return at once). It walks the keys visible to its tile in BLOCK_N tiles, each key's page found
in the block table (``page = block_tables[b, j // S]``, row ``j % S``), so K/V are read where
they are stored, ``[P, S, Hkv, D]``, never copied. Online softmax in base 2 (scores times
``scale · log2 e``), fp32 running max / sum / accumulator.

Split-K (flash-decoding): with few query tiles (decode of few requests) a long context would run
on few programs; ``splits > 1`` cuts each tile's key range into ``splits`` contiguous parts run
by separate programs, which write unnormalised partial outputs with their running max and sum;
a second kernel combines them (``o = Σ 2^(m_s - M) acc_s / Σ 2^(m_s - M) l_s``).

Launch conventions: docs/kernels.md §1 (``COMPUTE`` fp32 under the interpreter, the activation
dtype on CUDA). Every variant :func:`paged_attention` can launch is registered for the sm_90
compile test (docs/kernels.md §2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m2serve.kernels.triton.aot import Variant, register
from m2serve.kernels.triton.runtime import TL_DTYPES, compute_dtype, interpreted

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per tile
BLOCK_M_DECODE, BLOCK_M_PREFILL = 16, 64  # query rows (tokens x G heads) per program; tl.dot needs >= 16
SPLIT_MENU = (1, 2, 4, 8, 16, 32, 64)  # split-K counts the launcher chooses from (power-of-two combine)
MAX_SPLITS = SPLIT_MENU[-1]
SPLIT_MIN_KEYS = 512  # keys per split at least (a starting value: not measured on a GPU)
SPLIT_PROGRAMS_PER_SM = 4  # split until about this many programs per SM (likewise)
INTERPRETER_SMS = 8  # stand-in SM count under the interpreter (only the split choice depends on it)
NUM_WARPS = 4
CUDA_Q_DTYPES = (torch.bfloat16,)  # q dtypes launched on CUDA (fp32 too under the interpreter)


@triton.jit
def _dot(a, b, COMPUTE: tl.constexpr):
    """a [M, K] · b [K, N] in fp32 accumulation; fp32 operands exactly (not TF32)."""
    if COMPUTE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_attention_kernel(
        q, k_pages, v_pages, out, part_acc, part_ml, block_tables, query_starts, context_lens,
        num_requests, num_splits, page_size, num_heads, score_scale, v_scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
        stride_vp, stride_vs, stride_vh, stride_bt,
        G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        COMPUTE: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # the request whose tiles hold this one: the last b with query_starts[b] // BLOCK_Q + b <= tile
    lo = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_starts + mid) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid + 1, lo)
        hi = tl.where(first <= tile, hi, mid)
    b = lo - 1
    q_lo = tl.load(query_starts + b)
    q_hi = tl.load(query_starts + b + 1)
    ctx = tl.load(context_lens + b)
    tok0 = q_lo + (tile - (q_lo // BLOCK_Q + b)) * BLOCK_Q
    if tok0 < q_hi:
        rows = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        tok = tok0 + rows // G
        row_ok = (rows < BLOCK_Q * G) & (tok < q_hi)
        head = kvh * G + rows % G
        pos = ctx - (q_hi - q_lo) + (tok - q_lo)  # position of each row's query token
        q_ptr = q + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        qt = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(COMPUTE)  # [BLOCK_M, D]

        # keys 0 .. kv_end-1 are visible to some row of the tile; this split takes a contiguous part
        kv_end = ctx - q_hi + tl.minimum(tok0 + BLOCK_Q, q_hi)
        n_tiles = tl.cdiv(kv_end, BLOCK_N)
        per_split = tl.cdiv(n_tiles, num_splits)
        t_lo = split * per_split
        t_hi = tl.minimum(n_tiles, t_lo + per_split)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        table = block_tables + b.to(tl.int64) * stride_bt
        for t in range(t_lo, t_hi):
            j = t * BLOCK_N + tl.arange(0, BLOCK_N)
            j_ok = j < kv_end
            page = tl.load(table + j // page_size, mask=j_ok, other=0).to(tl.int64)
            row = j % page_size
            k_off = page * stride_kp + row * stride_ks + kvh * stride_kh
            v_off = page * stride_vp + row * stride_vs + kvh * stride_vh
            kt = tl.load(k_pages + k_off[None, :] + d[:, None], mask=j_ok[None, :], other=0.0)  # [D, BLOCK_N]
            s = _dot(qt, kt.to(COMPUTE), COMPUTE) * score_scale  # [BLOCK_M, BLOCK_N], log2 units
            visible = row_ok[:, None] & (j[None, :] <= pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp2(s - m_ref[:, None])
            alpha = tl.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_pages + v_off[:, None] + d[None, :], mask=j_ok[:, None], other=0.0)  # [BLOCK_N, D]
            acc = acc * alpha[:, None] + _dot(p.to(COMPUTE), vt.to(COMPUTE), COMPUTE)
            m_i = m_new

        if num_splits == 1:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
            o_ptr = out + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(o_ptr, o.to(out.dtype.element_ty), mask=row_ok[:, None])
        else:  # partials [T, Hq, splits, D] and (max, sum) [T, Hq, splits, 2], fp32
            part = (tok.to(tl.int64) * num_heads + head) * num_splits + split
            tl.store(part_acc + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml + part * 2, m_i, mask=row_ok)
            tl.store(part_ml + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(part_acc, part_ml, out, num_splits, num_heads, v_scale, stride_ot, stride_oh,
                           D: tl.constexpr, MAX_SPLITS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, D)
    s_ok = s < num_splits
    part = (tok * num_heads + head) * num_splits + s
    m = tl.load(part_ml + part * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml + part * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc + part[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # split 0 always holds key 0, so the max is finite
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0) * v_scale
    tl.store(out + tok * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty))


def choose_splits(query_tiles: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """Split-K count: the largest value of :data:`SPLIT_MENU` that keeps the programs
    (``query_tiles · num_kv_heads · splits``) <= SPLIT_PROGRAMS_PER_SM · ``sm_count`` and every split
    >= SPLIT_MIN_KEYS keys of ``max_context_len``; 1 when the tiles alone fill the GPU."""
    programs = query_tiles * num_kv_heads
    best = 1
    for n in SPLIT_MENU:
        if programs * n <= SPLIT_PROGRAMS_PER_SM * sm_count and max_context_len >= n * SPLIT_MIN_KEYS:
            best = n
    return best


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                    scale: float, *, max_query_len: int, max_context_len: int, k_scale: float = 1.0,
                    v_scale: float = 1.0, splits: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA of every request's new tokens over its pages, one launch (module docstring).

    q:            [T, Hq, D] bf16 (fp32 also under the interpreter), last dim contiguous, request order.
    k_pages, v_pages: [P, S, Hkv, D] the layer's pool, q's dtype or float8_e4m3fn (read as
                  ``e4m3 · k_scale`` / ``· v_scale``); last dim contiguous.
    block_tables: int32 [B, max_pages] page ids of each request (entries past its context unread).
    query_starts: int32 [B+1] prefix sums of new tokens (ForwardBatch.input_row_offsets).
    context_lens: int32 [B] cached + new tokens of each request (>= its new tokens, >= 1).
    max_query_len, max_context_len: host ints (the step's StepHost) that pick the tile height and
                  the split count; no device value is read.
    splits:       split-K count (None: :func:`choose_splits`); must be in :data:`SPLIT_MENU`.
    out:          optional [T, Hq, D] of q's dtype to write into.
    Returns out [T, Hq, D] of q's dtype.

    Raises ValueError naming the argument for shapes, dtypes or devices that do not fit (q not bf16
    on CUDA, Hq not a multiple of Hkv, G > 64, D not a power of two >= 16, a split count off the
    menu). Contents
    (context lengths vs block tables) are the caller's contract: StepHost.check validates them on
    the host before the step.
    """
    T, Hq, D = q.shape
    P, S, Hkv, Dk = k_pages.shape
    B = context_lens.shape[0]
    if v_pages.shape != k_pages.shape or Dk != D:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} / v_pages {tuple(v_pages.shape)} must both be "
                         f"[P, S, Hkv, {D}] (q {tuple(q.shape)})")
    if Hq % Hkv or Hq // Hkv > BLOCK_M_PREFILL:
        raise ValueError(f"q heads {Hq} must be a multiple of KV heads {Hkv} with at most "
                         f"{BLOCK_M_PREFILL} query heads per KV head")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two >= 16")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride {t.stride()})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    for name, t, shape in (("block_tables", block_tables, (B, block_tables.shape[-1])),
                           ("query_starts", query_starts, (B + 1,)), ("context_lens", context_lens, (B,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != q.device:
            raise ValueError(f"{name} must be int32 {list(shape)} on {q.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    if q.dtype not in (*CUDA_Q_DTYPES, torch.float32) or (q.dtype not in CUDA_Q_DTYPES and not interpreted()):
        raise ValueError(f"q is {q.dtype}: the kernel takes bfloat16 activations on CUDA (float32 too "
                         "under the interpreter); use the torch path (model/attention.py attend) otherwise")
    if k_pages.dtype != v_pages.dtype or k_pages.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"KV pages {k_pages.dtype} / {v_pages.dtype} must be {q.dtype} or float8_e4m3fn")
    G = Hq // Hkv
    block_m = BLOCK_M_DECODE if max_query_len * G <= BLOCK_M_DECODE else BLOCK_M_PREFILL
    block_q = block_m // G
    tiles = T // block_q + B
    if splits is None:
        splits = choose_splits(-(-T // block_q), Hkv, max_context_len, _sm_count(q.device))
    if splits not in SPLIT_MENU:
        raise ValueError(f"splits {splits} not in {SPLIT_MENU}")
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    if splits > 1:
        part_acc = torch.empty(T, Hq, splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T, Hq, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = torch.empty(0, dtype=torch.float32, device=q.device)
    comp = compute_dtype(q.dtype)
    _paged_attention_kernel[(tiles, Hkv, splits)](
        q, k_pages, v_pages, out, part_acc, part_ml, block_tables, query_starts, context_lens,
        B, splits, S, Hq, scale * k_scale * LOG2E, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_pages.stride(0), k_pages.stride(1),
        k_pages.stride(2), v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), block_tables.stride(0),
        G=G, D=D, BLOCK_M=block_m, BLOCK_N=BLOCK_N, COMPUTE=comp, num_warps=NUM_WARPS)
    if splits > 1:
        _combine_splits_kernel[(T, Hq)](part_acc, part_ml, out, splits, Hq, v_scale, out.stride(0),
                                        out.stride(1), D=D, MAX_SPLITS=MAX_SPLITS, num_warps=NUM_WARPS)
    return out


def kv_bytes_read(context_lens: list[int], num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of K and V one decode step must read at least: every context token's K and V rows
    of every KV head once (2 · Σ L_b · Hkv · D · element size). The bandwidth bound of a decode
    step is this over the device's copy rate (benchmarks/gpu_check.py --part attention)."""
    elem = torch.empty(0, dtype=kv_dtype).element_size()
    return 2 * sum(context_lens) * num_kv_heads * head_dim * elem


# --- the variants paged_attention launches, for the sm_90 compile test (docs/kernels.md §2) -----------

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.float8_e4m3fn: "fp8e4nv"}
MODEL_G, MODEL_D = 6, 128  # MiniMax-M2: 48 query / 8 KV heads (any TP slice keeps G = 6), head_dim 128


def _attention_signature(q: str, kv: str) -> dict[str, str]:
    sig = {"q": f"*{q}", "k_pages": f"*{kv}", "v_pages": f"*{kv}", "out": f"*{q}", "part_acc": "*fp32",
           "part_ml": "*fp32", "block_tables": "*i32", "query_starts": "*i32", "context_lens": "*i32"}
    sig |= {n: "i32" for n in ("num_requests", "num_splits", "page_size", "num_heads")}
    sig |= {"score_scale": "fp32", "v_scale": "fp32"}
    sig |= {n: "i32" for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kp", "stride_ks",
                               "stride_kh", "stride_vp", "stride_vs", "stride_vh", "stride_bt")}
    return sig | {n: "constexpr" for n in ("G", "D", "BLOCK_M", "BLOCK_N", "COMPUTE")}


def _register_variants() -> None:
    for q_dtype in CUDA_Q_DTYPES:
        q = _TYPES[q_dtype]
        for kv_dtype in (q_dtype, torch.float8_e4m3fn):
            kv = _TYPES[kv_dtype]
            for block_m in (BLOCK_M_DECODE, BLOCK_M_PREFILL):
                register(Variant(
                    f"paged_attention/q-{q}/kv-{kv}/block_m-{block_m}", _paged_attention_kernel,
                    _attention_signature(q, kv),
                    {"G": MODEL_G, "D": MODEL_D, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N,
                     "COMPUTE": TL_DTYPES[q_dtype]},
                    {"num_warps": NUM_WARPS}))
        sig = {"part_acc": "*fp32", "part_ml": "*fp32", "out": f"*{q}", "num_splits": "i32",
               "num_heads": "i32", "v_scale": "fp32", "stride_ot": "i32", "stride_oh": "i32",
               "D": "constexpr", "MAX_SPLITS": "constexpr"}
        register(Variant(f"combine_splits/out-{q}", _combine_splits_kernel, sig,
                         {"D": MODEL_D, "MAX_SPLITS": MAX_SPLITS}, {"num_warps": NUM_WARPS}))


_register_variants()
