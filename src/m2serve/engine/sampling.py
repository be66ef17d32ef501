"""Sampling parameters, per-request sampler state and the vectorised sampler (docs/serving.md §10).

Order of operations on one step's logits (docs/serving.md §10, "penalties -> temperature (0 = greedy) ->
top-k -> top-p -> min-p -> draw"); logit_bias and the min_tokens mask are applied first, before the
penalties, as vLLM v1 does:

    logit_bias -> min_tokens mask -> repetition / presence / frequency penalties
    -> temperature (0 = greedy: argmax here, the filters below are skipped)
    -> top-k -> top-p -> min-p -> draw (inverse CDF over token ids, one uniform per request)

Legend: B requests in the step, V vocabulary, K candidates kept by the widest top-k / top-p sort.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from m2serve.config.model_config import GenerationDefaults

#: Largest ``logprobs`` / ``prompt_logprobs`` count accepted (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
#: Temperatures below this are greedy (a division by ~0 would overflow).
GREEDY_EPS = 1e-5
# Sampler defaults when neither the request nor generation_config.json sets a value.
_DEFAULT_TEMPERATURE = 1.0
_DEFAULT_TOP_P = 1.0
_DEFAULT_TOP_K = 0  # 0 = disabled


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops (docs/serving.md §10).

    ``None`` in ``temperature`` / ``top_p`` / ``top_k`` means "the checkpoint's
    generation_config.json default" (MiniMax-M2: 1.0 / 0.95 / 40); :meth:`resolved` fills them in.
    Construction validates every field and raises ``ValueError`` naming the field.

    Consumed by the engine (sampler + scheduler, token ids only):
      temperature (0 = greedy), top_p, top_k (<= 0 disables), min_p, repetition_penalty (prompt and
      output tokens), presence_penalty and frequency_penalty (output tokens), logit_bias {token id:
      bias in [-100, 100]}, seed (per-request generator: same seed, same output whatever else is in
      the batch), stop_token_ids, ignore_eos, min_tokens (eos and stop ids masked until this many
      tokens exist), max_tokens (None = up to the context limit), logprobs (None = none, 0 = the
      chosen token only, N = also the top N), prompt_logprobs (same counts, for prompt positions),
      thinking_temperature (used instead of temperature while the request is in reasoning),
      reasoning_end_token_ids (ids that end reasoning: ``</think>`` 200051 and
      ``<minimax:tool_call>`` 200052 in the release tokenizer; the serve layer looks them up)
      and start_in_reasoning (the prompt ends in ``<think>``, docs/parsers.md P1).

    Handled above the engine (serve/):
      stop (strings, detected by the output processor on detokenised text, which then aborts the
      request) and n (fanned out into n engine requests; :meth:`child` gives each its params).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    thinking_temperature: float | None = None
    reasoning_end_token_ids: tuple[int, ...] = ()
    start_in_reasoning: bool = False

    def __post_init__(self) -> None:
        self.stop = _str_tuple(self.stop, "stop")
        self.stop_token_ids = _id_tuple(self.stop_token_ids, "stop_token_ids")
        self.reasoning_end_token_ids = _id_tuple(self.reasoning_end_token_ids, "reasoning_end_token_ids")
        if self.logit_bias is not None:
            self.logit_bias = _bias_dict(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, name: str, want: str) -> None:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: must be {want}")

        def num(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        def integer(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(self.temperature is None or (num(self.temperature) and self.temperature >= 0),
             "temperature", ">= 0 (0 = greedy)")
        need(self.thinking_temperature is None
             or (num(self.thinking_temperature) and self.thinking_temperature >= 0),
             "thinking_temperature", ">= 0 (0 = greedy) or null")
        need(self.top_p is None or (num(self.top_p) and 0 < self.top_p <= 1), "top_p", "in (0, 1]")
        need(self.top_k is None or integer(self.top_k), "top_k", "an integer (<= 0 disables)")
        need(num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(num(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty", "> 0 (1.0 = off)")
        need(num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "presence_penalty", "in [-2, 2]")
        need(num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty", "in [-2, 2]")
        need(self.seed is None or (integer(self.seed) and -(2 ** 63) <= self.seed < 2 ** 64),
             "seed", "an integer in [-2**63, 2**64) or null")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "true or false")
        need(isinstance(self.start_in_reasoning, bool), "start_in_reasoning", "true or false")
        need(integer(self.min_tokens) and self.min_tokens >= 0, "min_tokens", ">= 0")
        need(self.max_tokens is None or (integer(self.max_tokens) and self.max_tokens >= 1),
             "max_tokens", ">= 1 or null (up to the context limit)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"invalid sampling parameter min_tokens={self.min_tokens}: must be "
                             f"<= max_tokens={self.max_tokens}")
        need(integer(self.n) and self.n >= 1, "n", ">= 1")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or (integer(v) and 0 <= v <= MAX_LOGPROBS), name,
                 f"in [0, {MAX_LOGPROBS}] or null")

    def resolved(self, defaults: GenerationDefaults) -> SamplingParams:
        """A copy with temperature / top_p / top_k taken from ``defaults`` where this request left them
        None (then the sampler's own defaults 1.0 / 1.0 / disabled); top_k <= 0 becomes 0.

        ``defaults`` is ``MiniMaxM2Config.generation`` (generation_config.json, docs/model.md §1).
        """
        def pick(own, default, fallback):
            return own if own is not None else (default if default is not None else fallback)

        top_k = pick(self.top_k, defaults.top_k, _DEFAULT_TOP_K)
        return replace(self, temperature=float(pick(self.temperature, defaults.temperature,
                                                    _DEFAULT_TEMPERATURE)),
                       top_p=float(pick(self.top_p, defaults.top_p, _DEFAULT_TOP_P)),
                       top_k=max(int(top_k), 0))

    def child(self, index: int) -> SamplingParams:
        """Params for the ``index``-th of the n engine requests of one n > 1 request: n = 1 and, if
        seeded, seed + index (so the n samples differ yet stay reproducible)."""
        seed = None if self.seed is None else (self.seed + index) % 2 ** 64
        return replace(self, n=1, seed=seed)

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError naming the field if a token id in logit_bias, stop_token_ids or
        reasoning_end_token_ids is outside [0, vocab_size)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids),
                          ("reasoning_end_token_ids", self.reasoning_end_token_ids)):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise ValueError(f"invalid sampling parameter {name}: token id {bad[0]} is outside the "
                                 f"vocabulary [0, {vocab_size})")


def _str_tuple(v: object, name: str) -> tuple[str, ...]:
    if v is None:
        return ()
    items = (v,) if isinstance(v, str) else tuple(v)  # type: ignore[arg-type]
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"invalid sampling parameter {name}: {s!r} is not a non-empty string")
    return items


def _id_tuple(v: object, name: str) -> tuple[int, ...]:
    if v is None:
        return ()
    items = (v,) if isinstance(v, int) else tuple(v)  # type: ignore[arg-type]
    for i in items:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"invalid sampling parameter {name}: {i!r} is not a token id (int >= 0)")
    return items


def _bias_dict(v: object) -> dict[int, float]:
    if not isinstance(v, dict):
        raise ValueError(f"invalid sampling parameter logit_bias={v!r}: must be a mapping token id -> bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            tid = int(k)  # JSON object keys arrive as strings
        except (TypeError, ValueError):
            raise ValueError(f"invalid sampling parameter logit_bias: key {k!r} is not a token id") from None
        if tid < 0:
            raise ValueError(f"invalid sampling parameter logit_bias: key {k!r} is not a token id")
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise ValueError(f"invalid sampling parameter logit_bias[{k!r}]={b!r}: must be in [-100, 100]")
        out[tid] = float(b)
    return out


@dataclass(slots=True)
class SamplingState:
    """Per-request sampler state, created by the engine when a request is admitted and kept with it
    (also across preemption: recompute does not replay draws, so the output is unchanged).

    params: the request's params already :meth:`SamplingParams.resolved` (temperature etc. not None).
    prompt_token_ids: the prompt (repetition penalty looks at prompt and output tokens).
    eos_token_ids: the checkpoint's eos ids (generation_config.json), masked while min_tokens applies.
    output_token_ids: tokens drawn so far; :func:`sample` appends each drawn token (do not append
    it again). in_reasoning: starts as ``params.start_in_reasoning`` and turns False for good once a
    ``reasoning_end_token_ids`` token is drawn; while True, ``thinking_temperature`` (if set) is used.
    generator: CPU ``torch.Generator`` seeded with ``params.seed`` (None = the batch's shared one).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    in_reasoning: bool = False
    generator: torch.Generator | None = None
    _seen: dict[int, None] | None = None      # prompt + output ids, insertion order (repetition)
    _seen_t: torch.Tensor | None = None       # the same as an int64 tensor, rebuilt when it grows
    _counts: dict[int, int] | None = None     # output id -> count (presence / frequency)

    @classmethod
    def new(cls, params: SamplingParams, prompt_token_ids: Sequence[int],
            eos_token_ids: Sequence[int] = ()) -> SamplingState:
        """State for a new request. Raises ValueError if ``params`` is not resolved."""
        if params.temperature is None or params.top_p is None or params.top_k is None:
            raise ValueError("SamplingState.new needs resolved params: "
                             "call params.resolved(config.generation) first")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(params.seed)
        return cls(params=params, prompt_token_ids=prompt_token_ids, eos_token_ids=tuple(eos_token_ids),
                   in_reasoning=params.start_in_reasoning, generator=gen)

    @property
    def temperature(self) -> float:
        """The temperature for the next draw: thinking_temperature while in reasoning (when set)."""
        p = self.params
        if self.in_reasoning and p.thinking_temperature is not None:
            return p.thinking_temperature
        return p.temperature  # type: ignore[return-value]

    @property
    def needs_penalties(self) -> bool:
        """True if any of repetition / presence / frequency penalty is active."""
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def append(self, token_id: int) -> None:
        """Record a drawn token: output list, penalty bookkeeping, reasoning switch."""
        self.output_token_ids.append(token_id)
        if self._counts is not None:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
            self._seen.setdefault(token_id)  # type: ignore[union-attr]
        if self.in_reasoning and token_id in self.params.reasoning_end_token_ids:
            self.in_reasoning = False

    def finish_reason(self, token_id: int) -> str | None:
        """Why the request stops after ``token_id`` was appended: "stop" (eos unless ignore_eos, or a
        stop_token_id), "length" (max_tokens reached), or None. The context limit and stop strings
        are checked elsewhere (scheduler, output processor)."""
        p = self.params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if p.max_tokens is not None and len(self.output_token_ids) >= p.max_tokens:
            return "length"
        return None

    def _penalty_ids(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seen ids [S], output ids [U], their counts [U] f32) on ``device``; sparse, so a step costs
        O(distinct tokens), not O(V)."""
        if self._counts is None:
            self._counts = {}
            for t in self.output_token_ids:
                self._counts[t] = self._counts.get(t, 0) + 1
            self._seen = dict.fromkeys(self.prompt_token_ids)
            self._seen.update(dict.fromkeys(self.output_token_ids))
        if self._seen_t is None or self._seen_t.numel() != len(self._seen) or self._seen_t.device != device:
            self._seen_t = torch.tensor(list(self._seen), dtype=torch.long, device=device)  # type: ignore[arg-type]
        out = torch.tensor(list(self._counts), dtype=torch.long, device=device)
        cnt = torch.tensor(list(self._counts.values()), dtype=torch.float32, device=device)
        return self._seen_t, out, cnt


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, its 1-based rank, and the top N
    (token id, logprob) pairs in descending order (tokens with logprob -inf are not listed)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    """token_ids [B] as ints; logprobs[b] is None unless request b asked for logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Log-softmax of ``logits`` [N, V] f32 at ``token_ids`` [N] int64, with each row's top
    ``num_top[n]`` entries. Used as is for prompt logprobs (the raw model distribution, as vLLM)."""
    lp = torch.log_softmax(logits.float(), dim=-1)                       # [N, V]
    chosen = lp.gather(1, token_ids.view(-1, 1)).squeeze(1)              # [N]
    rank = (lp > chosen.unsqueeze(1)).sum(1) + 1                         # [N]
    kmax = min(max(num_top, default=0), lp.shape[1])
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())
    return _pack_logprobs(token_ids, chosen, rank, top_v, top_i, num_top)


def _pack_logprobs(token_ids: torch.Tensor, chosen: torch.Tensor, rank: torch.Tensor, top_v: torch.Tensor,
                   top_i: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    ids, chosen_l, rank_l = token_ids.tolist(), chosen.tolist(), rank.tolist()
    tv, ti = top_v.tolist(), top_i.tolist()
    out = []
    for n, k in enumerate(num_top):
        top = [(i, v) for i, v in zip(ti[n][:k], tv[n][:k]) if v != -math.inf]
        out.append(TokenLogprobs(ids[n], chosen_l[n], rank_l[n], top))
    return out


_FMAX = torch.finfo(torch.float32).max  # +inf logits are clamped here (-inf, a masked token, stays)


def sample(logits: torch.Tensor, states: Sequence[SamplingState],
           generator: torch.Generator | None = None) -> SamplerOutput:
    """Draw one token per request from ``logits`` [B, V] f32 and append it to ``states[b]``.

    Row b uses ``states[b]``: its params, output tokens (penalties, min_tokens), reasoning flag
    (thinking_temperature) and generator. Unseeded rows draw their uniform from ``generator`` (the
    engine's, seeded from EngineArgs.seed; None = torch's default CPU generator).

    Draw: one uniform u from the row's generator, token = first id (in token-id order) whose
    cumulative probability exceeds u. A seeded row's generator advances by exactly one number per
    step and its filters are computed on its own row, so a seeded request gets the same tokens
    whatever else is in the batch (given the same logits rows; a different result needs u to fall
    within float rounding of a CDF step). Ties between equal logits are resolved by value (all tied
    tokens kept or dropped together), never by sort order.

    Cost: when every sampled row has top_k > 0 (MiniMax's default 40) the filters and the draw run
    on the top-k candidates only ([B, K]); without top-k they run on [B, V].

    Logprobs (when requested) are those of the distribution the token was drawn from: log-softmax of
    the processed logits after bias, min_tokens mask, penalties, temperature and top-k/top-p/min-p
    (filtered tokens -inf). For greedy rows (temperature 0) the same without temperature and
    filters. vLLM instead returns the raw model distribution by default; prompt logprobs here are
    raw (:func:`compute_logprobs`).

    Raises ValueError if logits is not 2-D or its row count differs from len(states).
    """
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"sample: logits {tuple(logits.shape)} must be [B, V] with B = {len(states)} "
                         "(one row per request)")
    B = logits.shape[0]
    x = logits.float()
    if any(s.params.logit_bias or len(s.output_token_ids) < s.params.min_tokens or s.needs_penalties
           for s in states):
        x = x.clone()
        _apply_bias_and_masks(x, states)
        _apply_penalties(x, states)
        x.clamp_(max=_FMAX)  # a tiny repetition_penalty can overflow a logit to +inf (inf - inf = NaN)

    temps = [s.temperature for s in states]
    g_rows = [b for b, t in enumerate(temps) if t < GREEDY_EPS]
    s_rows = [b for b, t in enumerate(temps) if t >= GREEDY_EPS]
    tokens = x.argmax(dim=-1) if g_rows else torch.empty(B, dtype=torch.long, device=x.device)
    lps: list[TokenLogprobs | None] = [None] * B
    if s_rows:
        sub = [states[b] for b in s_rows]
        xs = x if len(s_rows) == B else x[s_rows]
        tok_s, lp_s = _sample_rows(xs, sub, generator)
        tokens[s_rows] = tok_s
        for b, lp in zip(s_rows, lp_s):
            lps[b] = lp
    g_lp = [b for b in g_rows if states[b].params.logprobs is not None]
    if g_lp:
        got = compute_logprobs(x[g_lp], tokens[g_lp], [states[b].params.logprobs for b in g_lp])
        for b, lp in zip(g_lp, got):
            lps[b] = lp

    token_list = tokens.tolist()
    for s, t in zip(states, token_list):
        s.append(t)
    return SamplerOutput(token_list, lps)


def _sample_rows(x: torch.Tensor, states: Sequence[SamplingState],
                 generator: torch.Generator | None) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
    """Temperature -> top-k -> top-p -> min-p -> draw for rows with temperature > 0.

    Works on candidates ``vals`` [b, K] (descending, -inf past each row's set) with their token
    ids ``idx`` [b, K] when every row has top-k; else on the whole row (idx None, K = V).
    Returns token ids [b] and the logprobs entries.
    """
    b, V = x.shape
    dev = x.device
    ks = [s.params.top_k if 0 < s.params.top_k < V else 0 for s in states]
    if all(ks):
        vals, idx = _top_k_candidates(x, ks)
    else:
        vals, idx = x, None
    temps = torch.tensor([s.temperature for s in states], dtype=torch.float32, device=dev).unsqueeze(1)
    vals = (vals / temps).clamp_(max=_FMAX)                                  # a tiny temperature: no +inf
    if idx is None and any(ks):
        _top_k_mask(vals, ks)
    _top_p(vals, states, presorted=idx is not None)
    _min_p(vals, states)

    # draw: one uniform per row, inverse CDF over the candidates in token-id order
    u = torch.rand(b, generator=generator)                                    # shared, cpu
    for i, s in enumerate(states):
        if s.generator is not None:
            u[i] = torch.rand(1, generator=s.generator)[0]
    if idx is not None:
        order = torch.where(vals > -math.inf, idx, idx + V).argsort(dim=1)    # [b, K], dropped last
        w = torch.exp(vals.gather(1, order) - vals[:, :1])                    # vals[:, 0] = row max
    else:
        order = None
        w = torch.exp(vals - vals.max(dim=1, keepdim=True).values)            # [b, V]
    cdf = w.cumsum(dim=1)
    total = cdf[:, -1:]
    target = torch.minimum(u.to(dev).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    pos = torch.searchsorted(cdf, target, right=True)                         # [b, 1] first cdf > target
    pos.clamp_(max=cdf.shape[1] - 1)                                          # NaN weights: stay in range
    if order is not None:
        pos = order.gather(1, pos)                                            # position in vals
        tokens = idx.gather(1, pos).squeeze(1)
    else:
        tokens = pos.squeeze(1)

    want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    lps: list[TokenLogprobs | None] = [None] * b
    if not want:
        return tokens, lps
    ns = [states[i].params.logprobs for i in want]
    if idx is None:
        got = compute_logprobs(vals[want], tokens[want], ns)
    else:
        lp = vals[want] - torch.logsumexp(vals[want], dim=1, keepdim=True)   # [w, K] desc
        chosen = lp.gather(1, pos[want]).squeeze(1)
        rank = (lp > chosen.unsqueeze(1)).sum(1) + 1
        kmax = min(max(ns), lp.shape[1])
        got = _pack_logprobs(tokens[want], chosen, rank, lp[:, :kmax], idx[want][:, :kmax], ns)
    for i, g in zip(want, got):
        lps[i] = g
    return tokens, lps


def _apply_bias_and_masks(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """logit_bias (added) and the min_tokens mask (eos + stop ids -> -inf), in place on x [B, V]."""
    rows, cols, vals = [], [], []
    mrows, mcols = [], []
    for b, s in enumerate(states):
        p = s.params
        for tid, bias in (p.logit_bias or {}).items():
            rows.append(b)
            cols.append(tid)
            vals.append(bias)
        if len(s.output_token_ids) < p.min_tokens:
            ids = set(s.eos_token_ids) | set(p.stop_token_ids)
            mrows += [b] * len(ids)
            mcols += sorted(ids)
    if rows:
        x.index_put_((torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)),
                     torch.tensor(vals, dtype=x.dtype, device=x.device), accumulate=True)
    if mrows:
        x[torch.tensor(mrows, device=x.device), torch.tensor(mcols, device=x.device)] = -math.inf


def _apply_penalties(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Repetition (prompt + output tokens: positive logits / r, negative * r), presence and
    frequency (output tokens: x -= presence * [count > 0] + frequency * count), in place, on the
    seen ids only (docs/serving.md §10; OpenAI / vLLM definitions)."""
    for b, s in enumerate(states):
        if not s.needs_penalties:
            continue
        p = s.params
        seen, out, cnt = s._penalty_ids(x.device)
        row = x[b]                                                             # view [V]
        if p.repetition_penalty != 1.0 and seen.numel():
            v = row[seen]
            row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if out.numel() and (p.presence_penalty or p.frequency_penalty):
            row.index_add_(0, out, -(p.presence_penalty + p.frequency_penalty * cnt))


def _top_k_candidates(x: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k candidates of every row: (values [b, K] descending, ids [b, K]); each row keeps all
    tokens >= its k-th largest logit (ties at the boundary kept), the rest of its K slots -inf."""
    kmax = max(ks)
    vals, idx = x.topk(kmax + 1, dim=-1)                                      # [b, kmax+1] desc
    k_t = torch.tensor(ks, device=x.device).unsqueeze(1)
    kth = vals.gather(1, k_t - 1)                                             # [b, 1]
    if bool((vals.gather(1, k_t) == kth).any()):                              # a tie at some boundary
        count = (x >= kth).sum(dim=1, keepdim=True)
        vals, idx = x.topk(int(count.max()), dim=-1)
    else:
        count = k_t
        vals, idx = vals[:, :kmax], idx[:, :kmax]
    keep = torch.arange(vals.shape[1], device=x.device).unsqueeze(0) < count
    return vals.masked_fill(~keep, -math.inf), idx


def _top_k_mask(x: torch.Tensor, ks: list[int]) -> None:
    """Whole-row top-k: logits below the row's k-th largest -> -inf (k = 0 rows untouched)."""
    kmax = max(ks)
    top = x.topk(kmax, dim=-1).values
    k_t = torch.tensor(ks, device=x.device)
    kth = top.gather(1, (k_t.clamp(min=1) - 1).unsqueeze(1))
    kth = torch.where(k_t.unsqueeze(1) > 0, kth, torch.full_like(kth, -math.inf))
    x.masked_fill_(x < kth, -math.inf)


def _top_p(x: torch.Tensor, states: Sequence[SamplingState], presorted: bool) -> None:
    """Keep the most likely tokens until their probability reaches top_p: token kept iff the
    probability of strictly more likely tokens is < top_p (ties kept together); others -inf.
    ``presorted``: x is already in descending order along the row."""
    ps = torch.tensor([s.params.top_p for s in states], dtype=torch.float32, device=x.device).unsqueeze(1)
    if bool((ps >= 1).all()):
        return
    if presorted:
        vals = x
    else:
        width = int((x > -math.inf).sum(1).max())
        vals = x.topk(width, dim=-1).values                                   # [b, K] desc
    w = torch.exp(vals - vals[:, :1])
    cum = w.cumsum(dim=1)
    before = (cum - w) / cum[:, -1:]                                          # mass strictly before
    keep = (before < ps) | (ps >= 1)
    keep[:, 0] = True
    cut = vals.masked_fill(~keep, math.inf).min(dim=1, keepdim=True).values   # [b, 1]
    x.masked_fill_(x < cut, -math.inf)


def _min_p(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Drop tokens with p < min_p * p_max, i.e. logit < max logit + log(min_p); in place."""
    mp = [s.params.min_p for s in states]
    if not any(mp):
        return
    log_mp = torch.log(torch.tensor(mp, dtype=torch.float32, device=x.device)).unsqueeze(1)  # log 0 = -inf
    x.masked_fill_(x < x.max(dim=1, keepdim=True).values + log_mp, -math.inf)
