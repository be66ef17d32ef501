"""Continuous batching: which requests compute how many tokens in the next step.

There is no prefill or decode phase (vLLM v1's invariant): each request's
``num_computed_tokens`` catches up with its ``num_tokens``. A step gives running requests their
next chunk first (a decode is a chunk of one), oldest first, then admits waiting requests, while
ALL tokens of the step stay within ``max_batch_input_tokens`` (docs/serving.md §8) and at most
``max_batch_size`` requests run. A prompt longer than the remaining budget is chunked across steps.
When the KV pool runs out, the newest running request is preempted: its pages are freed and it goes
back to the front of the waiting queue with ``num_computed_tokens = 0`` (recompute; its generated
tokens are kept, so the final output is unchanged).

After the model, :meth:`Scheduler.update_from_output` is the one place that moves a request on
(as vLLM v1's and nano-vllm's schedulers): it advances ``num_computed_tokens``, registers full
pages in the prefix cache, appends each drawn token to the request's token list and to the
penalty counts, updates the reasoning state and the constraint, decides finish (eos,
stop_token_ids, a terminated constraint, max_tokens, the max context) and frees finished
requests. Stop strings are matched above the engine (serve/output.py), which aborts the request.

With speculative decoding (docs/serving.md §13) a running request one token behind (a decode)
also gets up to K drafted tokens (engine/speculative.py ``NgramIndex``, the request's index that
gives ``propose_ngram``'s drafts; with an EAGLE-3 draft the proposal the draft left on the
request after the last step, engine/eagle.py, docs/serving.md §14), computed in the same
chunk: its KV pages are allocated for them once every running request has its own chunk's pages
(never at the price of a preemption or of another request's page: a draft that does not fit is
dropped), the update appends the accepted drafts and the target's next token, and pages
past the kept tokens are released (``KVCacheManager.trim``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from m2serve.config.engine_args import SpeculativeConfig
from m2serve.engine.kv_cache import KVCacheManager
from m2serve.engine.request import Request, RequestStatus
from m2serve.engine.sampling import PenaltyState, SamplerOutput
from m2serve.engine.speculative import NgramIndex

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed, num_computed + num_new).

    draft_token_ids: the K drafted tokens of a speculative decode (docs/serving.md §13), the last K
    of the ``num_new_tokens`` computed (positions num_tokens .. num_tokens + K - 1, not yet in the
    request's token list); empty otherwise.
    """

    request: Request
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the request's last token (its logits give the next one)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids) == r.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """What to run in one step, in batch order, plus the requests preempted while building it."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        """T, the tokens computed in this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


def choose_replica(schedulers: list[Scheduler], request: Request) -> int:
    """The data-parallel replica that admits ``request`` (docs/serving.md §8, replica admission).

    The replica whose prefix cache holds the longest prefix of its tokens, when that replica has
    room (:meth:`Scheduler.has_room_for`); else the least loaded one by
    :attr:`Scheduler.load_tokens`; ties go to the lowest index. With one replica: 0.
    """
    if len(schedulers) == 1:
        return 0
    hits = [s.cached_prefix_pages(request) for s in schedulers]
    best = max(range(len(schedulers)), key=lambda i: (len(hits[i]), -i))
    if hits[best] and schedulers[best].has_room_for(request, hits[best]):
        return best
    loads = [s.load_tokens for s in schedulers]
    return loads.index(min(loads))


@dataclass(slots=True)
class SchedulerStats:
    """Counters: steps that split a prompt, preemptions, scheduled steps, generated tokens; and of
    speculative decoding (docs/serving.md §13): drafts verified (requests x steps with a draft),
    tokens drafted, drafted tokens accepted, and accepted_per_pos[i] the drafts accepted at draft
    position i (0-based, grown as needed)."""

    chunked_prefill_steps: int = 0
    preemptions: int = 0
    steps: int = 0
    generated_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Scheduler:
    """Waiting and running queues over a `KVCacheManager` (docs/serving.md §8).

    max_batch_input_tokens: budget of tokens per step (prefill chunks and decodes alike);
    max_batch_size: most running requests (clamped to the token budget, as in MAX);
    penalties: the sampler's batched penalty counts (rows taken at :meth:`add` for requests with
    penalties, released at :meth:`finish`); None = no request may ask for penalties;
    speculative: n-gram drafting for decodes (docs/serving.md §13), None = off.
    """

    kv: KVCacheManager
    max_batch_input_tokens: int
    max_batch_size: int
    penalties: PenaltyState | None = None
    speculative: SpeculativeConfig | None = None
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def __post_init__(self) -> None:
        if self.max_batch_input_tokens <= 0:
            raise ValueError(f"max_batch_input_tokens={self.max_batch_input_tokens} must be positive")
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be positive")
        self.max_batch_size = min(self.max_batch_size, self.max_batch_input_tokens)

    def add(self, request: Request) -> None:
        """Queue a new request (validated by the engine); a request with penalties gets its row.
        Raises ValueError for penalties without a `PenaltyState`."""
        if request.state.needs_penalties:
            if self.penalties is None:
                raise ValueError(f"request {request.request_id!r} asks for penalties but the scheduler "
                                 "has no PenaltyState; build it with penalties=PenaltyState(vocab_size)")
            request.state.penalty_row = self.penalties.add(request.prompt_token_ids, request.output_token_ids)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """Any request waiting or running."""
        return bool(self.waiting or self.running)

    @property
    def load_tokens(self) -> int:
        """Tokens of the requests waiting and running here (prompt + generated so far): the load
        that :func:`choose_replica` balances."""
        return sum(r.num_tokens for r in self.waiting) + sum(r.num_tokens for r in self.running)

    def cached_prefix_pages(self, request: Request) -> list[int]:
        """Ids of the pages of ``request``'s tokens this replica's prefix cache holds (none when the
        request asks for prompt logprobs: those are computed, never served from the cache)."""
        if request.sampling_params.prompt_logprobs is not None:
            return []
        return self.kv.find_cached_prefix(request.all_token_ids)[0]

    def has_room_for(self, request: Request, cached_pages: list[int]) -> bool:
        """Whether this replica could admit ``request`` next to what it holds: fewer requests than
        ``max_batch_size`` waiting and running, and free pages for the part of its tokens not in the
        cached pages ``cached_pages`` (a cached page held by a running request is shared and needs
        no free page: :meth:`KVCacheManager.can_allocate`; docs/serving.md §8, replica admission)."""
        if len(self.running) + len(self.waiting) >= self.max_batch_size:
            return False
        return self.kv.can_allocate(request.request_id, request.num_tokens, cached_pages)

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's chunks; may preempt (see the module docstring)."""
        budget = self.max_batch_input_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()   # newest; never one already scheduled (index < i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
                continue
            break

        # Drafts only once every running request has its own chunk's pages, so that a draft never
        # takes the page a later request's token needs (no preemption for a draft, docs/serving.md §13)
        for j, s in enumerate(scheduled):
            req = s.request
            drafts = self._draft(req, budget) if s.num_new_tokens == 1 and s.completes else []
            if drafts and self.kv.allocate(req.request_id, req.num_tokens + len(drafts)):
                scheduled[j] = ScheduledRequest(req, 1 + len(drafts), drafts)
                budget -= len(drafts)

        # Admit waiting requests only when nothing had to be preempted (memory is tight).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            prefix = ([], [])
            if req.sampling_params.prompt_logprobs is None:
                prefix = self.kv.find_cached_prefix(req.all_token_ids)
            num_hit = len(prefix[0]) * self.kv.page_size
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate(req.request_id, num_hit + n, prefix):
                break
            self.waiting.popleft()
            self.kv.record_prefix_query(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n))
            budget -= n

        self.stats.steps += bool(scheduled)
        if any(not s.completes for s in scheduled):
            self.stats.chunked_prefill_steps += 1
        return SchedulerOutput(scheduled, preempted)

    def _draft(self, req: Request, room: int) -> list[int]:
        """Drafted tokens for a decode of ``req`` (docs/serving.md §13): at most K, at most ``room``
        (the step's token budget left), and never past max_tokens or the max context (the step
        emits at most drafts + 1 tokens)."""
        spec = self.speculative
        if spec is None or room <= 0:
            return []
        p = req.sampling_params
        k = min(spec.num_speculative_tokens, room, req.max_length - req.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - req.num_output_tokens - 1)
        if k <= 0:
            return []
        if spec.method == "eagle3":   # the draft's proposal of the last step (engine/eagle.py)
            prop = req.draft_proposal
            return list(prop.tokens[:k]) if prop is not None and prop.num_tokens == req.num_tokens else []
        if req.ngram_index is None:
            req.ngram_index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return req.ngram_index.propose(req.all_token_ids, k)

    def update_from_output(self, scheduled: list[ScheduledRequest], sampled: SamplerOutput,
                           num_accepted: Sequence[int] | None = None) -> list[Request]:
        """Apply one step's results (see the module docstring); returns the requests that got a
        token, in batch order (finished ones have ``is_finished`` set and are already freed).

        ``scheduled`` is the step's `SchedulerOutput.scheduled` as run, with ``num_computed_tokens``
        not yet advanced; ``sampled`` holds the tokens (and logprobs entries) of the scheduled
        requests whose chunk completed its sequence, in the same order: one each, or with
        ``num_accepted`` (one count per such request, docs/serving.md §13) ``1 + num_accepted[j]``
        for request j, its accepted drafts then the target's next token. The tokens are applied one
        at a time as plain decoding would (penalty counts, reasoning state, constraint, finish), and
        the ones after a token that finishes the request are dropped. Raises ValueError when the
        counts differ.
        """
        done_s = [s for s in scheduled if s.completes]   # read before num_computed moves
        done = [s.request for s in done_s]
        acc = list(num_accepted) if num_accepted is not None else [0] * len(done)
        if len(acc) != len(done) or len(sampled.token_ids) != len(done) + sum(acc):
            raise ValueError(f"update_from_output: {len(sampled.token_ids)} sampled tokens for "
                             f"{len(done)} requests whose chunk completed (accepted drafts {acc}); "
                             "sample exactly those rows")
        for s in scheduled:
            if not s.draft_token_ids:
                r = s.request
                r.num_computed_tokens += s.num_new_tokens
                self.kv.cache_full_pages(r.request_id, r.all_token_ids, r.num_computed_tokens)
        o = 0
        pen_rows: list[int] = []
        pen_ids: list[int] = []
        for s, r, a in zip(done_s, done, acc, strict=True):
            toks, lps = sampled.token_ids[o:o + 1 + a], sampled.logprobs[o:o + 1 + a]
            o += 1 + a
            if s.draft_token_ids:
                self._count_draft(len(s.draft_token_ids), a)
            for t, lp in zip(toks, lps, strict=True):
                if r.state.penalty_row:
                    pen_rows.append(r.state.penalty_row)
                    pen_ids.append(t)
                r.all_token_ids.append(t)
                self.stats.generated_tokens += 1
                if r.sampling_params.logprobs is not None:
                    r.logprobs.append(lp)
                r.state.observe(t)
                if r.constraint is not None:
                    r.constraint.accept_token(t)
                reason = self._finish_reason(r, t)
                if reason is not None:
                    self.finish(r, reason)
                    break
            if s.draft_token_ids and not r.is_finished:
                # the last token and the accepted drafts have K/V; rejected drafts' slots are released
                r.num_computed_tokens += s.num_new_tokens - len(s.draft_token_ids) + a
                self.kv.cache_full_pages(r.request_id, r.all_token_ids, r.num_computed_tokens)
                self.kv.trim(r.request_id, r.num_tokens)
        if self.penalties is not None:   # one op; a row released above is cleared when handed out again
            self.penalties.append(pen_rows, pen_ids)
        return done

    def _count_draft(self, k: int, accepted: int) -> None:
        st = self.stats
        st.spec_drafts += 1
        st.spec_draft_tokens += k
        st.spec_accepted_tokens += accepted
        if len(st.spec_accepted_per_pos) < k:
            st.spec_accepted_per_pos.extend([0] * (k - len(st.spec_accepted_per_pos)))
        for i in range(accepted):
            st.spec_accepted_per_pos[i] += 1

    @staticmethod
    def _finish_reason(r: Request, token_id: int) -> str | None:
        """Why ``r`` stops after ``token_id`` was appended: "stop" (a stop_token_id, eos unless
        ignore_eos, or its constraint terminated), "length" (max_tokens, the max context, or
        max_reasoning_tokens reasoning tokens without the reasoning's end), else None. The one place
        finish is decided (stop strings aside, serve/output.py)."""
        p = r.sampling_params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in r.state.eos_token_ids):
            return "stop"
        if r.constraint is not None and r.constraint.is_terminated():
            return "stop"
        if (p.max_tokens is not None and r.num_output_tokens >= p.max_tokens) or r.num_tokens >= r.max_length:
            return "length"
        if (p.max_reasoning_tokens is not None and r.state.in_reasoning
                and r.state.num_reasoning_tokens >= p.max_reasoning_tokens):
            log.info("request %s: still reasoning after max_reasoning_tokens=%d tokens; finished with "
                     "length", r.request_id, p.max_reasoning_tokens)
            return "length"
        return None

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished, drop it from its queue and free its pages, penalty row and n-gram index at
        once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free(request.request_id)
        if self.penalties is not None:
            self.penalties.release(request.state.penalty_row)
        request.state.penalty_row = 0
        request.ngram_index = None
        request.draft_proposal = None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.draft_proposal = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.stats.preemptions += 1
