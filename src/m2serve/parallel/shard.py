"""Shard plans: which slice of each checkpoint tensor a rank reads (docs/parallelism.md §2).

A plan is a function ``plan(name, shape) -> (dim, start, end) | None | "skip"`` over hub tensor
names (docs/checkpoints.md §2; the ``mlp.`` / ``gate_proj`` spellings of docs/checkpoints.md §3
are accepted too):
``None`` = read the whole tensor (replicated), ``"skip"`` = this rank does not hold it (an expert
outside its EP range), ``(dim, start, end)`` = read ``[start, end)`` along ``dim``. The loader
applies it with ``safe_open(...).get_slice`` so a rank never reads more than its share.

Rules (P ranks, tp = tensor parallel degree, r = rank):
- q/k/v_proj rows and o_proj columns: whole heads [r·Hq/tp, …) / [r·Hkv/tp, …), head_dim each;
  q_norm / k_norm gamma sliced with the same heads.
- experts under TP_TP: w1/w3 rows and w2 columns [r·I/tp, …); under EP: whole experts
  [r·E/ep, …), the others skipped.
- everything else (embed, lm_head, norms, router gate + bias, KV scales): replicated.
Companion tensors (FP8 ``weight_scale_inv`` 128×128 grids, packed FP4 bytes and their group
scales) are sliced at the matching position of their own grid; an FP8 slice that starts or ends
inside a 128-wide band keeps every band it touches (docs/checkpoints.md §6), an FP4 one must not
split a group.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import ParallelismMode, ParallelState, shard_ranges
from m2serve.config.quant import FP8_BLOCK

Slice = tuple[int, int, int]  # (dim, start, end)
Plan = Callable[[str, Sequence[int]], "Slice | None | str"]

_ATTN = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.(\w+)$")
_EXPERT = re.compile(r"(?:^|\.)layers\.\d+\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.(\w+)$")
_COLUMN_SPLIT = {"o_proj", "w2", "down_proj"}


def make_shard_plan(config: MiniMaxM2Config, state: ParallelState) -> Plan | None:
    """The shard plan of one rank, or None when the rank holds the whole model (one device,
    plain data parallelism). Raises ValueError (from the returned plan) naming the tensor when an
    FP4 companion grid cannot be cut at the rank's boundary (an FP8 scale grid always can)."""
    ranges = shard_ranges(config, state)
    D, I = config.head_dim, config.intermediate_size
    tp_attention = state.tp_size > 1
    tp_experts = state.mode is ParallelismMode.TP_TP and state.tp_size > 1
    if not (tp_attention or tp_experts or state.ep_size > 1):
        return None

    def plan(name: str, shape: Sequence[int]) -> Slice | None | str:
        m = _ATTN.search(name)
        if m is not None:
            if not tp_attention:
                return None
            proj, kind = m.groups()
            if proj in ("k_proj", "v_proj", "k_norm"):
                heads, full = ranges.kv_heads, config.num_key_value_heads * D
            else:
                heads, full = ranges.q_heads, config.num_attention_heads * D
            dim = 1 if proj in _COLUMN_SPLIT else 0
            return _slice(name, kind, shape, dim, full, heads[0] * D, heads[1] * D)
        m = _EXPERT.search(name)
        if m is not None:
            expert, which, kind = int(m.group(1)), m.group(2), m.group(3)
            if not ranges.experts[0] <= expert < ranges.experts[1]:
                return "skip"
            if not tp_experts:
                return None
            dim = 1 if which in _COLUMN_SPLIT else 0
            return _slice(name, kind, shape, dim, I, *ranges.intermediate)
        return None

    return plan


def _slice(name: str, kind: str, shape: Sequence[int], dim: int, full: int, start: int,
           end: int) -> Slice | None:
    """Map the logical range [start, end) of a ``full``-wide dim onto this tensor's own grid."""
    if not kind.startswith("weight") or len(shape) <= dim or math.prod(shape) <= 1:
        return None  # scalars (weight_scale_2, input_scale, k_scale / v_scale) are replicated
    n = int(shape[dim])
    if n == full:
        return dim, start, end
    if kind == "weight_scale_inv":  # FP8: the 128-wide bands the slice touches, a split band included
        return dim, start // FP8_BLOCK, -(-end // FP8_BLOCK)
    block = full // n if full % n == 0 else 0
    if block == 0 or start % block or (end % block and end != full):
        raise ValueError(f"{name}: cannot cut [{start}, {end}) of {full} along dim {dim} on its grid of "
                         f"{n} entries; choose a parallel layout whose per-rank width is a multiple of "
                         f"the block (docs/parallelism.md §5 V7)")
    return dim, start // block, -(-end // block)


def checkpoint_tensors(config: MiniMaxM2Config, encoding: str = "bf16",
                       act_bytes: int = 2) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, bytes per element) of every tensor of a release-layout checkpoint.

    encoding "fp8": linear weights (attention + experts) F8_E4M3 (1 B) with fp32
    ``weight_scale_inv`` grids [⌈N/128⌉, ⌈K/128⌉]; any other encoding: dense linears of
    ``act_bytes``. Norms, embedding and lm_head use ``act_bytes``; router gate and correction
    bias are fp32 (docs/checkpoints.md §2, docs/model.md §5.1).
    """
    H, D, I, E = config.hidden_size, config.head_dim, config.intermediate_size, config.num_local_experts
    q, kv, V = config.num_attention_heads * D, config.num_key_value_heads * D, config.vocab_size
    fp8 = "fp8" in encoding.lower()
    out: list[tuple[str, tuple[int, ...], int]] = []

    def linear(name: str, n: int, k: int) -> None:
        out.append((f"{name}.weight", (n, k), 1 if fp8 else act_bytes))
        if fp8:
            out.append((f"{name}.weight_scale_inv", (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), 4))

    out.append(("model.embed_tokens.weight", (V, H), act_bytes))
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append((f"{p}.{norm}.weight", (H,), act_bytes))
        for proj, n, k in (("q_proj", q, H), ("k_proj", kv, H), ("v_proj", kv, H), ("o_proj", H, q)):
            linear(f"{p}.self_attn.{proj}", n, k)
        out.append((f"{p}.self_attn.q_norm.weight", (q,), act_bytes))
        out.append((f"{p}.self_attn.k_norm.weight", (kv,), act_bytes))
        out.append((f"{p}.block_sparse_moe.gate.weight", (E, H), 4))
        out.append((f"{p}.block_sparse_moe.e_score_correction_bias", (E,), 4))
        for e in range(E):
            for w, n, k in (("w1", I, H), ("w3", I, H), ("w2", H, I)):
                linear(f"{p}.block_sparse_moe.experts.{e}.{w}", n, k)
    out.append(("model.norm.weight", (H,), act_bytes))
    out.append(("lm_head.weight", (V, H), act_bytes))
    return out


def rank_weight_bytes(config: MiniMaxM2Config, state: ParallelState, encoding: str = "bf16",
                      act_bytes: int = 2) -> int:
    """Bytes of the checkpoint tensors (:func:`checkpoint_tensors`) that ``state``'s rank reads
    under its shard plan (docs/serving.md §7 "hand-derived weight bytes")."""
    plan = make_shard_plan(config, state)
    total = 0
    for name, shape, itemsize in checkpoint_tensors(config, encoding, act_bytes):
        s = plan(name, shape) if plan is not None else None
        if s == "skip":
            continue
        numel = math.prod(shape)
        if s is not None:
            dim, start, end = s
            numel = numel // shape[dim] * (end - start)
        total += numel * itemsize
    return total
