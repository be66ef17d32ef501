"""Sampling parameters, per-request sampler state and the vectorised sampler (docs/serving.md §10).

Order of operations on one step's logits (docs/serving.md §10, "penalties -> temperature (0 = greedy) ->
top-k -> top-p -> min-p -> draw"); logit_bias and the min_tokens mask are applied first, before the
penalties, as vLLM v1 does:

    logit_bias -> min_tokens mask -> repetition / presence / frequency penalties
    -> allowed-token bitmask (constrained decoding, engine/constraint.py)
    -> temperature (0 = greedy: argmax here, the filters below do not change its token)
    -> top-k -> top-p -> min-p -> draw (inverse CDF over token ids, one counter-based uniform per
    request, keyed by (seed, output position))

`sample` is pure; the engine's post-model update (``Scheduler.update_from_output``) appends the
drawn ids to the request and to the `PenaltyState` counts.

Legend: B requests in the step, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from m2serve.config.model_config import GenerationDefaults
from m2serve.engine.constraint import BITMASK_WORD_BITS, bitmask_words
from m2serve.model.batch import StepBuffers

#: Largest ``logprobs`` / ``prompt_logprobs`` count accepted (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
#: Largest repetition_penalty accepted (vLLM's limit too); the range is (0, MAX_REPETITION_PENALTY].
MAX_REPETITION_PENALTY = 100.0
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
      temperature (0 = greedy), top_p, top_k (0 or -1 disables), min_p, repetition_penalty (prompt and
      output tokens), presence_penalty and frequency_penalty (output tokens), logit_bias {token id:
      bias in [-100, 100]}, seed (key of the request's counter-based uniform stream: the same seed
      draws the same uniforms whatever else is in the batch; the same tokens too when the logits
      are the same, which the batch-invariant mode guarantees, docs/model.md §7), stop_token_ids,
      ignore_eos, min_tokens (eos and
      stop ids masked until this many tokens exist), max_tokens (None = up to the context limit),
      logprobs (None = none, 0 = the chosen token only, N = also the top N), prompt_logprobs (same
      counts, for prompt positions), thinking_temperature (used instead of temperature while the
      request is in reasoning), reasoning_end_token_ids (ids that end reasoning: ``</think>`` 200051 and
      ``<minimax:tool_call>`` 200052 in the release tokenizer; the serve layer looks them up)
      and start_in_reasoning (the prompt ends in ``<think>``, docs/parsers.md P1),
      max_reasoning_tokens (None = no cap: a request still in reasoning after this many reasoning
      tokens finishes with ``length``; chat requests get the checkpoint's generation_config.json cap).

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
    max_reasoning_tokens: int | None = None

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
        need(self.top_k is None or (integer(self.top_k) and self.top_k >= -1), "top_k",
             "an integer >= 1, or 0 or -1 (disabled)")
        need(num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(num(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
             "repetition_penalty", f"in (0, {MAX_REPETITION_PENALTY:g}] (1.0 = off)")
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
        need(self.max_reasoning_tokens is None
             or (integer(self.max_reasoning_tokens) and self.max_reasoning_tokens >= 1),
             "max_reasoning_tokens", ">= 1 or null (no cap)")
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
        reasoning_end_token_ids is outside [0, vocab_size), or top_k is above vocab_size."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise ValueError(f"invalid sampling parameter top_k={self.top_k}: must be at most the vocabulary "
                             f"size {vocab_size} (or 0 / -1: disabled)")
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
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"invalid sampling parameter {name}: {s!r} contains a lone UTF-16 surrogate "
                             "(not valid Unicode)") from None
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
        # JSON object keys arrive as strings: only plain decimal digits name a token id (int() would
        # also take " 5", "+5", "1_0" and other scripts' digits)
        if isinstance(k, bool) or not (isinstance(k, int) and k >= 0
                                       or isinstance(k, str) and k.isascii() and k.isdigit()):
            raise ValueError(f"invalid sampling parameter logit_bias: key {k!r} is not a token id "
                             "(a decimal integer >= 0)")
        tid = int(k)
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise ValueError(f"invalid sampling parameter logit_bias[{k!r}]={b!r}: must be in [-100, 100]")
        out[tid] = float(b)
    return out


@dataclass(slots=True)
class SamplingState:
    """Per-request sampler state, created when a request is added and kept with it (also across
    preemption: recompute replays no draws, so the output is unchanged).

    params: the request's params already :meth:`SamplingParams.resolved` (temperature etc. not None).
    eos_token_ids: the checkpoint's eos ids (generation_config.json), masked while min_tokens applies.
    seed: key of the request's counter-based uniform stream (:func:`counter_uniforms`):
    ``params.seed`` when set, else a number drawn once from the engine's generator.
    in_reasoning / num_reasoning_tokens: starts as ``params.start_in_reasoning``; every token
    generated while in reasoning counts, and a ``reasoning_end_token_ids`` token (counted) ends it
    for good (:meth:`observe`). While True, ``thinking_temperature`` (if set) is used.
    penalty_row: the request's row in the `PenaltyState` (0 = none: no penalties asked).
    """

    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0
    in_reasoning: bool = False
    num_reasoning_tokens: int = 0
    penalty_row: int = 0

    @classmethod
    def new(cls, params: SamplingParams, eos_token_ids: Sequence[int] = (),
            generator: torch.Generator | None = None) -> SamplingState:
        """State for a new request; an unseeded one draws its stream key from ``generator`` (None =
        torch's default CPU generator). Raises ValueError if ``params`` is not resolved."""
        if params.temperature is None or params.top_p is None or params.top_k is None:
            raise ValueError("SamplingState.new needs resolved params: "
                             "call params.resolved(config.generation) first")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        return cls(params=params, eos_token_ids=tuple(eos_token_ids), seed=seed,
                   in_reasoning=params.start_in_reasoning)

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

    def observe(self, token_id: int) -> None:
        """The reasoning state after ``token_id`` was generated (called once per token, by
        ``Scheduler.update_from_output``; docs/parsers.md P1)."""
        if self.in_reasoning:
            self.num_reasoning_tokens += 1
            if token_id in self.params.reasoning_end_token_ids:
                self.in_reasoning = False


@dataclass(slots=True)
class PenaltyState:
    """Batched penalty bookkeeping as device tensors, one row per request with penalties.

    counts: int32 [R, V] output-token counts; prompt: bool [R, V] prompt tokens (repetition looks
    at prompt and output tokens). Row 0 is all zero and never given out (requests without
    penalties point at it). Rows are added at admission (:meth:`add`), grown by
    :meth:`append` (one vectorised op per step) and released when the request finishes; the pool
    doubles when full. Memory: R · V · 5 bytes.
    """

    vocab_size: int
    device: torch.device | str = "cpu"
    counts: torch.Tensor = field(init=False)
    prompt: torch.Tensor = field(init=False)
    free_rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = torch.zeros((1, self.vocab_size), dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros((1, self.vocab_size), dtype=torch.bool, device=self.device)

    def add(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()) -> int:
        """A fresh row for a request with these tokens so far; returns its index (>= 1)."""
        if not self.free_rows:
            R = self.counts.shape[0]
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
            self.free_rows = list(range(2 * R - 1, R - 1, -1))
        row = self.free_rows.pop()
        self.counts[row].zero_()
        self.prompt[row].zero_()
        if prompt_token_ids:
            self.prompt[row, torch.tensor(list(prompt_token_ids), device=self.device)] = True
        if output_token_ids:
            ids = torch.tensor(list(output_token_ids), device=self.device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return row

    def release(self, row: int) -> None:
        """Give a row back (its contents are cleared when it is handed out again)."""
        if row > 0:
            self.free_rows.append(row)

    def append(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """counts[rows[i], token_ids[i]] += 1 for all i, in one op (host lists, one copy each)."""
        if not rows:
            return
        r = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        t = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        self.counts.index_put_((r, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)


# ---- counter-based uniforms: SplitMix64 (Steele, Lea, Flood 2014) on int64 tensors --------------
def _i64(c: int) -> int:
    return c - 2 ** 64 if c >= 2 ** 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, a pure function of (seed, position): f32 [B].

    seeds, positions: int64 [B] (a seed >= 2**63 is passed as its two's-complement int64). The
    value is output number ``position + 1`` of SplitMix64 seeded with ``seed``
    (z = seed + (position + 1) · 0x9E3779B97F4A7C15 mod 2**64, then the SplitMix64 finaliser),
    top 24 bits / 2**24. No generator state: a row's draw does not depend on the other rows,
    the step or the device. int64 products wrap mod 2**64 in torch, which is what the mix needs.
    """
    z = seeds + (positions + 1) * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 40).float() * (1.0 / 2 ** 24)


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


@dataclass(slots=True)
class SamplingBatch:
    """One step's sampling inputs, built once on the host from the rows' states (:meth:`build`).

    Per row b (all on the logits' device): temperature f32 [B] (1.0 on greedy rows), greedy
    bool [B], top_k int64 [B] (0 = off, also on greedy rows), top_p / min_p f32 [B],
    repetition / presence / frequency f32 [B], penalty_rows int64 [B] (0 = none), seeds /
    positions int64 [B] (the uniform's key: stream seed and output position). bias: (rows, cols,
    values) of logit_bias; eos_mask: (rows, cols) masked by min_tokens; draft_counts: (rows, token
    ids) added once each to the rows' output-token counts before the penalties (the drafted tokens
    a speculative row assumes accepted, docs/serving.md §13), or None. The Python-side flags
    (kmax, all_*, any_*) pick which stages run, so no
    stage needs to look at device data.
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    penalty_rows: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    eos_mask: tuple[torch.Tensor, torch.Tensor] | None
    draft_counts: tuple[torch.Tensor, torch.Tensor] | None
    num_logprobs: list[int | None]
    kmax: int
    all_top_k: bool
    all_greedy: bool
    any_greedy: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool

    @property
    def num_rows(self) -> int:
        """B."""
        return len(self.num_logprobs)

    @classmethod
    def build(cls, states: Sequence[SamplingState], num_output_tokens: Sequence[int], vocab_size: int,
              device: torch.device | str = "cpu", end_of_turn: Sequence[bool] = (),
              buffers: StepBuffers | None = None,
              draft_counts: tuple[Sequence[int], Sequence[int]] = ((), ())) -> SamplingBatch:
        """Inputs for rows ``states`` whose requests have generated ``num_output_tokens[b]`` tokens
        (the output position of this draw). A top_k >= vocab_size is off. ``end_of_turn[b]`` True:
        row b's constraint allows only the end of turn, so its min_tokens mask yields (masking the
        only allowed tokens would leave nothing to draw). Host lists only. With ``buffers`` (the
        runner's persistent :class:`~m2serve.model.batch.StepBuffers` for the sampler) every input
        reaches the device in one copy (docs/serving.md §6.1); without, one copy per input.
        ``draft_counts``: (rows, token ids) of drafted tokens counted as output tokens of those rows
        (a speculative row, docs/serving.md §13)."""
        temps = [s.temperature for s in states]
        greedy = [t < GREEDY_EPS for t in temps]
        ks = [s.params.top_k if 0 < s.params.top_k < vocab_size and not g else 0  # type: ignore[operator]
              for s, g in zip(states, greedy)]
        brows, bcols, bvals, mrows, mcols = [], [], [], [], []
        for b, (s, n) in enumerate(zip(states, num_output_tokens, strict=True)):
            p = s.params
            for tid, bias in (p.logit_bias or {}).items():
                brows.append(b)
                bcols.append(tid)
                bvals.append(bias)
            if n < p.min_tokens and not (b < len(end_of_turn) and end_of_turn[b]):
                ids = sorted(set(s.eos_token_ids) | set(p.stop_token_ids))
                mrows += [b] * len(ids)
                mcols += ids

        def f32(v: list[float]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.float32, device=device)

        def i64(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=device)

        sampled = [not g for g in greedy]
        i64s = [[int(g) for g in greedy], ks, [s.penalty_row for s in states],
                [_i64(s.seed % 2 ** 64) for s in states], list(num_output_tokens), brows, bcols, mrows, mcols,
                list(draft_counts[0]), list(draft_counts[1])]
        f32s = [[1.0 if g else t for g, t in zip(greedy, temps)], [s.params.top_p for s in states],
                [s.params.min_p for s in states], [s.params.repetition_penalty for s in states],
                [s.params.presence_penalty for s in states], [s.params.frequency_penalty for s in states],
                bvals]
        if buffers is not None:
            (greedy_t, top_k, penalty_rows, seeds, positions, br, bc, mr, mc, dr, dc,
             temperature, top_p, min_p, rep, pres, freq, bv) = buffers.load(i64s, [], f32s)
        else:
            (greedy_t, top_k, penalty_rows, seeds, positions, br, bc, mr, mc, dr, dc) = map(i64, i64s)
            temperature, top_p, min_p, rep, pres, freq, bv = map(f32, f32s)
        return cls(
            temperature=temperature, greedy=greedy_t.to(torch.bool), top_k=top_k, top_p=top_p,
            min_p=min_p, repetition=rep, presence=pres, frequency=freq, penalty_rows=penalty_rows,
            seeds=seeds, positions=positions,
            bias=(br, bc, bv) if brows else None,
            eos_mask=(mr, mc) if mrows else None,
            draft_counts=(dr, dc) if len(draft_counts[0]) else None,
            num_logprobs=[s.params.logprobs for s in states],
            kmax=max(ks, default=0),
            all_top_k=all(k > 0 for k, q in zip(ks, sampled) if q) and any(sampled),
            all_greedy=all(greedy), any_greedy=any(greedy),
            any_top_p=any(s.params.top_p < 1 and q for s, q in zip(states, sampled)),  # type: ignore[operator]
            any_min_p=any(s.params.min_p > 0 and q for s, q in zip(states, sampled)),
            any_penalty=any(s.needs_penalties for s in states))


@dataclass(slots=True)
class SamplingRows:
    """What a draw needs besides the logits, as host data, per row b: ``request_ids[b]``, whether
    the request is in reasoning (``in_reasoning[b]``, which picks thinking_temperature), its output
    position (``num_output_tokens[b]``), ``end_of_turn[b]`` (its constraint allows only the end of
    turn) and the constraint bitmask ``allowed`` (int32 [B, ceil(V/32)] on the host, None = no
    constraint). A speculative decode has K + 1 rows, one per verified position (docs/serving.md
    §13), each with its own reasoning flag, output position and bitmask, and ``draft_counts``
    (rows, token ids) adds the drafts before a row to its penalty counts. ``new_states`` holds the
    `SamplingState` of the rows whose state the drawing side does not hold yet; the others are
    looked up in the ``held`` dict given to :meth:`sample`.

    Picklable, so under data parallelism rank 0 sends each replica its rows, a request's state once
    (its sampling fields; then per step only the fields above), and the replica's rank draws from its
    own logits (docs/serving.md §6, "sampling where the logits are").
    """

    request_ids: list[str]
    new_states: dict[str, SamplingState]
    in_reasoning: list[bool]
    num_output_tokens: list[int]
    end_of_turn: list[bool]
    allowed: torch.Tensor | None
    vocab_size: int
    draft_counts: tuple[list[int], list[int]] = ((), ())  # type: ignore[assignment]

    @classmethod
    def of(cls, ids: list[str], states: list[SamplingState], num_output_tokens: list[int],
           end_of_turn: list[bool], allowed: torch.Tensor | None, vocab_size: int,
           held: set[str] | None = None, in_reasoning: list[bool] | None = None,
           draft_counts: tuple[list[int], list[int]] = ((), ())) -> SamplingRows:  # type: ignore[assignment]
        """Rows for requests ``ids`` with ``states`` (an id repeats for each row of a speculative
        decode); those in ``held`` (ids whose state the drawing side holds) travel without their
        state, and the others are added to it. ``in_reasoning``: per row (default: the states')."""
        new = {i: s for i, s in zip(ids, states, strict=True) if held is None or i not in held}
        if held is not None:
            held.update(new)
        reasoning = list(in_reasoning) if in_reasoning is not None else [s.in_reasoning for s in states]
        return cls(list(ids), new, reasoning, list(num_output_tokens),
                   list(end_of_turn), allowed, vocab_size, draft_counts)

    @property
    def num_rows(self) -> int:
        """B."""
        return len(self.request_ids)

    def sample(self, logits: torch.Tensor, penalties: PenaltyState | None = None,
               held: dict[str, SamplingState] | None = None,
               buffers: StepBuffers | None = None) -> SamplerOutput:
        """:func:`sample` of ``logits`` [B, V] f32 with these rows (inputs built on its device, in
        one copy through ``buffers`` when given: :meth:`SamplingBatch.build`).
        ``held``: the drawing side's states by request id (updated with ``new_states``). Raises
        KeyError for a row whose state is neither new nor held."""
        batch, allowed = self.inputs(logits.device, held, buffers)
        return sample(logits, batch, penalties, allowed)

    def probs(self, logits: torch.Tensor, penalties: PenaltyState | None = None,
              held: dict[str, SamplingState] | None = None,
              buffers: StepBuffers | None = None, log: bool = False) -> torch.Tensor:
        """:func:`target_probs` of ``logits`` [B, V] f32 with these rows: f32 [B, V], each row the
        distribution :meth:`sample` would draw it from (its log with ``log``; arguments and errors
        as there)."""
        batch, allowed = self.inputs(logits.device, held, buffers)
        return target_probs(logits, batch, penalties, allowed, log)

    def inputs(self, device: torch.device, held: dict[str, SamplingState] | None = None,
               buffers: StepBuffers | None = None) -> tuple[SamplingBatch, torch.Tensor | None]:
        """The rows' :class:`SamplingBatch` and bitmask on ``device`` (see :meth:`sample`)."""
        held = {} if held is None else held
        states, seen = [], set()
        for rid, reasoning in zip(self.request_ids, self.in_reasoning, strict=True):
            st = self.new_states[rid] if rid in self.new_states else held[rid]
            held[rid] = st
            if rid not in seen:            # a request's first row carries its current state
                seen.add(rid)
                st.in_reasoning = reasoning
            elif st.in_reasoning != reasoning:   # a later speculative row, past a reasoning end
                st = replace(st, in_reasoning=reasoning)
            states.append(st)
        batch = SamplingBatch.build(states, self.num_output_tokens, self.vocab_size, device,
                                    self.end_of_turn, buffers, self.draft_counts)
        allowed = self.allowed.to(device) if self.allowed is not None else None
        return batch, allowed


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Log-softmax of ``logits`` [N, V] f32 at ``token_ids`` [N] int64, with each row's top
    ``num_top[n]`` entries. Used as is for prompt logprobs (the raw model distribution, as vLLM)."""
    lp = torch.log_softmax(logits.float(), dim=-1)                       # [N, V]
    chosen = lp.gather(1, token_ids.view(-1, 1)).squeeze(1)              # [N]
    rank = (lp > chosen.unsqueeze(1)).sum(1) + 1                         # [N]
    kmax = min(max(num_top, default=0), lp.shape[1])
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())
    return _pack_logprobs(token_ids, chosen, rank, top_v, top_i, num_top)[0]


def _pack_logprobs(token_ids: torch.Tensor, chosen: torch.Tensor, rank: torch.Tensor, top_v: torch.Tensor,
                   top_i: torch.Tensor, num_top: Sequence[int],
                   flag: torch.Tensor | None = None) -> tuple[list[TokenLogprobs], bool]:
    """One device->host copy of [N, 4 + 2k] f64 (ids < 2**53 are exact in f64): the entries, and
    whether ``flag`` (bool, any shape) had any True."""
    k = top_v.shape[1]
    f = (flag.any() if flag is not None else token_ids.new_zeros(())).double().expand(token_ids.shape[0])
    packed = torch.cat([token_ids.double().unsqueeze(1), chosen.double().unsqueeze(1),
                        rank.double().unsqueeze(1), f.unsqueeze(1), top_v.double(), top_i.double()],
                       dim=1).tolist()
    out = []
    for row, n in zip(packed, num_top):
        top = [(int(i), v) for v, i in zip(row[4:4 + k][:n], row[4 + k:][:n]) if v != -math.inf]
        out.append(TokenLogprobs(int(row[0]), row[1], int(row[2]), top))
    return out, bool(packed and packed[0][3])


_FMAX = torch.finfo(torch.float32).max  # +inf logits are clamped here (-inf, a masked token, stays)


def sample(logits: torch.Tensor, batch: SamplingBatch, penalties: PenaltyState | None = None,
           allowed: torch.Tensor | None = None) -> SamplerOutput:
    """Draw one token per row from ``logits`` [B, V] f32; pure (no state changes).

    Order (docs/serving.md §10, logit_bias and min_tokens first as in vLLM v1): logit_bias -> min_tokens
    mask (eos + stop ids -inf) -> repetition / presence / frequency penalties (``penalties``
    rows) -> ``allowed`` bitmask -> temperature (greedy rows: argmax here) -> top-k -> top-p ->
    min-p -> draw. ``allowed``: int32 [B, ceil(V / 32)], bit j of word i allows token 32 i + j
    (llguidance's layout; all bits set = no constraint).

    Draw: u = :func:`counter_uniforms` (seed, output position), all rows in one op; token = first
    id (in token-id order) whose cumulative probability exceeds u. Every stage is row-local and
    the filters are value cuts (tokens tied with the cut are kept or dropped together, never by
    sort order), so a row gets the same token whatever else is in the batch.

    Cost: when every sampled row has top-k (MiniMax's default 40), filters and draw run on a
    window of the W = 2 max(k) + 16 largest values per row ([B, W]); if more tokens tie at a row's
    top-k boundary than the window holds (seen in the one host copy), the step is redone on whole
    rows (a second sync, exact). Otherwise they run on [B, V]; top-p then sorts whole rows (as
    vLLM's sampler does).

    Logprobs (when requested) are those of the distribution the token was drawn from: log-softmax
    after bias, masks, penalties, temperature and top-k/top-p/min-p (filtered tokens -inf); for
    greedy rows the same without temperature and filters. Prompt logprobs are raw
    (:func:`compute_logprobs`).

    Host syncs: one, the copy of the token ids (with the logprobs packed into it when asked).
    Raises ValueError if logits is not [B, V] with B = batch.num_rows, if a row has penalties and
    ``penalties`` is None, or if ``allowed`` is not int32 [B, ceil(V / 32)].
    """
    B = batch.num_rows
    if logits.dim() != 2 or logits.shape[0] != B:
        raise ValueError(f"sample: logits {tuple(logits.shape)} must be [B, V] with B = {B} "
                         "(one row per request)")
    if batch.any_penalty and penalties is None:
        raise ValueError("sample: a row has penalties but penalties=None; pass the PenaltyState")
    out = _sample(logits, batch, penalties, allowed, window=batch.all_top_k)
    return out if out is not None else _sample(logits, batch, penalties, allowed, window=False)  # type: ignore[return-value]


def _sample(logits: torch.Tensor, batch: SamplingBatch, penalties: PenaltyState | None,
            allowed: torch.Tensor | None, window: bool) -> SamplerOutput | None:
    """:func:`sample` on top-k windows (``window``) or whole rows; None when a window overflowed."""
    B, V = logits.shape
    x = _masked(logits, batch, penalties, allowed)
    greedy_tok = x.argmax(dim=-1) if batch.any_greedy else None                 # [B]
    overflow = None
    if batch.all_greedy:
        tokens, vals, ids = greedy_tok, x, None
    else:
        u = counter_uniforms(batch.seeds, batch.positions)                      # [B], one op for all rows
        if window:
            tokens, vals, ids, overflow = _draw_window(x, batch, u)
        else:
            tokens, vals, ids = _draw_rows(_scale(x, batch), batch, u)
        if greedy_tok is not None:
            tokens = torch.where(batch.greedy, greedy_tok, tokens)

    want = [b for b, n in enumerate(batch.num_logprobs) if n is not None]
    if not want:
        flag = overflow.any() if overflow is not None else tokens.new_zeros(())
        packed = torch.cat([tokens, flag.long().view(1)]).tolist()             # the one host copy
        return None if packed[-1] else SamplerOutput(packed[:-1], [None] * B)
    if ids is not None:                                                         # window -> whole rows
        vals = torch.full_like(x, -math.inf).scatter_(1, ids, vals)
    dist = torch.where(batch.greedy.unsqueeze(1), x, vals) if batch.any_greedy else vals
    ns = [n if n is not None else 0 for n in batch.num_logprobs]
    lp = torch.log_softmax(dist, dim=-1)                                        # [B, V]
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    rank = (lp > chosen.unsqueeze(1)).sum(1) + 1
    kmax = min(max(ns), V)
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())
    entries, overflowed = _pack_logprobs(tokens, chosen, rank, top_v, top_i, ns, overflow)
    if overflowed:
        return None
    return SamplerOutput([e.token_id for e in entries],
                         [e if n is not None else None for e, n in zip(entries, batch.num_logprobs)])


def _masked(logits: torch.Tensor, batch: SamplingBatch, penalties: PenaltyState | None,
            allowed: torch.Tensor | None) -> torch.Tensor:
    """The draw's first stages on logits [B, V]: logit_bias -> min_tokens mask -> penalties ->
    ``allowed`` bitmask -> clamp to finite above; f32 [B, V]."""
    x = logits.float()
    if batch.bias is not None:
        x = x.index_put(batch.bias[:2], batch.bias[2], accumulate=True)
    if batch.eos_mask is not None:
        x = x.index_put(batch.eos_mask, torch.tensor(-math.inf, device=x.device))
    if batch.any_penalty:
        x = _apply_penalties(x, batch, penalties)  # type: ignore[arg-type]
    if allowed is not None:
        x = apply_allowed_bitmask(x, allowed)
    return x.clamp(max=_FMAX)  # a tiny repetition_penalty can overflow a logit to +inf (inf - inf = NaN)


def target_probs(logits: torch.Tensor, batch: SamplingBatch, penalties: PenaltyState | None = None,
                 allowed: torch.Tensor | None = None, log: bool = False) -> torch.Tensor:
    """The distribution :func:`sample` draws each row from, f32 [B, V] (rows sum to 1): after
    logit_bias, min_tokens, penalties, ``allowed``, temperature, top-k, top-p and min-p (the same
    stages and value cuts, on whole rows); a greedy row is one-hot at its argmax (the token
    :func:`sample` returns). The target's p of the rejection rule (docs/serving.md §14). ``log``:
    log p instead (log-softmax, as the sampler's logprobs; -inf where p is 0). Raises
    ValueError as :func:`sample` for mismatched rows or missing penalties."""
    B = batch.num_rows
    if logits.dim() != 2 or logits.shape[0] != B:
        raise ValueError(f"target_probs: logits {tuple(logits.shape)} must be [B, V] with B = {B}")
    if batch.any_penalty and penalties is None:
        raise ValueError("target_probs: a row has penalties but penalties=None; pass the PenaltyState")
    x = _masked(logits, batch, penalties, allowed)
    hot = torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[1]).float() if batch.any_greedy else None
    if hot is not None and batch.all_greedy:
        return hot.log() if log else hot
    v = _filter_rows(_scale(x, batch), batch)
    p = torch.log_softmax(v, dim=-1) if log else torch.softmax(v, dim=-1)
    if hot is not None:
        p = torch.where(batch.greedy.unsqueeze(1), hot.log() if log else hot, p)
    return p


def apply_allowed_bitmask(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """x [B, V] with tokens whose bit is 0 in ``allowed`` int32 [B, ceil(V / 32)] set to -inf
    (bit j of word i = token 32 i + j, llguidance's layout). ValueError on a wrong shape / dtype.

    Each word is split into its 4 bytes, each byte looks up its 8 limits (+inf for a set bit, -inf
    for a clear one) in a [256, 8] table, and ``fmin(x, limit)`` keeps allowed logits and puts -inf
    on the others: a gather and an elementwise op over [B, V], about twice as fast on CPU as unpacking
    32 bit planes and a boolean ``masked_fill``. ``fmin`` ignores NaN, so a forbidden token is -inf
    even when the model gave it NaN or +inf (never drawn); an allowed NaN becomes +inf, which the
    sampler then clamps like any overflow."""
    B, V = x.shape
    W = bitmask_words(V)
    if allowed.dtype != torch.int32 or tuple(allowed.shape) != (B, W):
        raise ValueError(f"allowed bitmask {allowed.dtype} {tuple(allowed.shape)} must be int32 [{B}, {W}] "
                         f"(B rows, ceil(V / 32) words for V = {V})")
    byte_shifts = torch.arange(0, BITMASK_WORD_BITS, 8, dtype=torch.int32, device=x.device)
    byte_values = (allowed.to(x.device).unsqueeze(-1) >> byte_shifts) & 0xFF            # [B, W, 4]
    bits = (torch.arange(256, device=x.device).unsqueeze(1) >> torch.arange(8, device=x.device)) & 1
    table = torch.where(bits == 1, math.inf, -math.inf).to(x.dtype)                     # [256, 8]
    limit = table.index_select(0, byte_values.flatten()).view(B, W * BITMASK_WORD_BITS)  # [B, 32 W]
    return torch.fmin(x, limit[:, :V])


def _apply_penalties(x: torch.Tensor, batch: SamplingBatch, penalties: PenaltyState) -> torch.Tensor:
    """Repetition (prompt + output tokens: positive logits / r, negative * r), presence and
    frequency (output tokens: x -= presence * [count > 0] + frequency * count), on [B, V] from the
    rows' device counts (docs/serving.md §10; OpenAI / vLLM definitions). Rows without penalties read
    the zero row with r = 1, presence = frequency = 0, which leaves them unchanged."""
    counts = penalties.counts.index_select(0, batch.penalty_rows)             # [B, V] int32
    if batch.draft_counts is not None:
        one = torch.ones_like(batch.draft_counts[0], dtype=torch.int32)
        counts = counts.index_put(batch.draft_counts, one, accumulate=True)
    out = counts > 0
    seen = penalties.prompt.index_select(0, batch.penalty_rows) | out
    r = batch.repetition.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - out * batch.presence.unsqueeze(1) - counts * batch.frequency.unsqueeze(1)


def _top_p_cut(sv: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Value cut [B, 1] of top-p on values ``sv`` [B, W] sorted descending (top-k already -inf):
    a token is kept iff the mass of strictly more likely tokens is < p, so the cut is the
    smallest kept value (ties kept together); -inf for p = 1."""
    w = torch.exp(sv - sv[:, :1])
    cum = w.cumsum(dim=1)
    before = (cum - w) / cum[:, -1:]                                            # mass strictly before
    p = top_p.unsqueeze(1)
    keep = (before < p) | (p >= 1)
    keep[:, 0] = True
    return sv.masked_fill(~keep, math.inf).min(dim=1, keepdim=True).values


def _scale(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """x [B, W] / each row's temperature, clamped to finite (a tiny temperature: no +inf)."""
    return (x / batch.temperature.unsqueeze(1)).clamp(max=_FMAX)


def _draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: first position whose cumulative weight exceeds u · total; w [B, W] >= 0 in the
    draw order, u [B] -> positions int64 [B, 1]."""
    cdf = w.cumsum(dim=1)
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=w.shape[1] - 1)  # NaN: in range


def _draw_rows(v: torch.Tensor, batch: SamplingBatch, u: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, None]:
    """top-k -> top-p -> min-p -> draw on whole rows v [B, V]; rows with k = 0 / p = 1 / min_p = 0
    untouched. Returns tokens [B] and the filtered values [B, V]."""
    v = _filter_rows(v, batch)
    tokens = _draw(torch.exp(v - v.max(dim=1, keepdim=True).values), u).squeeze(1)  # token-id order
    return tokens, v, None


def _filter_rows(v: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """top-k -> top-p -> min-p on whole rows v [B, V] (filtered values -inf)."""
    k = batch.top_k.unsqueeze(1)                                                # [B, 1]
    if batch.kmax:
        top = v.topk(batch.kmax, dim=-1).values                                 # [B, kmax] desc
        v = v.masked_fill(v < torch.where(k > 0, top.gather(1, (k - 1).clamp(min=0)), -math.inf), -math.inf)
    if batch.any_top_p:
        v = v.masked_fill(v < _top_p_cut(v.sort(dim=-1, descending=True).values, batch.top_p), -math.inf)
    if batch.any_min_p:
        v = v.masked_fill(v < v.max(dim=1, keepdim=True).values + torch.log(batch.min_p).unsqueeze(1),
                          -math.inf)                                            # log 0 = -inf
    return v


def _draw_window(x: torch.Tensor, batch: SamplingBatch, u: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_draw_rows` on the W = 2 max(k) + 16 largest values of each row of x [B, V] (before
    temperature, which keeps the order; every sampled row has top-k). Returns tokens [B], window
    values [B, W] (scaled, filtered, -inf past the kept set), their token ids [B, W] and overflow
    bool [B]: the window may miss tokens tied at the top-k boundary. Same values, cuts and sums
    in the same order as on whole rows, so the same tokens."""
    V = x.shape[1]
    W = min(V, 2 * batch.kmax + 16)
    cv, ci = x.topk(W, dim=-1)                                                  # [B, W] desc
    cv = _scale(cv, batch)
    k = batch.top_k.unsqueeze(1)
    kth = cv.gather(1, (k - 1).clamp(min=0))                                    # greedy rows: k = 0
    overflow = (cv[:, -1] >= kth.squeeze(1)) & (k.squeeze(1) > 0) & (W < V)
    cv = cv.masked_fill(cv < kth, -math.inf)
    if batch.any_top_p:
        cv = cv.masked_fill(cv < _top_p_cut(cv, batch.top_p), -math.inf)
    if batch.any_min_p:
        cv = cv.masked_fill(cv < cv[:, :1] + torch.log(batch.min_p).unsqueeze(1), -math.inf)
    order = torch.where(cv > -math.inf, ci, ci + V).argsort(dim=1)             # token-id order, dropped last
    pos = order.gather(1, _draw(torch.exp(cv.gather(1, order) - cv[:, :1]), u))
    return ci.gather(1, pos).squeeze(1), cv, ci, overflow
