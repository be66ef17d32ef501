"""Paged GQA attention with cross-head QK norm and partial RoPE (docs/model.md §3 steps 2-8).

Legend: T new tokens in the step, B requests, n_b / L_b new tokens / context (cached + new) of
request b, Tq most new tokens of one request, Lk longest context, P pages, S page size,
Hq / Hkv query / KV heads on this rank, G = Hq / Hkv, D head_dim, H hidden.

The KV cache is the engine's paged pool (model/batch.py KVStorage [P, S, Hkv, D]); K is written
after QK norm + RoPE, V raw; every request sees all its cached pages plus its new tokens
causally.

:func:`attend` is the one attention seam: ``attend(q, kv, layer, step, scale)`` reads each
request's REAL context from its pages (varlen over the block tables and context lengths of the
step context, model/step.py), never a [B, Lk_max] padded copy, so one layer's scratch is the K/V
rows of the requests, Σ_b ceil(L_b / S)·S, not B × Lk. CPU implementation: a loop over the
requests (host ints from the step context), each gathering its pages (``index_select`` of its
page ids; a view of the pool when they are consecutive ids, StepContext ``page_runs``) and
calling ``F.scaled_dot_product_attention``, which on CPU is the fused flash kernel
(GQA native via ``enable_gqa``; fp32 accumulation for bf16). A decode request folds its G query
heads of a KV head into the query axis (no mask), and so does a chunk of at most
``FOLD_MAX_ROWS`` tokens after a cached prefix (a speculative verification; its mask rows
repeated G times); a chunk starting at position 0 uses ``is_causal``; any other chunk takes the
additive mask the step context built once per step (never per layer). Chosen by measurement
(benchmarks/attention.py, one layer of the bench config's heads, fp32, 1 thread, best of 2-6,
three runs on the shared 2-core box at load ~10, so noisy): against a chunked loop (per request,
512-key chunks read page by page with an online softmax in torch ops) the chunked/SDPA time
ratio was 0.72-1.08 on decode of 1 x 8,192 + 31 x 64 (a tie), 0.85-1.62 on decode of 32 x 512
and 3.0-3.6 on a 512-token chunk after 1,024 cached, so SDPA: never clearly slower, one fused op
per request. The old padded gather took 20-28x SDPA's time on the first case and 1.25-2.4x on
the second, 0.82-0.92x on the one-request prefill chunk.

GPU choice: the ``triton`` attention backend (docs/kernels.md §7), chosen once when the model is
built (:func:`resolve_attention_backend`): :func:`attend_kernel` runs the paged attention kernel
of kernels/triton/attention.py, one launch per layer over the whole ragged step, reading the
batch's block tables directly (no per-request work, so a decode step can be captured). The loop
above stays the ``torch`` backend: the reference and the CPU default (on CUDA a chunk after a
cached prefix takes ``causal_lower_right`` rather than a materialised mask, model/step.py).

The previous path, :func:`paged_attention` over :class:`AttentionMetadata` (every request's
context gathered padded to [B, Lk, Hkv, D] into :class:`GatherScratch` buffers, one [B, 1, Tq, Lk]
mask), stays as the test reference and the benchmark-only legacy switch (``legacy_path`` on the
model, model/decoder.py).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from m2serve.config.engine_args import ATTENTION_BACKENDS
from m2serve.model.batch import ForwardBatch, KVStorage

if TYPE_CHECKING:
    from m2serve.model.step import StepContext
from m2serve.model.linear import Linear
from m2serve.model.norm import RMSNorm, qk_norm_pair
from m2serve.model.rope import apply_rope, rope_cos_sin

E4M3_MAX = 448.0
#: Chunks of at most this many new tokens after a cached prefix (speculative verifications of
#: K + 1 rows) fold their G query heads into the query axis, as a decode does (:func:`attend`).
#: Measured (SDPA, fp32, 1 thread, 600 keys, Hq 8 / Hkv 4, D 128): folded / enable_gqa time
#: 0.65 at 2 rows, 0.74 at 5, 0.80 at 9, 0.97 at 17, 1.9 at 33.
FOLD_MAX_ROWS = 16
SCRATCH_GROWTH = 1.25  # over-allocation when a scratch buffer grows (contexts grow every step)


@dataclass(slots=True)
class GatherScratch:
    """Flat buffers reused across layers and steps for the gathered K/V context (one model forward
    at a time). Holds, per (name, dtype, device), the largest B·Lk·Hkv·D seen x SCRATCH_GROWTH
    elements until the owner drops it."""

    buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous view of ``shape`` over buffer ``name`` (grown as needed)."""
        n = math.prod(shape)
        key = (name, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(int(n * SCRATCH_GROWTH), dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:n].view(shape)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step indices of the padded legacy path, built once from a ForwardBatch.

    cos, sin:     [T, R/2] f32 RoPE angles of each new token.
    slot_mapping: int64 [T] cache slot (page * S + offset) each new token's K/V is written to.
    query_index:  int64 [B, Tq] index into [T] of request b's i-th new token (0 for padding).
    query_valid:  bool [B, Tq] False on padding rows.
    ctx_slots:    int64 [B, Lk] cache slot of request b's j-th context token (0 for padding).
    mask:         bool [B, 1, Tq, Lk] True where query i may attend key j (j <= pos_i).
    scratch:      reusable gather buffers (None: allocate per layer).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    query_index: torch.Tensor
    query_valid: torch.Tensor
    ctx_slots: torch.Tensor
    mask: torch.Tensor
    scratch: GatherScratch | None = None

    @classmethod
    def from_batch(cls, batch: ForwardBatch, page_size: int, inv_freq: torch.Tensor,
                   scratch: GatherScratch | None = None) -> AttentionMetadata:
        """Build the step's indices. Raises ValueError if a request's context is shorter than its
        new tokens or its block table has too few pages for its context."""
        dev = batch.tokens.device
        offs = batch.input_row_offsets.to(device=dev, dtype=torch.int64)
        n_new = offs[1:] - offs[:-1]  # [B]
        ctx = batch.context_lens.to(device=dev, dtype=torch.int64)  # [B]
        if bool((ctx < n_new).any()):
            raise ValueError(f"context_lens {ctx.tolist()} shorter than new tokens {n_new.tolist()}")
        max_pages = batch.block_tables.shape[1]
        if bool((ctx > max_pages * page_size).any()):
            raise ValueError(f"context_lens {ctx.tolist()} exceed block_tables capacity "
                             f"{max_pages} pages x {page_size}")
        B = n_new.numel()
        Tq = int(n_new.max()) if B else 0
        Lk = int(ctx.max()) if B else 0
        i = torch.arange(Tq, device=dev)
        query_valid = i[None, :] < n_new[:, None]  # [B, Tq]
        query_index = torch.where(query_valid, offs[:-1, None] + i[None, :], 0)
        qpos = torch.where(query_valid, batch.positions[query_index], 0)  # [B, Tq]
        j = torch.arange(Lk, device=dev)
        tables = batch.block_tables.to(device=dev, dtype=torch.int64)
        page = tables[:, (j // page_size).clamp(max=max_pages - 1)]  # [B, Lk]
        ctx_slots = torch.where(j[None, :] < ctx[:, None], page * page_size + j % page_size, 0)  # [B, Lk]
        mask = (j[None, None, :] <= qpos[:, :, None])[:, None]  # [B, 1, Tq, Lk]
        cos, sin = rope_cos_sin(batch.positions, inv_freq)
        return cls(cos, sin, batch.slot_mapping.to(torch.int64), query_index, query_valid, ctx_slots, mask,
                   scratch)


def write_kv(kv: KVStorage, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at ``slots`` [T] of layer ``layer``'s pages.

    fp8 pages hold ``e4m3(x / scale)`` with the layer's k_scale / v_scale (clamped to ±448).
    """
    for pages, x, scale in ((kv.k[layer], k, kv.k_scale[layer]), (kv.v[layer], v, kv.v_scale[layer])):
        flat = pages.view(-1, *pages.shape[2:])  # [P*S, Hkv, D]
        if pages.dtype == torch.float8_e4m3fn:
            x = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
        flat[slots] = x.to(pages.dtype)


def read_kv(kv: KVStorage, layer: int, slots: torch.Tensor, dtype: torch.dtype,
            scratch: GatherScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather K, V at ``slots`` [B, Lk] -> two [B, Lk, Hkv, D] tensors of ``dtype`` (fp8: x scale).

    With ``scratch`` the results are views of its buffers, valid until the next call.
    """
    B, Lk = slots.shape
    idx = slots.reshape(-1)
    out = []
    for name, pages, scale in (("k", kv.k[layer], kv.k_scale[layer]), ("v", kv.v[layer], kv.v_scale[layer])):
        flat = pages.view(-1, *pages.shape[2:])  # [P*S, Hkv, D]
        shape = (B * Lk, *pages.shape[2:])
        if scratch is None:
            x = flat.index_select(0, idx)
        else:
            raw = scratch.take(name + "_raw", shape, pages.dtype, pages.device)
            x = torch.index_select(flat, 0, idx, out=raw)
        if pages.dtype == torch.float8_e4m3fn:
            y = torch.empty(shape, dtype=dtype, device=x.device) if scratch is None else \
                scratch.take(name, shape, dtype, x.device)
            x = y.copy_(x).mul_(scale) if scale != 1.0 else y.copy_(x)  # e4m3 is exact in bf16 / f32
        elif x.dtype != dtype:
            x = x.to(dtype)
        out.append(x.view(B, Lk, *pages.shape[2:]))
    return out[0], out[1]


class MiniMaxM2Attention(nn.Module):
    """Attention of one decoder layer over this rank's heads (docs/model.md §3 steps 2-8).

    Weights (hub names under ``self_attn.``): q_proj [Hq·D, H], k_proj / v_proj [Hkv·D, H],
    o_proj [H, Hq·D], q_norm [Hq·D], k_norm [Hkv·D], with Hq / Hkv the LOCAL head counts.
    ``q_width`` / ``k_width`` are the GLOBAL QK-norm widths (Hq·D, Hkv·D of the whole model).
    ``reduce_qk`` sums the [T, 2] QK-norm statistics of q and k over ranks in one call (identity
    on one rank; docs/parallelism.md §4). Under TP the output is this rank's o_proj partial sum: the
    decoder layer reduces it with the residual (model/collectives.py).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, q_width: int,
                 k_width: int, scale: float, eps: float, reduce_qk: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_width, self.k_width, self.scale, self.eps = q_width, k_width, scale, eps
        self.reduce_qk = reduce_qk
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = Linear(hidden_size, q, dtype)
        self.k_proj = Linear(hidden_size, kv, dtype)
        self.v_proj = Linear(hidden_size, kv, dtype)
        self.o_proj = Linear(q, hidden_size, dtype)
        self.q_norm = RMSNorm(q, eps, dtype)  # γ only: applied by qk_norm with the global width
        self.k_norm = RMSNorm(kv, eps, dtype)

    def forward(self, h: torch.Tensor, step: StepContext, kv: KVStorage, layer: int) -> torch.Tensor:
        """h [T, H] act -> attention output [T, H] act (after o_proj; a partial sum under TP)."""
        T = h.shape[0]
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k = qk_norm_pair(self.q_proj(h), self.k_proj(h), self.q_norm.weight, self.k_norm.weight,
                            self.eps, self.q_width, self.k_width, self.reduce_qk)  # [T, Hq·D], [T, Hkv·D]
        v = self.v_proj(h).view(T, Hkv, D)
        q = apply_rope(q.view(T, Hq, D), step.cos, step.sin)
        k = apply_rope(k.view(T, Hkv, D), step.cos, step.sin)
        write_kv(kv, layer, k, v, step.slot_mapping)
        if step.legacy is not None:
            return self.o_proj(paged_attention(q, kv, layer, step.legacy, self.scale))
        if step.kernel is not None:
            return self.o_proj(attend_kernel(q, kv, layer, step, self.scale))
        return self.o_proj(attend(q, kv, layer, step, self.scale))  # [T, Hq·D] -> [T, H]


def read_pages(kv: KVStorage, layer: int, pages: torch.Tensor | slice, length: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the first ``length`` tokens held in ``pages`` (int64 [p] page ids in order, or
    ``slice(first, first + p)`` for consecutive ids) of layer ``layer`` -> two [length, Hkv, D]
    tensors of ``dtype`` (fp8 pages: e4m3 x scale, exact).

    Page ids: allocates p·S rows per tensor (the gathered pages; the tail of the last page is sliced
    off). A slice is read as a view of the pool: nothing allocated when the pool holds ``dtype``,
    else only the conversion's rows (one pass over the pages instead of a gather and a conversion).
    """
    out = []
    for pool, scale in ((kv.k[layer], kv.k_scale[layer]), (kv.v[layer], kv.v_scale[layer])):
        x = pool[pages] if type(pages) is slice else pool.index_select(0, pages)
        x = x.flatten(0, 1)[:length]  # [length, Hkv, D]
        if pool.dtype == torch.float8_e4m3fn:
            x = x.to(dtype)
            if scale != 1.0:
                x.mul_(scale)   # x is a new tensor here (the conversion), never the pool
        elif x.dtype != dtype:
            x = x.to(dtype)
        out.append(x)
    return out[0], out[1]


def attend(q: torch.Tensor, kv: KVStorage, layer: int, step: StepContext, scale: float) -> torch.Tensor:
    """Causal GQA of each request's new tokens over its pages (docs/model.md §3 step 7).

    q [T, Hq, D] act (request order, spans ``step.host.query_starts``) -> [T, Hq·D] act. Query
    head h reads KV head h // G; ``softmax(q·kᵀ · scale + causal) · v`` per request, through
    F.scaled_dot_product_attention (module docstring: varlen over pages, masks from the step
    context). One request: its SDPA output is returned as is (no copy); several: concatenated.
    """
    T, Hq, D = q.shape
    qs, ctx = step.host.query_starts, step.host.context_lens
    parts = []
    for b, L in enumerate(ctx):
        s, e = qs[b], qs[b + 1]
        n = e - s
        if n == 0:
            continue
        K, V = read_pages(kv, layer, step.request_pages(b), L, q.dtype)  # [L, Hkv, D]
        Hkv = K.shape[1]
        k, v = K.permute(1, 0, 2)[None], V.permute(1, 0, 2)[None]  # [1, Hkv, L, D] views
        mask = step.masks[b]
        G = Hq // Hkv
        if n == 1:  # the G query heads of KV head h as G query rows: [1, Hkv, G, D]
            o = F.scaled_dot_product_attention(q[s].view(1, Hkv, G, D), k, v, scale=scale)
        elif type(mask) is torch.Tensor and n <= FOLD_MAX_ROWS:   # not a CausalBias (a subclass)
            # a few rows (a speculative verification): folded as a decode, query row i·G + g is
            # token i's head h·G + g over KV head h, mask row i repeated G times: [1, Hkv, n·G, D]
            qf = q[s:e].view(n, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, n * G, D)
            o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask.repeat_interleave(G, dim=0),
                                               scale=scale)
            o = o.view(Hkv, n, G, D).transpose(0, 1)  # [n, Hkv, G, D]
        else:
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k, v, attn_mask=mask,
                                               is_causal=mask is None, scale=scale,
                                               enable_gqa=True)  # [1, Hq, n, D]
            o = o[0].transpose(0, 1)  # [n, Hq, D]
        parts.append(o.reshape(n, Hq * D))
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else q.new_empty(0, Hq * D)


def attend_kernel(q: torch.Tensor, kv: KVStorage, layer: int, step: StepContext,
                  scale: float) -> torch.Tensor:
    """:func:`attend` through the triton backend's kernel (``step.kernel``, kernels/triton/attention.py
    ``paged_attention``): one launch for the whole step, reading the block tables, query starts and
    context lengths of ``step`` (int32, on the device) and the layer's pool directly.
    q [T, Hq, D] act -> [T, Hq·D] act."""
    T, Hq, D = q.shape
    o = step.kernel(q.contiguous(), kv.k[layer], kv.v[layer], step.block_tables, step.query_starts,
                    step.context_lens, scale, max_query_len=step.max_query_len,
                    max_context_len=step.max_context_len, k_scale=kv.k_scale[layer],
                    v_scale=kv.v_scale[layer])
    return o.view(T, Hq * D)


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """The attention backend for ``name`` (config/engine_args.py ATTENTION_BACKENDS) on ``device``:
    "torch" or "triton" (docs/kernels.md §7). "auto" is triton on CUDA where Triton imports, else
    torch (the CPU default; under the CPU interpreter the kernel is a test path, not a fast one).
    Raises ValueError naming the choices for an unknown name, and for "triton" where Triton does
    not import (naming the import error)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not supported; use one of "
                         f"{list(ATTENTION_BACKENDS)}")
    if name == "torch" or (name == "auto" and torch.device(device).type != "cuda"):
        return "torch"
    try:
        triton_kernel()
    except ImportError as e:
        if name == "triton":
            raise ValueError(f"attention_backend='triton': Triton does not import ({e})") from e
        return "torch"
    return "triton"


def triton_kernel() -> Callable[..., torch.Tensor]:
    """kernels/triton/attention.py ``paged_attention``. Imported by name, here only, when the triton
    backend is chosen: the CPU engine never imports Triton (docs/kernels.md §1)."""
    return importlib.import_module("m2serve.kernels.triton.attention").paged_attention


def paged_attention(q: torch.Tensor, kv: KVStorage, layer: int, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal GQA over each request's cached + new tokens, padded: the legacy path and test
    reference of :func:`attend` (docs/model.md §3 step 7).

    q [T, Hq, D] act -> [T, Hq·D] act. Query head h reads KV head h // G (heads folded, see
    the module docstring);
    ``softmax(q·kᵀ · scale + mask) · v`` through F.scaled_dot_product_attention, whose kernels
    accumulate scores and softmax in fp32 for bf16 inputs.
    """
    T, Hq, D = q.shape
    B, Tq = meta.query_index.shape
    K, V = read_kv(kv, layer, meta.ctx_slots, q.dtype, meta.scratch)  # [B, Lk, Hkv, D]
    Hkv = K.shape[2]
    G = Hq // Hkv
    # fold the G query heads of KV head h into the query axis: [B, Hkv, G·Tq, D], rows (g, i)
    qp = q[meta.query_index].view(B, Tq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Tq, D)
    Lk = K.shape[1]
    mask = meta.mask if Tq == 1 else meta.mask[:, :, None].expand(-1, -1, G, -1, -1).reshape(B, 1, G * Tq, Lk)
    o = F.scaled_dot_product_attention(qp, K.transpose(1, 2), V.transpose(1, 2), attn_mask=mask,
                                       scale=scale)  # [B, Hkv, G·Tq, D]
    o = o.view(B, Hkv, G, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq * D)
    return o[meta.query_valid]  # [T, Hq·D], request order
