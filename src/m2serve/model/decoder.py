"""MiniMax-M2 decoder: layers, MoE block and the causal-LM head (docs/model.md §3).

Legend: T new tokens, N returned logit rows, H hidden, V vocab, E experts, k top-k.

Parameter names follow the hub layout (docs/checkpoints.md §2) except the experts, which are
stacked per rank (experts.py). The model takes a ParallelState (config/parallel.py); local head
counts and the expert range come from :func:`local_dims`; the cross-rank steps (the QK-norm
statistics, the attention and MoE residual paths, the EP dispatch/combine) are
model/collectives.py (no collective runs on one rank).

The forward builds one :class:`~m2serve.model.step.StepContext` per step (model/step.py) and runs
without a host sync on one rank: grouped experts (experts.py), varlen paged
attention (attention.py :func:`attend`), logit rows and page ids from the batch's host lists. The
EP exchange's counts all_to_all is the one read-back (model/collectives.py :func:`ep_moe`).

:meth:`MiniMaxM2ForCausalLM.forward_decode` is the static decode step a CUDA graph records
(model/cuda_graphs.py, docs/serving.md §6.3): the same layers over fixed-address inputs.

Benchmark-only switch: ``model.legacy_path = True`` runs the previous path (the per-active-expert
loop and the padded [B, Lk] K/V gather) so benchmarks compare before and after in one run.

Batch-invariant mode (docs/model.md §7): :meth:`MiniMaxM2ForCausalLM.use_batch_invariant`, once
after load (model/load.py), so that a row's logits do not depend on the other rows of the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import ParallelismMode, ParallelState, shard_ranges
from m2serve.formats.fp4 import PackedFP4
from m2serve.formats.fp8 import PackedFP8
from m2serve.kernels.ops import dense_linear
from m2serve.model.attention import (
    GatherScratch,
    MiniMaxM2Attention,
    resolve_attention_backend,
    triton_kernel,
)
from m2serve.model.batch import ForwardBatch, KVStorage
from m2serve.model.collectives import (
    attention_residual,
    ep_moe,
    moe_residual,
    reduce_moe_partial,
    reduce_qk_stats,
    uses_ep_exchange,
)
from m2serve.model.cuda_graphs import DecodeInputs
from m2serve.model.experts import MiniMaxM2Experts
from m2serve.model.linear import Linear
from m2serve.model.norm import RMSNorm
from m2serve.model.router import MiniMaxM2Router
from m2serve.model.step import RopeCache, StepContext

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


@dataclass(frozen=True, slots=True)
class LocalDims:
    """This rank's share: heads, expert range [expert_start, expert_start + num_local_experts), I."""

    num_heads: int
    num_kv_heads: int
    expert_start: int
    num_local_experts: int
    intermediate_size: int


def local_dims(cfg: MiniMaxM2Config, parallel: ParallelState) -> LocalDims:
    """Split heads by tp_size; experts by ep_size (TP_EP, DP_EP) or their intermediate dim by
    tp_size (TP_TP) (docs/parallelism.md §1). One rank: the whole model.

    Raises ValueError naming the count and the size that does not divide it.
    """
    tp, ep = parallel.tp_size, parallel.ep_size
    for name, n, by in (("num_attention_heads", cfg.num_attention_heads, tp),
                        ("num_key_value_heads", cfg.num_key_value_heads, tp),
                        ("num_local_experts", cfg.num_local_experts, ep)):
        if n % by:
            raise ValueError(f"{name}={n} is not divisible by {by} ranks")
    if parallel.mode is ParallelismMode.TP_TP and cfg.intermediate_size % tp:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")
    r = shard_ranges(cfg, parallel)  # the one home of the split rule (parallel/shard.py reads the same)
    return LocalDims(
        num_heads=r.q_heads[1] - r.q_heads[0], num_kv_heads=r.kv_heads[1] - r.kv_heads[0],
        expert_start=r.experts[0], num_local_experts=r.experts[1] - r.experts[0],
        intermediate_size=r.intermediate[1] - r.intermediate[0])


class MiniMaxM2SparseMoeBlock(nn.Module):
    """Router (replicated, fp32) + this rank's experts; hub prefix ``block_sparse_moe.``."""

    def __init__(self, cfg: MiniMaxM2Config, dims: LocalDims, parallel: ParallelState,
                 dtype: torch.dtype | None):
        super().__init__()
        self.parallel = parallel
        self.gate = MiniMaxM2Router(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok)
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(cfg.num_local_experts, dtype=torch.float32), requires_grad=False)
        self.experts = MiniMaxM2Experts(cfg.hidden_size, dims.intermediate_size, dims.expert_start,
                                        dims.num_local_experts, dtype)

    def forward(self, h: torch.Tensor, legacy: bool = False) -> torch.Tensor:
        """h [T, H] act -> [T, H] act: route, grouped experts (here, or on their owners' ranks via
        the EP exchange), fp32 combine, partial sums reduced, one cast (docs/parallelism.md §3).
        ``legacy``: the per-active-expert loop (benchmark switch)."""
        weights, ids = self.gate(h, self.e_score_correction_bias)
        if uses_ep_exchange(self.parallel):
            rows = self.experts.rows_loop if legacy else self.experts.rows
            m = ep_moe(h, ids, weights, self.experts.num_local, rows, self.parallel)
        else:
            m = reduce_moe_partial(self.experts(h, ids, weights, legacy), self.parallel)  # [T, H] f32
        return m.to(h.dtype)


class MiniMaxM2DecoderLayer(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then x + moe(norm(x)) (docs/model.md §3 steps 1-12)."""

    def __init__(self, cfg: MiniMaxM2Config, dims: LocalDims, parallel: ParallelState,
                 dtype: torch.dtype | None):
        super().__init__()
        self.parallel = parallel
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MiniMaxM2Attention(
            cfg.hidden_size, dims.num_heads, dims.num_kv_heads, cfg.head_dim, cfg.q_size, cfg.kv_size,
            cfg.attention_multiplier, cfg.rms_norm_eps,
            reduce_qk=partial(reduce_qk_stats, parallel=parallel), dtype=dtype)
        self.block_sparse_moe = MiniMaxM2SparseMoeBlock(cfg, dims, parallel, dtype)

    def forward(self, x: torch.Tensor, step: StepContext, kv: KVStorage, layer: int) -> torch.Tensor:
        """x [T, H] act -> [T, H] act. Under TP_EP default the MoE runs on this rank's rows of the
        tokens, between a reduce_scatter and an all_gather (docs/parallelism.md §3)."""
        T = x.shape[0]
        x = attention_residual(x, self.self_attn(self.input_layernorm(x), step, kv, layer), self.parallel)
        moe = self.block_sparse_moe(self.post_attention_layernorm(x), step.legacy is not None)
        return moe_residual(x, moe, self.parallel, T)


class MiniMaxM2Model(nn.Module):
    """Embedding, decoder layers and final norm (hub prefix ``model.``)."""

    def __init__(self, cfg: MiniMaxM2Config, dims: LocalDims, parallel: ParallelState,
                 dtype: torch.dtype | None):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                                requires_grad=False)
        self.layers = nn.ModuleList(MiniMaxM2DecoderLayer(cfg, dims, parallel, dtype)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class MiniMaxM2ForCausalLM(nn.Module):
    """The MiniMax-M2 causal LM on one rank. Call ``model(batch, kv)`` -> fp32 logits [N, V].

    Build with :func:`m2serve.model.load.load_model`; the constructor only allocates
    uninitialised parameters on the current default device.
    """

    def __init__(self, cfg: MiniMaxM2Config, parallel: ParallelState | None = None,
                 dtype: torch.dtype | None = None, attention_backend: str = "auto"):
        super().__init__()
        parallel = parallel or ParallelState()
        device = torch.get_default_device()
        # chosen once (docs/kernels.md §7): "torch" (reference, CPU default) or "triton" (one kernel launch)
        self.attention_backend = resolve_attention_backend(attention_backend, device)
        self.attention_kernel = triton_kernel() if self.attention_backend == "triton" else None
        self.lower_right_masks = device.type == "cuda"  # torch backend: no materialised [n, L] mask
        self.config, self.parallel = cfg, parallel
        self.dims = local_dims(cfg, parallel)
        self.model = MiniMaxM2Model(cfg, self.dims, parallel, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self.kv_scales: tuple[list[float], list[float]] | None = None  # checkpoint fp8 KV scales
        self.rope = RopeCache(cfg.rotary_dim, cfg.rope_theta)  # cos/sin table, grown as positions grow
        self.legacy_path = False  # benchmark-only: the loop experts + padded K/V gather (module docstring)
        self.kv_scratch = GatherScratch()  # the legacy path's padded K/V buffers, reused across steps
        self.batch_invariant = False  # use_batch_invariant
        self.aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3 aux hidden states kept (set_aux_layer_ids)
        self.aux_hidden: torch.Tensor | None = None  # [T, len(ids) * H] act of the last forward

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype (that of the embedding)."""
        return self.model.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVStorage) -> torch.Tensor:
        """Run one ragged step; writes the new tokens' K/V into ``kv``.

        Returns fp32 logits [N, V] for the rows ``batch.logit_row_indices()`` (request order).
        Raises ValueError (naming the request) for a context shorter than its new tokens or a
        block table too short for its context.
        """
        step = StepContext.build(batch, kv.page_size, self.rope, self.dtype,
                                 self.kv_scratch if self.legacy_path else None,
                                 None if self.legacy_path else self.attention_kernel, self.lower_right_masks)
        return self._run(batch.tokens, step, kv)

    def _run(self, tokens: torch.Tensor, step: StepContext, kv: KVStorage) -> torch.Tensor:
        x = F.embedding(tokens, self.model.embed_tokens.weight)  # [T, H] act
        aux = {}
        for layer, block in enumerate(self.model.layers):
            if layer in self.aux_layer_ids:
                aux[layer] = x
            x = block(x, step, kv, layer)
        if aux:   # in the order of the ids (the EAGLE-3 fc's input blocks, docs/serving.md §14)
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layer_ids], -1)
        if step.logit_rows is not None:
            x = x.index_select(0, step.logit_rows)
        x = self.model.norm(x)  # [N, H]
        if self.lm_head is None:
            return dense_linear(x, self.model.embed_tokens.weight, self.batch_invariant).float()  # tied
        return self.lm_head(x).float()  # [N, V] f32

    @torch.inference_mode()
    def forward_decode(self, inputs: DecodeInputs, kv: KVStorage, cos_table: torch.Tensor,
                       sin_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
        """One static decode step (docs/serving.md §6.3): b rows of one token each, read from the
        fixed-address views ``inputs`` (model/cuda_graphs.py), RoPE from the fixed tables
        ``cos_table`` / ``sin_table`` [>= max_context_len, R/2] f32, the triton attention kernel
        sized by ``max_context_len``. Nothing is built from host data, so the step can be
        recorded in a CUDA graph and replayed. Writes the rows' K/V into ``kv``; returns fp32
        logits [b, V], one per row, padding rows included. Raises ValueError on the torch
        attention backend (its per-request loop reads host lists)."""
        if self.attention_kernel is None:
            raise ValueError("forward_decode needs attention_backend='triton' (the torch backend "
                             "loops over the requests on the host)")
        step = StepContext.for_decode(inputs, cos_table, sin_table, self.attention_kernel, max_context_len)
        return self._run(inputs.tokens, step, kv)

    def set_aux_layer_ids(self, ids: tuple[int, ...]) -> None:
        """Keep, from every later forward, the residual stream entering each layer of ``ids`` (an
        EAGLE-3 draft's auxiliary hidden states, docs/serving.md §14; 0 = the embedding output) as
        ``self.aux_hidden`` [T, len(ids) * H] in the activation dtype, all T tokens of the step, the
        blocks in the order of ``ids``. Set once after load; ``()`` turns it off. Raises ValueError
        naming aux_layer_ids for ids outside [0, num_hidden_layers) or repeated."""
        L = self.config.num_hidden_layers
        ids = tuple(ids)
        if len(set(ids)) != len(ids) or not all(isinstance(i, int) and 0 <= i < L for i in ids):
            raise ValueError(f"aux_layer_ids={list(ids)}: must be distinct layers in [0, {L})")
        self.aux_layer_ids, self.aux_hidden = ids, None

    def rope_table(self, n: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [n, R/2] f32 of positions [0, n) on ``device``, computed as the forward's
        (a table of its own: the model's RopeCache may be replaced as positions grow)."""
        return self.rope.table(n, device)

    def use_batch_invariant(self) -> None:
        """Switch to the batch-invariant mode (docs/model.md §7), once after load: every reduction
        whose order could depend on the other rows of a step (linears, lm_head, router, experts)
        takes a path that computes each row alone. Norms, attention (one call per request) and the
        sampler (row-wise, counter-based draws) already do. Raises ValueError on the triton
        attention backend (its split-K count depends on the whole step)."""
        if self.attention_kernel is not None:
            raise ValueError("batch_invariant: needs attention_backend='torch' (the triton kernel's "
                             "split-K count depends on the whole step)")
        self.batch_invariant = True
        for module in self.modules():
            if isinstance(module, (Linear, MiniMaxM2Router)):
                module.batch_invariant = True
            elif isinstance(module, MiniMaxM2Experts):
                module.use_batch_invariant()

    def load_weight(self, name: str, tensor: torch.Tensor | PackedFP4 | PackedFP8) -> None:
        """Copy hub tensor ``name`` (this rank's slice) into its parameter; quantised linears may
        come as stored (``weight_dequant="runtime"``, model/load.py).

        Raises ValueError naming the tensor and both shapes on a mismatch (or a packed tensor for a
        weight that cannot hold one), KeyError if unknown.
        """
        m = _EXPERT.match(name)
        if m:
            moe = self.model.layers[int(m.group(1))].block_sparse_moe
            moe.experts.load_expert(int(m.group(2)), m.group(3), tensor)
            return
        module_name, _, leaf = name.rpartition(".")
        module = self.get_submodule(module_name) if module_name else self
        if isinstance(module, Linear) and leaf == "weight":
            module.load(name, tensor)
            return
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: a quantised tensor for a weight held dense only")
        param = self.get_parameter(name)
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: got shape {list(tensor.shape)}, this rank expects {list(param.shape)}")
        param.data.copy_(tensor)
