"""Per-request state inside the engine, and what a step returns for it (token ids only).

One scheduling invariant (vLLM v1): a request has ``num_tokens`` tokens (prompt + generated) and
``num_computed_tokens`` of them have K/V in the cache; each step computes some of the difference.
There is no prefill or decode phase: a fresh prompt is far behind, a decoding request is one token
behind, a preempted request is reset to 0 and catches up again (recompute).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from m2serve.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is: waiting (queued or preempted), running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One sequence (n = 1) in the engine.

    prompt_token_ids: the prompt; output_token_ids: tokens generated so far (the sampler reads
    them for penalties); all_token_ids: prompt + output; num_computed_tokens: tokens whose K/V
    are in the cache; num_cached_tokens: prompt tokens served from the prefix cache at the first
    admission; generator: the request's seeded RNG (None = the engine's); in_reasoning: inside
    the ``<think>`` block (the sampler uses thinking_temperature there).
    arrival: admission order; the newest running request is preempted first.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: int
    eos_token_ids: tuple[int, ...] = ()
    max_length: int | None = None
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    in_reasoning: bool = False
    num_preemptions: int = 0
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] = field(default_factory=list)
    num_sent_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

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
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Record one sampled token (K/V for it are computed in the next step)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (token ids only; text lives in serve/).

    new_token_ids: tokens generated since the previous output of this request;
    finished / finish_reason: "stop" (EOS or a stop token id), "length" (max_tokens or the
    max context), "abort"; new_logprobs: one entry per new token, as the sampler returns them
    (None unless requested); prompt_logprobs: one entry per prompt token, first entry None
    (only in the first output of a request that asked for them); num_prompt_tokens,
    num_cached_tokens: prompt length and the prompt tokens served by the prefix cache.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
