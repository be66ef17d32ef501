"""EAGLE-3 drafting inside the engine step (docs/serving.md §14, "Drafting in the engine").

After the target's forward (plain, prefill chunk or K + 1-row verification) and its update, every
scheduled request that is still running hands the draft the positions whose tokens are now known:
positions [c, c + m) (c = its computed tokens before the step, m = the tokens the step kept:
the chunk, or the last token and the accepted drafts), draft input at position i = embedding of
token i + 1 ++ fc(the target's aux hidden states at i). The draft's K/V go to its own layer of the
engine's pool (index ``layer``: the pool's last, after the target's), at the target's slots, so
they follow the request's block table, prefix cache, trim and free. A request whose chunk
completed its sequence then drafts K tokens autoregressively, each pass one token per request at
the next position with the draft's own previous hidden state; the proposal (tokens and the draft
distribution q of each over the target vocabulary) waits on the request for the next schedule
(engine/scheduler.py ``_draft``).

Every pass is one batched draft forward over all requests (model/eagle3.py ``forward_paged``,
metadata from the host lists through model/batch.py ``ragged_batch`` into the drafter's own
persistent ``StepBuffers``: one copy per pass); the host work is building those lists, as for the
target's step.

Legend: B requests drafting, K drafted tokens, V target vocabulary, Vd the draft's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m2serve.engine.kv_cache import KVCacheManager
from m2serve.engine.request import Request
from m2serve.engine.sampling import GREEDY_EPS, SamplingState, counter_uniforms
from m2serve.engine.speculative import DRAFT_STREAM, stream_seed
from m2serve.model.batch import KVStorage, StepBuffers, ragged_batch
from m2serve.model.eagle3 import Eagle3Draft
from m2serve.model.step import RopeCache


@dataclass(slots=True)
class DraftProposal:
    """A request's drafted tokens for its next step: ``tokens`` (K target ids), ``probs`` f32
    [K, V] (q: row i the draft distribution token i was drawn from, one-hot for a greedy request;
    None when every request of that draft run was greedy: the identity rule verifies greedy drafts
    without q) and ``num_tokens``, the request's length they continue (stale once the request moved)."""

    tokens: list[int]
    probs: torch.Tensor | None
    num_tokens: int


@dataclass(slots=True)
class DraftSpan:
    """One request's share of the draft's first pass: ``request``, its positions
    [start, start + length), its first row in the target step's aux hidden states, and whether it
    drafts after (its chunk completed the sequence and it still runs)."""

    request: Request
    start: int
    length: int
    aux_row: int
    propose: bool


def is_greedy(state: SamplingState) -> bool:
    """Whether every draw of the request is greedy (temperature and thinking_temperature, when
    set, below GREEDY_EPS): its drafts are the draft's argmax and the identity rule verifies them
    (docs/serving.md §13); otherwise it drafts by sampling q and the rejection rule verifies."""
    p = state.params
    t = p.temperature if p.temperature is not None else 1.0
    return t < GREEDY_EPS and (p.thinking_temperature is None or p.thinking_temperature < GREEDY_EPS)


@dataclass(slots=True)
class Eagle3Drafter:
    """Runs an :class:`Eagle3Draft` on the engine's pages (module docstring).

    draft: the loaded draft; layer: its K/V layer in the pool; num_speculative_tokens: K;
    kernel / lower_right: the target's attention backend choices (chosen once at construction).
    """

    draft: Eagle3Draft
    layer: int
    num_speculative_tokens: int
    kernel: object = None
    lower_right: bool = False
    buffers: StepBuffers | None = None
    query_buffers: StepBuffers | None = None
    rope: RopeCache | None = None
    passes: int = 0   # draft forwards run (tests)

    def __post_init__(self) -> None:
        c = self.draft.config
        self.rope = RopeCache(c.head_dim, c.rope_theta)

    def _forward(self, new_tokens: list[list[int]], ctx: list[int], tables: list[list[int]],
                 n_logits: list[int], hidden: torch.Tensor, kv: KVStorage
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass (model/eagle3.py ``forward_paged``); (logits [N, Vd] f32, r2 [N, H]) at the
        last ``n_logits[b]`` (0 or 1) rows of each request. A pass with a span longer than a
        verification's K + 1 rows (a prompt chunk), or with no logits at all, computes only K/V for the
        rows without logits."""
        batch = ragged_batch(new_tokens, ctx, tables, n_logits, kv.page_size, hidden.device,
                             buffers=self.buffers)
        query = None
        keep = [b for b, n in enumerate(n_logits) if n]
        split = not keep or max(len(t) for t in new_tokens) > self.num_speculative_tokens + 1
        if split and keep:
            query = ragged_batch([new_tokens[b][-1:] for b in keep], [ctx[b] for b in keep],
                                 [tables[b] for b in keep], [1] * len(keep), kv.page_size, hidden.device,
                                 buffers=self.query_buffers)
        self.passes += 1
        return self.draft.forward_paged(batch, hidden, kv, self.layer, self.rope,  # type: ignore[arg-type]
                                        self.kernel, self.lower_right, query, split)  # type: ignore[arg-type]

    @torch.inference_mode()
    def run(self, spans: list[DraftSpan], aux: torch.Tensor, kv: KVStorage, kvm: KVCacheManager) -> None:
        """The draft's passes for one step. ``aux``: the target step's aux hidden states [T, 3 Ht]
        (rows in batch order); ``kv``: the pool (the draft's layer included); ``kvm``: the page
        allocator, asked for the pages the chain passes write into (up to num_tokens + K - 2
        tokens; a request that cannot get them proposes nothing this step). Sets each span's
        ``request.draft_proposal`` (None when it does not propose)."""
        K = self.num_speculative_tokens
        spans = [s for s in spans if s.length > 0]
        for s in spans:
            r = s.request
            r.draft_proposal = None
            if s.propose and not kvm.allocate(r.request_id, r.num_tokens + K - 2):
                s.propose = False
        if not spans:
            return
        rows = [s.aux_row + i for s in spans for i in range(s.length)]
        hidden = aux.index_select(0, torch.tensor(rows, dtype=torch.int64, device=aux.device))
        tables = [kvm.block_table(s.request.request_id) for s in spans]
        nxt = [s.request.all_token_ids[s.start + 1:s.start + s.length + 1] for s in spans]
        logits, r2 = self._forward(nxt, [s.start + s.length for s in spans], tables,
                                   [int(s.propose) for s in spans], hidden, kv)
        mine = [b for b, s in enumerate(spans) if s.propose]
        if not mine:
            return
        reqs = [spans[b].request for b in mine]
        hidden = r2                                                     # [B, H], the spans' last rows
        tables = [tables[b] for b in mine]
        ctx = [spans[b].start + spans[b].length for b in mine]          # = num_tokens - 1
        targets = self.draft.draft_to_target
        greedy_host = [is_greedy(r.state) for r in reqs]
        sampled = not all(greedy_host)   # all greedy: argmax drafts, no q (the identity rule needs none)
        if sampled:
            greedy = torch.tensor(greedy_host, device=logits.device)
            temps = torch.tensor([max(r.state.temperature, GREEDY_EPS) for r in reqs], device=logits.device)
            seeds = torch.tensor([stream_seed(r.state.seed, DRAFT_STREAM) for r in reqs], dtype=torch.int64,
                                 device=logits.device)
            out_pos = torch.tensor([r.num_output_tokens for r in reqs], dtype=torch.int64,
                                   device=logits.device)
        V = self.draft.config.vocab_size
        toks: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for j in range(K):
            if sampled:
                q = torch.softmax(logits / temps.unsqueeze(1), dim=-1)                    # [B, Vd]
                hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1]).float()
                q = torch.where(greedy.unsqueeze(1), hot, q)
                u = counter_uniforms(seeds, out_pos + j)
                cdf = q.double().cumsum(1)
                pick = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True)
                pick = pick.clamp_(max=q.shape[1] - 1).squeeze(1)                           # draft ids [B]
                full = q.new_zeros(q.shape[0], V)
                full[:, targets] = q
                probs.append(full)
            else:
                pick = logits.argmax(dim=-1)                                                # draft ids [B]
            toks.append(targets[pick])
            if j == K - 1:
                break
            ids = toks[-1].tolist()
            logits, hidden = self._forward([[t] for t in ids], [c + j + 1 for c in ctx], tables,
                                           [1] * len(ids), hidden, kv)
        tok_lists = torch.stack(toks, 1).tolist()                                           # [B, K]
        q_all = torch.stack(probs, 1) if sampled else None                                  # [B, K, V]
        for b, r in enumerate(reqs):
            q_b = None if q_all is None else q_all[b]
            r.draft_proposal = DraftProposal(tok_lists[b], q_b, r.num_tokens)
