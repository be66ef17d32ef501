"""Per-request state inside the engine, and what a step returns for it (token ids only).

One scheduling invariant (vLLM v1): a request has ``num_tokens`` tokens (prompt + generated) and
``num_computed_tokens`` of them have K/V in the cache; each step computes some of the difference.
There is no prefill or decode phase: a fresh prompt is far behind, a decoding request is one token
behind, a preempted request is reset to 0 and catches up again (recompute).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from m2serve.engine.constraint import TokenConstraint
from m2serve.engine.sampling import SamplingParams, SamplingState, TokenLogprobs
from m2serve.engine.speculative import NgramIndex


def prompt_length_error(num_prompt_tokens: int, max_length: int) -> str | None:
    """The one prompt-length rule (engine and every API): a prompt must leave at least one token of
    the context to generate, i.e. ``num_prompt_tokens + 1 <= max_length`` (both in tokens). Returns
    the reason naming both numbers, or None when the prompt fits."""
    if num_prompt_tokens + 1 <= max_length:
        return None
    return (f"the prompt has {num_prompt_tokens} tokens but the max context of {max_length} tokens "
            f"must leave at least one to generate (prompt + 1 <= {max_length}); shorten the prompt "
            f"or raise max_length")


class RequestStatus(enum.Enum):
    """Where a request is: waiting (queued or preempted), running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One sequence (n = 1) in the engine.

    prompt_token_ids: the prompt; all_token_ids: prompt + generated tokens, the request's one
    token list (``Scheduler.update_from_output`` appends to it); state: the sampler's
    per-request state (resolved params, stream seed, reasoning state, penalty row;
    engine/sampling.py), which survives preemption; constraint: an optional `TokenConstraint`
    (engine/constraint.py); num_computed_tokens: tokens whose K/V are in the cache;
    num_cached_tokens: prompt tokens served from the prefix cache at the first admission (-1
    before it); arrival: admission order (the newest running request is preempted
    first); max_length: the max context in tokens; logprobs / prompt_logprobs: accumulated
    entries; num_sent_tokens: output tokens already returned in a RequestOutput; replica: the
    data-parallel replica that owns it (chosen once at admission, kept through preemption;
    engine/scheduler.py ``choose_replica``; always 0 with one replica); ngram_index: the
    speculative proposer's index over ``all_token_ids`` (engine/speculative.py `NgramIndex`, made
    at the request's first draft; None without speculative decoding, docs/serving.md §13);
    draft_proposal: the EAGLE-3 draft's proposal for the next step (engine/eagle.py
    `DraftProposal`, docs/serving.md §14), None when there is none.
    """

    request_id: str
    prompt_token_ids: list[int]
    state: SamplingState
    arrival: int
    max_length: int
    constraint: TokenConstraint | None = None
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_sent_tokens: int = 0
    replica: int = 0
    ngram_index: NgramIndex | None = None
    draft_proposal: Any = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def sampling_params(self) -> SamplingParams:
        """The request's resolved sampling parameters."""
        return self.state.params

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far (a copy of the tail of ``all_token_ids``)."""
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is RequestStatus.FINISHED


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (token ids only; text lives in serve/).

    new_token_ids: tokens generated since the previous output of this request;
    finished / finish_reason: "stop" (EOS, a stop token id or a terminated constraint), "length"
    (max_tokens or the max context), "abort"; new_logprobs: one `TokenLogprobs` per new token
    (None unless requested); prompt_logprobs: one entry per prompt token, first entry None
    (only in the first output of a request that asked for them); num_prompt_tokens,
    num_cached_tokens: prompt length and the prompt tokens served by the prefix cache;
    num_reasoning_tokens: output tokens generated in reasoning so far (`SamplingState.observe`).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_reasoning_tokens: int = 0
