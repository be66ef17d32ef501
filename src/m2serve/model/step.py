"""The step context: everything a forward needs, built once per step from host lists.

Legend: T new tokens in the step, B requests, N returned logit rows, S page size, R rotary_dim,
n_b / L_b new tokens / context (cached + new) of request b.

``MiniMaxM2ForCausalLM.forward`` builds one :class:`StepContext` from the batch's :class:`StepHost`
lists and hands it to every layer (STYLE.md habit 4: no global context). Sizes, spans and page
lists come from Python ints; device tensors are made from them by host-to-device copies (pinned,
``non_blocking`` on CUDA), and the per-request causal masks are built here, once, for all layers.
Nothing in the forward reads a device value back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m2serve.model.attention import AttentionMetadata, GatherScratch
from m2serve.model.batch import ForwardBatch, StepHost, host_tensor
from m2serve.model.rope import rope_inv_freq

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
            inv_freq = rope_inv_freq(self.rotary_dim, self.theta, device=dev)
            phi = torch.arange(n, device=dev).float()[:, None] * inv_freq[None, :]
            self.cos, self.sin = phi.cos(), phi.sin()
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


@dataclass(slots=True)
class StepContext:
    """One step's metadata, shared by every layer (built by :meth:`build`, read-only afterwards).

    host:         the step's layout as Python ints (spans, contexts, page lists, logit rows).
    positions:    int64 [T]; slot_mapping int64 [T] (page * S + offset of each new token's K/V).
    cos, sin:     [T, R/2] f32 RoPE angles of each new token (from the model's RopeCache).
    logit_rows:   int64 [N] indices into [T] of the returned rows.
    page_ids:     int64 [Σ_b ceil(L_b / S)] each request's pages, concatenated in request order;
                  request b's are ``page_ids[page_starts[b]:page_starts[b+1]]`` (host ints).
    masks:        per request: None (one new token, or a chunk starting at position 0, which
                  uses SDPA's ``is_causal``) or an additive mask [n_b, L_b] of the activation
                  dtype, 0 where new token i may see key j (j <= L_b - n_b + i), -inf elsewhere.
    legacy:       the padded-gather metadata when the model's ``legacy_path`` is on (benchmark
                  switch, model/decoder.py), else None.
    """

    host: StepHost
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    logit_rows: torch.Tensor
    page_ids: torch.Tensor
    page_starts: list[int]
    masks: list[torch.Tensor | None]
    legacy: AttentionMetadata | None = None

    @classmethod
    def build(cls, batch: ForwardBatch, page_size: int, rope: RopeCache, dtype: torch.dtype,
              legacy_scratch: GatherScratch | None = None) -> StepContext:
        """The context of ``batch`` with KV pages of ``page_size`` and activations of ``dtype``.

        ``legacy_scratch`` (not None = legacy path) also builds the padded [B, Lk] metadata of the
        previous attention (it reads device values back; benchmark only). Raises ValueError (from
        :meth:`StepHost.check`) for a context shorter than its new tokens or a block table too
        short for its context.
        """
        host = batch.host
        host.check(page_size)
        dev = batch.tokens.device
        pages: list[int] = []
        page_starts = [0]
        masks: list[torch.Tensor | None] = []
        for n, L, table in zip(host.query_lens, host.context_lens, host.block_tables, strict=True):
            pages.extend(table[: -(-L // page_size)])
            page_starts.append(len(pages))
            if n <= 1 or n == L:
                masks.append(None)
            else:  # -inf strictly above diagonal L - n: key j > (L - n) + i is in the future
                masks.append(torch.full((n, L), float("-inf"), dtype=dtype, device=dev).triu_(L - n + 1))
        max_position = max(host.context_lens, default=1) - 1
        cos, sin = rope.lookup(batch.positions, max(max_position, 0))
        legacy = None
        if legacy_scratch is not None:
            inv_freq = rope_inv_freq(rope.rotary_dim, rope.theta, device=dev)
            legacy = AttentionMetadata.from_batch(batch, page_size, inv_freq, legacy_scratch)
        return cls(host=host, positions=batch.positions, slot_mapping=batch.slot_mapping.to(torch.int64),
                   cos=cos, sin=sin, logit_rows=host_tensor(host.logit_rows, torch.int64, dev),
                   page_ids=host_tensor(pages, torch.int64, dev), page_starts=page_starts, masks=masks,
                   legacy=legacy)

    def request_pages(self, b: int) -> torch.Tensor:
        """int64 [ceil(L_b / S)]: request b's page ids (a view)."""
        return self.page_ids[self.page_starts[b]: self.page_starts[b + 1]]
