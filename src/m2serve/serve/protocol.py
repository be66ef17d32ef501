"""OpenAI-compatible request and response types (docs/serving.md §10, docs/parsers.md §3).

Pydantic lives only here, at the HTTP edge. A request's top level accepts and ignores the fields
m2serve has no use for (``store``, ``metadata``, ``service_tier``, ``verbosity`` ... and whatever a
newer SDK adds), each request logging one DEBUG line naming them (:class:`APIRequest`): a client must
never fail on a field its SDK sends. The fields m2serve uses are validated strictly: ``"10"`` is not
an integer, ``"yes"`` not a boolean and ``true`` not a token id or a count (each a 400 naming the
field). Responses mirror the OpenAI shapes the
official ``openai`` client parses; extensions (``reasoning_content``, ``top_k`` ...) are listed in
docs/serving.md §10.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from m2serve.engine.sampling import MAX_REPETITION_PENALTY

log = logging.getLogger(__name__)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class APIRequest(BaseModel):
    """Base of every API's request body: declared fields strict, others accepted and ignored, with one
    DEBUG line per request naming them (``m2serve.serve.protocol``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _log_ignored(self) -> APIRequest:
        if self.model_extra:
            log.debug("%s: ignoring fields m2serve has no use for: %s", type(self).__name__,
                      ", ".join(sorted(self.model_extra)))
        return self


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # include_obfuscation ...: ignored
    include_usage: bool = False


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]


# Request-size limits (a bad request gets a 400 naming the field, not an unbounded amount of work).
MAX_STOP_STRINGS = 64  # OpenAI allows 4; vLLM is unbounded: generous, but every one is scanned per token
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPTS = 1024  # entries of a batched /v1/completions prompt
MAX_SEQUENCES = 1024  # prompts x n of one /v1/completions request (each is an engine request)
# Messages (Responses: input items) of one conversation: Anthropic's documented per-request limit. Checked
# while the body is validated, on the event loop: before, half a million ``{"role": "user"}`` (8 MiB)
# stalled every other request for seconds and cost ~20 s of rendering before the context check refused it.
MAX_MESSAGES = 100_000
# Tools of one request: OpenAI allows 128; generous, but before, 200,000 tiny tools (5 MiB) held the event
# loop ~3 s while validated and cost ~8 s of rendering before the context check refused them.
MAX_TOOLS = 4096


class _SamplingFields(APIRequest):
    """Fields shared by chat and completions requests: the OpenAI ones and docs/serving.md §10 extensions."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=64)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (docs/serving.md §10)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None  # vLLM: one of json, regex, choice, grammar, json_object
    # vLLM's older names of structured_outputs' kinds (guided_decoding_backend and
    # guided_whitespace_pattern are ignored like any unused field)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @model_validator(mode="after")
    def _guided_as_structured_outputs(self) -> _SamplingFields:
        """vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` are the
        ``structured_outputs`` kinds of those names (older clients still send them); with
        ``structured_outputs`` too it is a 400."""
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{k}") is not None}
        if guided:
            if self.structured_outputs is not None:
                raise ValueError(f"structured_outputs: give it or vLLM's older guided_{next(iter(guided))}, "
                                 "not both")
            self.structured_outputs = guided
        return self

    def stop_list(self) -> list[str]:
        """``stop`` as a list (OpenAI allows one string or a list of up to 4)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class ChatMessage(BaseModel):
    """One history message. Extra keys (``reasoning``, ``thinking``, ``name``) pass to the template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _tool_needs_call_id(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the assistant's tool call it "
                             "answers)")
        return self


def _continue_rule(req: Any) -> Any:
    """vLLM's rule for ``continue_final_message`` (chat and /tokenize): a continued final message gets no
    generation prompt. Left unset, ``add_generation_prompt`` is off with it; both sent true is a 400."""
    if req.continue_final_message and req.add_generation_prompt:
        if "add_generation_prompt" in req.model_fields_set:
            raise ValueError("continue_final_message: cannot be true with add_generation_prompt true "
                             "(the reply continues the last message; no new turn is opened)")
        req.add_generation_prompt = False
    return req


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_split: bool | None = None
    thinking_temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    reasoning_effort: str | None = None  # a reasoning budget: chat_pipeline.REASONING_BUDGETS
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _continue_without_generation_prompt(self) -> ChatCompletionRequest:
        return _continue_rule(self)

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (newer name) or else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None
    max_tokens: int | None = Field(default=16, ge=1)

    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(APIRequest):
    """vLLM's /tokenize body. ``add_special_tokens`` is accepted and changes nothing (m2serve's
    tokenizer adds none: a chat prompt's markers come from the template, a raw prompt is encoded as
    given, as /v1/completions encodes it); ``return_token_strs`` adds each id's token string."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _continue_without_generation_prompt(self) -> TokenizeRequest:
        return _continue_rule(self)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses


def sse(data: Any, event: str | None = None) -> str:
    """One Server-Sent Events frame: ``data: <json>`` (non-ASCII kept), preceded by ``event: <event>``
    when given (Anthropic and Responses streams name each event; OpenAI chat streams do not)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    """``prefix-<32 hex>``, e.g. ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop_token_ids id that ended it


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "m2serve"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]

