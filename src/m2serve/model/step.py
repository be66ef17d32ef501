"""The step context: everything a forward needs, built once per step from host lists.

Legend: T new tokens in the step, B requests, N returned logit rows, S page size, R rotary_dim,
n_b / L_b new tokens / context (cached + new) of request b.

``MiniMaxM2ForCausalLM.forward`` builds one :class:`StepContext` from the batch's :class:`StepHost`
lists and hands it to every layer (STYLE.md habit 4: no global context). Sizes, spans and page
lists come from Python ints; device tensors are made from them by host-to-device copies (pinned,
``non_blocking`` on CUDA). Nothing in the forward reads a device value back.

The attention backend (docs/kernels.md §7) decides what is built. ``triton``: nothing per request;
the kernel reads the batch's block tables, query starts and context lengths (int32, already on the
device: with the runner's persistent buffers they arrived in the step's one copy), so the step's
op count does not depend on the batch. ``torch`` (the reference): each request's page ids,
concatenated, and per request a causal mask for a prefill chunk after a cached prefix, built here
once for all layers: an additive [n_b, L_b] mask on CPU, ``causal_lower_right(n_b, L_b)`` (no
materialised mask) when ``lower_right`` (the model sets it on CUDA).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from m2serve.model.attention import AttentionMetadata, GatherScratch
from m2serve.model.batch import ForwardBatch, StepHost, host_tensor
from m2serve.model.rope import rope_inv_freq

if TYPE_CHECKING:  # imported where used: torch.nn.attention.bias imports triton, which must not load
    from torch.nn.attention.bias import CausalBias  # before kernels/triton sets its interpreter flag

    from m2serve.model.cuda_graphs import DecodeInputs

ROPE_MIN_POSITIONS = 4096  # smallest RoPE table; it doubles past the largest position seen


@dataclass(slots=True)
class RopeCache:
    """cos / sin of positions [0, len) for one rotary_dim and θ, kept on the model across steps.

    Rows are ``cos(p · inv_freq)`` computed exactly as :func:`m2serve.model.rope.rope_cos_sin`
    (so a lookup equals a fresh computation bit for bit); the table grows by doubling.
    """

    rotary_dim: int
    theta: float
    cos: torch.Tensor | None = None  # [len, R/2] f32
    sin: torch.Tensor | None = None

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] (all <= ``max_position``, a host int) -> (cos, sin) [T, R/2] f32."""
        dev = positions.device
        if self.cos is None or self.cos.shape[0] <= max_position or self.cos.device != dev:
            n = ROPE_MIN_POSITIONS
            while n <= max_position:
                n *= 2
            self.cos, self.sin = self.table(n, dev)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def table(self, n: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A new (cos, sin) table of positions [0, n), each [n, R/2] f32 on ``device`` (rows equal
        :meth:`lookup`'s for any table size: each is computed from its own position only)."""
        inv_freq = rope_inv_freq(self.rotary_dim, self.theta, device=device)
        phi = torch.arange(n, device=device).float()[:, None] * inv_freq[None, :]
        return phi.cos(), phi.sin()


@dataclass(slots=True)
class StepContext:
    """One step's metadata, shared by every layer (built by :meth:`build`, read-only afterwards).

    host:         the step's layout as Python ints (spans, contexts, page lists, logit rows); None
                  on a static decode step (:meth:`for_decode`).
    positions:    int64 [T]; slot_mapping int64 [T] (page * S + offset of each new token's K/V).
    cos, sin:     [T, R/2] f32 RoPE angles of each new token (from the model's RopeCache).
    logit_rows:   int64 [N] indices into [T] of the returned rows (None: every row).
    page_ids:     int64 [Σ_b ceil(L_b / S)] each request's pages, concatenated in request order;
                  request b's are ``page_ids[page_starts[b]:page_starts[b+1]]`` (host ints).
    page_runs:    per request, ``slice(p, p + n)`` when its n pages are the consecutive ids
                  p .. p + n - 1 (the pool is then read as a view, no gather), else None.
    masks:        per request: None (one new token, or a chunk starting at position 0, which
                  uses SDPA's ``is_causal``) or an additive mask [n_b, L_b] of the activation
                  dtype, 0 where new token i may see key j (j <= L_b - n_b + i), -inf elsewhere.
    legacy:       the padded-gather metadata when the model's ``legacy_path`` is on (benchmark
                  switch, model/decoder.py), else None.
    kernel:       the triton backend's paged attention launcher (kernels/triton/attention.py
                  ``paged_attention``), None on the torch backend (then page_ids / masks are set;
                  under triton they are empty).
    block_tables, query_starts, context_lens: the batch's int32 [B, W], [B+1], [B] device tensors.
    max_query_len, max_context_len: host ints (the kernel's tile and split choice).
    """

    host: StepHost | None
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    logit_rows: torch.Tensor | None
    page_ids: torch.Tensor
    page_starts: list[int]
    masks: list[torch.Tensor | None]
    page_runs: list[slice | None] = field(default_factory=list)
    legacy: AttentionMetadata | None = None
    kernel: Callable[..., torch.Tensor] | None = None
    block_tables: torch.Tensor | None = None
    query_starts: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_query_len: int = 0
    max_context_len: int = 0

    @classmethod
    def build(cls, batch: ForwardBatch, page_size: int, rope: RopeCache, dtype: torch.dtype,
              legacy_scratch: GatherScratch | None = None, kernel: Callable[..., torch.Tensor] | None = None,
              lower_right: bool = False) -> StepContext:
        """The context of ``batch`` with KV pages of ``page_size`` and activations of ``dtype``.

        ``kernel`` (not None = triton backend) skips the per-request pages and masks;
        ``lower_right`` (torch backend) gives a chunk after a cached prefix a
        ``torch.nn.attention.bias.causal_lower_right`` bias instead of a materialised mask.
        ``legacy_scratch`` (not None = legacy path) also builds the padded [B, Lk] metadata of the
        previous attention (it reads device values back; benchmark only). Raises ValueError (from
        :meth:`StepHost.check`, a no-op when the runner already checked) for a context shorter than
        its new tokens or a block table too short for its context.
        """
        host = batch.host
        host.check(page_size)
        dev = batch.tokens.device
        qs, ctx = host.query_starts, host.context_lens
        pages: list[int] = []
        page_starts = [0]
        page_runs: list[slice | None] = []
        masks: list[torch.Tensor | CausalBias | None] = []
        if lower_right:
            from torch.nn.attention.bias import causal_lower_right
        if kernel is None:
            for n, L, table in zip(host.query_lens, ctx, host.block_tables, strict=True):
                mine = table[: -(-L // page_size)]
                pages.extend(mine)
                page_starts.append(len(pages))
                page_runs.append(slice(mine[0], mine[0] + len(mine))
                                 if mine and mine == list(range(mine[0], mine[0] + len(mine))) else None)
                if n <= 1 or n == L:
                    masks.append(None)
                elif lower_right:
                    masks.append(causal_lower_right(n, L))
                else:  # -inf strictly above diagonal L - n: key j > (L - n) + i is in the future
                    masks.append(torch.full((n, L), float("-inf"), dtype=dtype, device=dev).triu_(L - n + 1))
        max_context = max(ctx, default=0)
        cos, sin = rope.lookup(batch.positions, max(max_context - 1, 0))
        legacy = None
        if legacy_scratch is not None:
            inv_freq = rope_inv_freq(rope.rotary_dim, rope.theta, device=dev)
            legacy = AttentionMetadata.from_batch(batch, page_size, inv_freq, legacy_scratch)
        rows = batch.logit_rows
        if rows is None:
            rows = host_tensor(host.logit_rows, torch.int64, dev)
        slots = batch.slot_mapping if batch.slot_mapping.dtype == torch.int64 else batch.slot_mapping.long()
        return cls(host=host, positions=batch.positions, slot_mapping=slots, cos=cos, sin=sin,
                   logit_rows=rows,
                   page_ids=host_tensor(pages, torch.int64, dev) if kernel is None else batch.positions[:0],
                   page_starts=page_starts, page_runs=page_runs, masks=masks, legacy=legacy,
                   kernel=kernel,
                   block_tables=batch.block_tables, query_starts=batch.input_row_offsets,
                   context_lens=batch.context_lens,
                   max_query_len=max(map(operator.sub, qs[1:], qs[:-1]), default=0),
                   max_context_len=max_context)

    @classmethod
    def for_decode(cls, inputs: DecodeInputs, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   kernel: Callable[..., torch.Tensor], max_context_len: int) -> StepContext:
        """The context of a static decode step (model/cuda_graphs.py, docs/serving.md §6.3): every
        tensor a view of ``inputs`` or gathered from the fixed RoPE tables ``cos_table`` /
        ``sin_table`` [>= max_context_len, R/2] f32; no host list, no copy from the host. The
        kernel's tile and split count follow ``max_context_len`` (the engine's max_length) and the
        bucket, never the step's contexts, so a graph recorded once stays valid. ``host`` is None
        and ``logit_rows`` covers every row (padding rows' logits are dropped by the caller)."""
        pos = inputs.positions
        return cls(host=None, positions=pos, slot_mapping=inputs.slot_mapping,
                   cos=cos_table.index_select(0, pos), sin=sin_table.index_select(0, pos),
                   logit_rows=None, page_ids=pos[:0], page_starts=[], masks=[], kernel=kernel,
                   block_tables=inputs.block_tables, query_starts=inputs.query_starts,
                   context_lens=inputs.context_lens, max_query_len=1, max_context_len=max_context_len)

    def request_pages(self, b: int) -> torch.Tensor | slice:
        """Request b's pages: ``slice(p, p + n)`` when they are consecutive ids (``page_runs``),
        else int64 [ceil(L_b / S)] page ids (a view of ``page_ids``)."""
        run = self.page_runs[b] if b < len(self.page_runs) else None
        return run if run is not None else self.page_ids[self.page_starts[b]: self.page_starts[b + 1]]
