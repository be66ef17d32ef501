"""The one API-neutral path from a request to the engine and back (STYLE.md §2).

Every API module (serve/openai/*, serve/anthropic/*) and the offline ``LLM`` (serve/llm.py) convert
their request into a :class:`ChatJob` (or, for /v1/completions and ``LLM.generate``, prompt token ids
and :class:`SamplingParams`), and the pipeline's typed results (:class:`ChoiceDelta` while streaming,
:class:`Choice` when collected) into their own output. This module is the only code that renders the
chat template, builds chat sampling parameters, parsers and engine requests (the n fan-out), and talks
to the :class:`AsyncEngine`:

    job = ChatJob(messages, tools, params=sampling_params(ctx, temperature=0.0, max_tokens=64))
    prepared = await prepare(ctx, job)                   # render, tokenise, length check, parser
    sub = submit(ctx, request, "chatcmpl-..", [prepared.ids], prepared.params, prepared.new_parser)
    async for d in stream(ctx, sub): ...d.pieces()...    # or: choices = await collect(ctx, request, sub)

The preparation (:func:`prepare_blocking`, :func:`engine_requests`) and the output assembly
(:func:`choice_delta`, :class:`ChoiceCollector`) are plain functions of a :class:`TextContext` (the
``LLM`` and the model's :class:`ModelCapabilities`; the server's ``ServeContext`` has the same two
fields): the server wraps them around the async engine, the offline ``LLM`` around its own engine
steps, so both follow the same rules.

Constrained decoding is attached here once for every API (docs/constrained-decoding.md): the API
modules only translate their fields into ``ChatJob.tool_choice`` / ``tool_name`` / ``output`` /
``reasoning_budget``; :func:`constraint_spec` picks the grammar, :func:`prepare` compiles it (a grammar
that does not compile is a 400 naming the request field) and every choice gets its own matcher.

Rules written once here: the n fan-out (:func:`engine_requests`: engine request ``{base}-{p}-{c}``;
choice index = prompt index x n + choice), the one-call rule (``parallel_tool_calls: false`` /
``disable_parallel_tool_use``: only the first call of a choice is returned, :func:`choice_delta`), the
split of one engine delta into stream pieces (reasoning, content, tool calls, then any logprobs left
over), the token accounting (usage and the access log) and the finished choice (docs/serving.md §10.1):
:class:`ChoiceAccumulator` builds one API-neutral :class:`Choice` per choice (reasoning, content, tool
calls complete or cut, their order, finish reason, stop string, logprobs), and every API's
non-streamed object, the final state of its stream and the stored history are translations of it, so
the rule for a call cut by the token limit lives in :meth:`CompletionOutput.returned_parts` only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from m2serve.engine.constraint import TokenConstraint
from m2serve.engine.request import prompt_length_error
from m2serve.engine.sampling import SamplingParams, TokenLogprobs
from m2serve.serve.async_engine import EngineDeadError, QueueFullError, StepFailedError
from m2serve.serve.context import AccessRecord, ModelCapabilities, ServeContext, access_record
from m2serve.serve.errors import APIError
from m2serve.serve.output import OutputDelta, OutputProcessor
from m2serve.text.constraint import (
    ConstraintSpec,
    choice_spec,
    free_spec,
    json_spec,
    lark_spec,
    no_tool_call_spec,
    regex_spec,
    tool_calls_spec,
)
from m2serve.text.parser import (
    StreamingParser,
    ToolCallDelta,
    opens_reasoning,
    opens_tool_block,
    starts_in_reasoning,
)
from m2serve.text.template import RESERVED_TEMPLATE_VARIABLES, TemplateError, normalize_messages

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the job


@dataclass(frozen=True, slots=True)
class TextContext:
    """What preparing a job and assembling its output read: ``llm`` (a :class:`~m2serve.serve.llm.LLM`:
    tokenizer, chat template, parser settings, grammar compiler, output processors) and ``caps``.
    The server's ``ServeContext`` carries the same two fields; the offline ``LLM`` builds one with
    :meth:`of`."""

    llm: Any
    caps: ModelCapabilities

    @staticmethod
    def of(llm: Any) -> TextContext:
        """The context of ``llm`` with its capabilities as they are now."""
        return TextContext(llm, ModelCapabilities.of(llm))


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """A structured-output request field: ``kind`` ``json`` (``value`` a JSON Schema, None = any
    object), ``regex`` (a pattern), ``choice`` (a list of strings) or ``grammar`` (Lark text);
    ``field`` is the request field named in errors (``response_format``, ``text.format``,
    ``output_config.format``, ``structured_outputs.json`` ...)."""

    kind: Literal["json", "regex", "choice", "grammar"]
    value: Any
    field: str


@dataclass(slots=True)
class ChatJob:
    """One chat request, whatever API it came through.

    messages: template-ready history (``role``, ``content`` string, ``reasoning_content``,
    ``tool_calls`` in OpenAI form, ``tool_call_id``); tools: OpenAI function tool dicts or None;
    tool_choice ``auto``, ``none`` (the tool-call tag can never be generated) or ``required`` (1 to
    ``max_tool_calls`` calls of the declared tools); tool_name: a named tool choice (exactly one call of
    that tool);
    output: the structured-output format (:class:`OutputFormat`) or None; reasoning_budget: the most
    reasoning tokens before ``</think>`` is forced (Anthropic ``thinking.budget_tokens``); params: from
    :func:`sampling_params`; reasoning_split: the parser mode (True split, False passthrough, None the
    server's --reasoning-parser); one_call: at most one tool call per choice (also in the grammar);
    max_tool_calls: the request's cap on the calls of a forced turn (Responses ``max_tool_calls``; None:
    the default cap of ``text.constraint.max_tool_calls``);
    messages_param / max_tokens_param: the request fields holding the history (``messages``,
    ``input``) and the output-token limit (``max_tokens``, ``max_completion_tokens``,
    ``max_output_tokens``), named in errors;
    max_tokens_is_cap: ``params.max_tokens`` is a cap clamped to the room left in the context
    (Anthropic's required ``max_tokens``, :func:`clamp_max_tokens`) instead of a 400 when prompt +
    max_tokens exceed it (the OpenAI routes, as vLLM answers);
    add_generation_prompt: end the prompt with the template's assistant header (vLLM's field);
    continue_final_message: the reply continues the last (assistant) message instead of starting a
    new turn (vLLM's field; Anthropic's prefilled assistant turn), see :func:`render_template`.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] = "auto"
    tool_name: str | None = None
    output: OutputFormat | None = None
    reasoning_budget: int | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    reasoning_split: bool | None = None
    one_call: bool = False
    max_tool_calls: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    messages_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    max_tokens_is_cap: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(slots=True)
class PreparedChat:
    """A rendered, tokenised job: prompt text, its ids, the chat sampling params, a parser factory and
    a constraint factory (None: unconstrained; else called once per choice)."""

    job: ChatJob
    prompt: str
    ids: list[int]
    params: SamplingParams
    new_parser: Callable[[str], StreamingParser | None]
    new_constraint: Callable[[], TokenConstraint] | None = None


@dataclass(slots=True)
class TokenUsage:
    """Token counts of one HTTP request: prompt (all prompts), output and reasoning (all choices),
    prompt tokens served from the prefix cache."""

    prompt: int = 0
    output: int = 0
    reasoning: int = 0
    cached: int = 0


@dataclass(slots=True)
class Submission:
    """The engine requests of one HTTP request: ids, their shared delta queue, and per request id the
    (prompt index, choice index) slot; counts kept and choices collected as deltas arrive."""

    request_ids: list[str]
    queue: asyncio.Queue
    slots: dict[str, tuple[int, int]]
    num_prompt_tokens: int
    one_call: bool
    record: AccessRecord
    constraints: dict[str, TokenConstraint] = field(default_factory=dict)  # rid -> its constraint
    out: dict[str, tuple[int, int]] = field(default_factory=dict)  # rid -> (output, reasoning) tokens
    cached: int = 0
    collector: ChoiceCollector = field(init=False)

    def __post_init__(self) -> None:
        self.collector = ChoiceCollector(self.slots)

    def usage(self) -> TokenUsage:
        return TokenUsage(
            self.num_prompt_tokens,
            sum(o for o, _ in self.out.values()),
            sum(r for _, r in self.out.values()),
            self.cached,
        )

    def _count(self, rid: str, d: OutputDelta) -> None:
        self.out[rid] = (d.num_output_tokens, d.num_reasoning_tokens)
        self.cached = max(self.cached, d.num_cached_tokens)
        self.record.completion_tokens = sum(o for o, _ in self.out.values())


PieceKind = Literal["reasoning", "content", "tool_calls", "logprobs"]


@dataclass(slots=True)
class Piece:
    """One stream piece of a delta: reasoning or content text, tool-call fragments, or logprobs of
    tokens whose text went nowhere (e.g. a parser tag). ``logprobs`` ride on the first piece."""

    kind: PieceKind
    text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None


def pieces(d: OutputDelta) -> list[Piece]:
    """The one stream split of an engine delta: reasoning, content, tool calls, the content the
    parser's finish step added (``d.tail``: e.g. the raw text of a cut call, which follows its last
    argument fragment), then leftover logprobs; the delta's logprobs ride on the first piece. Every
    stream and the finished choice (:class:`ChoiceAccumulator`) follow this order, so they agree
    (docs/serving.md §10.1)."""
    lps, out = d.logprobs, []
    tail = d.tail if d.tool_calls else ""
    head = d.content[: len(d.content) - len(tail)]
    for kind, text in (("reasoning", d.reasoning), ("content", head)):
        if text:
            out.append(Piece(kind, text, logprobs=lps))
            lps = None
    if d.tool_calls:
        out.append(Piece("tool_calls", tool_calls=d.tool_calls, logprobs=lps))
        lps = None
    if tail:
        out.append(Piece("content", tail))
    if lps:
        out.append(Piece("logprobs", logprobs=lps))
    return out


@dataclass(slots=True)
class ChoiceDelta:
    """One engine delta of one choice (its tool calls after the one-call rule) and its slot; on the
    choice's last delta, ``choice`` is the finished choice (the one result every API's final state is
    built from, docs/serving.md §10.1)."""

    index: int
    prompt_index: int
    delta: OutputDelta
    choice: Choice | None = None

    def pieces(self) -> list[Piece]:
        """:func:`pieces` of this delta."""
        return pieces(self.delta)


@dataclass(slots=True)
class ToolCallResult:
    """One tool call of a finished choice: id ``call_<24 hex>``, function name, arguments as a JSON
    string. ``complete`` False: a cut call, whose invoke never closed (generation stopped inside it);
    its ``arguments`` are the JSON prefix streamed so far (P24) and its raw text follows as content
    (P18)."""

    id: str
    name: str
    arguments: str
    complete: bool = True


OutputKind = Literal["reasoning", "content", "tool_call"]


@dataclass(slots=True)
class OutputPart:
    """One run of a finished choice's output, in stream order: ``reasoning`` or ``content`` text
    (adjacent pieces of one kind joined), or one tool ``call``."""

    kind: OutputKind
    text: str = ""
    call: ToolCallResult | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a finished request.

    text: raw generated text (stop string excluded); reasoning / content / tool_calls: the
    parser's result (chat; without a parser content == text), tool_calls the complete calls only;
    parts: the same output in stream order, cut calls included (:meth:`returned_parts` gives what an
    API returns); token_ids: generated ids; logprobs: one TokenLogprobs per generated token when
    requested.
    """

    index: int
    text: str = ""
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallResult] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_reasoning_tokens: int = 0
    parts: list[OutputPart] = field(default_factory=list)

    def returned_parts(self, streamed: bool) -> list[OutputPart]:
        """The parts an API returns (docs/serving.md §10.1). Not streamed: a cut call is no call, its
        raw text is the content that follows it (P18), so it is left out and the content around it
        joined. Streamed: a cut call's header already went out and cannot be taken back (P26), so the
        stream's final state keeps it, marked ``complete=False``."""
        if streamed:
            return list(self.parts)
        out: list[OutputPart] = []
        for part in self.parts:
            if part.call is not None and not part.call.complete:
                continue
            if out and part.kind == out[-1].kind and part.kind != "tool_call":
                out[-1] = OutputPart(part.kind, out[-1].text + part.text)
            else:
                out.append(part)
        return out

    def history_message(self) -> dict[str, Any]:
        """The choice as the assistant message of a later request's history (``content``,
        ``reasoning_content``, ``tool_calls`` in OpenAI form): the complete calls only, streamed or not
        (a cut call's raw text is in ``content``)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        return msg


class ChoiceAccumulator:
    """Collects the :class:`OutputDelta` stream of one choice into a :class:`CompletionOutput`, the
    finished-choice result every API translates (docs/serving.md §10.1)."""

    def __init__(self, index: int) -> None:
        self.out = CompletionOutput(index=index)
        self._text: list[str] = []
        self._parts: list[list[Any]] = []  # [kind, text pieces] or ["tool_call", call index]
        self._calls: dict[int, list[Any]] = {}  # call index -> [id, name, argument pieces]
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def add(self, d: OutputDelta) -> None:
        """Append one delta (in stream order)."""
        self._text.append(d.text)
        for piece in pieces(d):
            if piece.kind in ("reasoning", "content"):
                if self._parts and self._parts[-1][0] == piece.kind:
                    self._parts[-1][1].append(piece.text)
                else:
                    self._parts.append([piece.kind, [piece.text]])
            for tc in piece.tool_calls:
                if tc.index not in self._calls:
                    self._calls[tc.index] = [None, None, []]
                    self._parts.append(["tool_call", tc.index])
                slot = self._calls[tc.index]
                if tc.id is not None:
                    slot[0] = tc.id
                if tc.name is not None:
                    slot[1] = tc.name
                slot[2].append(tc.arguments)
        self.out.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if self.out.logprobs is None:
                self.out.logprobs = []
            self.out.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = list(d.prompt_logprobs)
        self.num_prompt_tokens = d.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = d.num_cached_tokens or self.num_cached_tokens
        self.out.num_reasoning_tokens = d.num_reasoning_tokens
        if d.finished:
            self.out.finish_reason = d.finish_reason
            self.out.stop_reason = d.stop_reason

    def result(self) -> CompletionOutput:
        """The accumulated choice; empty reasoning/content are None (docs/parsers.md P7). A call whose
        invoke never closed is a cut call (``complete`` False): its raw text is already content (P18),
        so ``tool_calls`` leaves it out. Arguments are a JSON object only once ``}`` arrives at
        ``</invoke>`` (P24), which is how a closed call is told apart."""
        o = self.out
        o.text = "".join(self._text)
        calls = {i: ToolCallResult(s[0], s[1], "".join(s[2]), _closed_arguments("".join(s[2])))
                 for i, s in self._calls.items()}
        o.parts = [OutputPart("tool_call", call=calls[p[1]]) if p[0] == "tool_call"
                   else OutputPart(p[0], "".join(p[1])) for p in self._parts]
        o.reasoning = "".join(p.text for p in o.parts if p.kind == "reasoning") or None
        o.content = "".join(p.text for p in o.parts if p.kind == "content") or None
        o.tool_calls = [c for _, c in sorted(calls.items()) if c.complete]
        return o


def _closed_arguments(arguments: str) -> bool:
    """Whether a call's streamed arguments are complete: a JSON object (P24: the growing prefix gets
    its closing ``}`` only at ``</invoke>``)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


@dataclass(slots=True)
class Choice:
    """One finished choice, the API-neutral result every API's non-streamed object and final stream
    state are built from (docs/serving.md §10.1): the accumulated output (tool calls after the
    one-call rule), its slot, the prompt's logprobs when requested, and the stop string that ended it
    (None: another reason)."""

    index: int
    prompt_index: int
    output: CompletionOutput
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_sequence: str | None = None


AnyContext = TextContext | ServeContext  # what the preparation and assembly functions read: llm, caps

# --------------------------------------------------------------------------- preparing


def output_format(kind: str | None, value: Any, field_name: str) -> OutputFormat | None:
    """The :class:`OutputFormat` of an OpenAI-style ``response_format`` / Responses ``text.format`` /
    Anthropic ``output_config.format``: ``text`` (or None) -> None, ``json_object`` -> any object,
    ``json_schema`` -> ``value`` (the schema, required); anything else is a 400 naming the field."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return OutputFormat("json", None, field_name)
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise APIError(400, f"{field_name}: a json_schema format needs its schema (a JSON object)",
                           param=field_name)
        return OutputFormat("json", value, field_name)
    raise APIError(400, f"{field_name}: type {kind!r} is not one of text, json_object, json_schema",
                   param=f"{field_name}.type")


# vLLM's structured_outputs options that tune its backends' JSON whitespace and fallback: accepted, no
# effect (JSON follows the chat template's style, docs/constrained-decoding.md, "structured_outputs").
_STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "whitespace_pattern")


def structured_outputs(value: Any) -> OutputFormat | None:
    """vLLM's ``structured_outputs`` extension: exactly one of ``json`` (a schema, or a JSON string of
    one), ``regex``, ``choice``, ``grammar`` (Lark), ``json_object: true`` (any JSON object); vLLM's
    whitespace / fallback options accepted and ignored. A 400 naming the field otherwise, an unknown
    key by name."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs: must be an object", param="structured_outputs")
    value = {k: v for k, v in value.items() if v is not None}   # vLLM's full object sends nulls
    kinds = ("json", "regex", "choice", "grammar")
    if value.get("disable_additional_properties") is True:
        raise APIError(400, "structured_outputs.disable_additional_properties: not supported; write "
                            '"additionalProperties": false in the schema', param="structured_outputs."
                            "disable_additional_properties")
    unknown = [k for k in value if k not in (*kinds, "json_object", "disable_additional_properties",
                                             *_STRUCTURED_OPTIONS)]
    if unknown:
        raise APIError(400, f"structured_outputs.{unknown[0]}: unknown or not supported; give exactly one of "
                            "json, regex, choice, grammar, json_object",
                       param=f"structured_outputs.{unknown[0]}")
    given = [k for k in kinds if value.get(k) is not None]
    if value.get("json_object") is not None and value["json_object"] is not False:
        if value["json_object"] is not True:
            raise APIError(400, "structured_outputs.json_object: must be true or false",
                           param="structured_outputs.json_object")
        given.append("json_object")
    if len(given) != 1:
        raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar, "
                            "json_object", param="structured_outputs")
    key = given[0]
    if key == "json_object":
        return OutputFormat("json", None, "structured_outputs.json_object")
    v = value[key]
    if key == "json" and isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise APIError(400, f"structured_outputs.json: not valid JSON ({e})",
                           param="structured_outputs.json") from e
    return OutputFormat(key, v, f"structured_outputs.{key}")  # type: ignore[arg-type]


def chat_output(response_format: dict[str, Any] | None, structured: Any) -> OutputFormat | None:
    """The structured-output format of an OpenAI chat request: ``response_format`` (``{"type": "text" |
    "json_object" | "json_schema", "json_schema": {"schema": {...}}}``) or vLLM's ``structured_outputs``
    (:func:`structured_outputs`), at most one of them; 400 naming the field otherwise."""
    output = structured_outputs(structured)
    if response_format is not None and response_format.get("type") != "text":
        if output is not None:
            raise APIError(400, "give response_format or structured_outputs, not both",
                           param="structured_outputs")
        js = response_format.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        output = output_format(response_format.get("type"), schema, "response_format")
    return output


def constraint_spec(job: ChatJob) -> ConstraintSpec | None:
    """The grammar a job's output must follow (docs/constrained-decoding.md), or None. A structured
    output format wins over ``tool_choice`` auto / none; with ``required`` or a named tool it is a 400,
    and so is either with a continued final message (the grammar would start after the continued text).
    Raises ValueError naming the field for a malformed format or tool."""
    calls = job.tool_choice == "required" or job.tool_name is not None
    if job.continue_final_message and (job.output is not None or calls):
        field_name = job.output.field if job.output is not None else "tool_choice"
        raise APIError(400, f"{field_name} cannot be combined with continuing the final assistant message "
                            "(continue_final_message, or a prefilled assistant turn): the constraint would "
                            "start a new value after the continued text; drop one of them", param=field_name)
    if job.output is not None:
        if calls:
            raise APIError(400, f"{job.output.field} cannot be combined with a required or named tool "
                                "choice (the output is either JSON or tool calls); drop one of them",
                           param="tool_choice")
        o = job.output
        make = {"json": json_spec, "regex": regex_spec, "choice": choice_spec, "grammar": lark_spec}[o.kind]
        return make(o.value, o.field)
    if calls:
        return tool_calls_spec(job.tools or [], job.tool_name, parallel_tool_calls=not job.one_call,
                               max_calls=job.max_tool_calls)
    if job.tool_choice == "none":
        return no_tool_call_spec()
    if job.reasoning_budget is not None:
        return free_spec()
    return None


def constraint_factory(ctx: AnyContext, spec: ConstraintSpec | None, reasoning: str,
                       budget: int | None) -> Callable[[], TokenConstraint] | None:
    """Compile ``spec`` (cached per spec) for outputs starting at ``reasoning`` (``inside`` /
    ``may_open`` / ``off``); returns a per-choice constraint factory, or None without a spec. A grammar
    that does not compile is a 400 naming the field llguidance's message starts with."""
    if spec is None:
        return None
    compiler = ctx.llm.grammar
    try:
        compiler.constraint(spec, reasoning, budget)  # type: ignore[arg-type]
    except ValueError as e:
        raise APIError(400, str(e), param=_error_field(str(e), spec.field)) from e
    return lambda: compiler.constraint(spec, reasoning, budget)  # type: ignore[arg-type]


def _error_field(message: str, default: str) -> str:
    """The request field a constraint error names: its prefix, ``tools`` for a tool's parameter."""
    head = message.split(":", 1)[0]
    if head.startswith(("tool ", "tools[")):
        return "tools"
    return head if " " not in head else default


def spec_or_400(job: ChatJob) -> ConstraintSpec | None:
    """:func:`constraint_spec` with its ValueError as a 400 naming the field."""
    try:
        return constraint_spec(job)
    except ValueError as e:
        field_name = job.output.field if job.output is not None else "tools"
        raise APIError(400, str(e), param=_error_field(str(e), field_name)) from e


def render_template(
    llm: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of a conversation under ``llm``'s chat template (docs/parsers.md §2); OpenAI's
    ``developer`` role is rendered as ``system`` (the system role of newer models);
    ``continue_final_message``: the prompt ends inside the final (assistant) message, right after its
    content (text/template.py ``ChatTemplate.render``). Raises the text layer's TemplateError for an
    invalid history and for ``kwargs`` naming a reserved variable."""
    clash = sorted(set(kwargs or {}) & set(RESERVED_TEMPLATE_VARIABLES))  # before they clash with render's
    if clash:
        raise TemplateError(f"chat_template_kwargs may not set {', '.join(clash)} "
                            "(reserved template variables)")
    msgs = [dict(m) for m in messages]
    for m in msgs:
        if m.get("role") == "developer":
            m["role"] = "system"
    return llm.template.render(msgs, tools=list(tools) if tools else None,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, **(kwargs or {}))


def render_prompt(
    ctx: AnyContext,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    messages_param: str = "messages",
    continue_final_message: bool = False,
) -> str:
    """:func:`render_template` with template errors as 400s."""
    try:
        return render_template(ctx.llm, messages, tools, kwargs, add_generation_prompt,
                               continue_final_message)
    except TemplateError as e:  # raise_exception, bad history: the request's fault
        param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else messages_param
        raise APIError(400, f"chat template error: {e}", param=param) from e
    except RecursionError as e:  # e.g. a tool schema nested thousands of levels deep
        raise APIError(
            400,
            f"{messages_param}, tools or chat_template_kwargs are nested too deeply to render "
            f"(Python's recursion limit {sys.getrecursionlimit()}); flatten them",
            param="tools" if tools else messages_param,
        ) from e


def encode(
    ctx: AnyContext,
    text: str,
    param: str,
    check_length: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``text``. A lone UTF-16 surrogate is a 400 naming ``param`` (or ``tools`` when the
    surrogate is in the tools). With ``check_length``, a text too long to fit the context whatever its
    tokenisation (more than max_length x the longest token's characters) is refused before
    tokenising: a huge body costs neither the tokenizer's time nor its memory."""
    e = _lone_surrogate(text)
    if e is not None:
        if tools and _lone_surrogate(json.dumps(tools, ensure_ascii=False)):
            param = "tools"
        raise APIError(
            400,
            f"{param}: contains a lone UTF-16 surrogate {text[e.start:e.end]!r} (not valid "
            "Unicode; a JSON \\uD800-\\uDFFF escape must be part of a surrogate pair)",
            param=param,
        ) from e
    caps = ctx.caps
    if check_length and len(text) > caps.max_length * caps.max_token_chars:
        raise APIError(
            400,
            f"the prompt has {len(text)} characters, more than the model's max context of "
            f"{caps.max_length} tokens can hold (a token covers at most "
            f"{caps.max_token_chars} characters); shorten it",
            param=param,
            code="context_length_exceeded",
        )
    return ctx.llm.encode(text)


def check_length(
    ctx: AnyContext, ids: list[int], param: str, max_tokens: int | None = None,
    max_tokens_param: str = "max_tokens",
) -> None:
    """400 unless the prompt leaves at least one token of the context to generate, and, when the
    request sets ``max_tokens``, room for all of them (a 400 with the three numbers, as vLLM answers,
    rather than a silently shorter answer)."""
    n, limit = len(ids), ctx.caps.max_length
    if max_tokens is not None and n < limit and n + max_tokens > limit:
        raise APIError(
            400,
            f"{max_tokens_param} is too large: {max_tokens}. This model's maximum context length is "
            f"{limit} tokens and your request has {n} input tokens ({max_tokens} > {limit} - {n}); "
            f"lower {max_tokens_param} to at most {limit - n} or shorten the prompt",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    too_long = prompt_length_error(len(ids), ctx.caps.max_length)
    if too_long:
        raise APIError(
            400,
            too_long,
            param=param,
            code="context_length_exceeded",
        )
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")


def clamp_max_tokens(ctx: AnyContext, params: SamplingParams, num_prompt_tokens: int,
                     max_tokens_param: str = "max_tokens") -> SamplingParams:
    """``params`` with ``max_tokens`` lowered to the room left in the context (max_length - prompt
    tokens) when it asks for more, with one debug log line; unchanged otherwise (also when the prompt
    alone fills the context: :func:`check_length` refuses that). Anthropic's ``max_tokens`` is a
    required cap, not a promise: a client sending 128000 to a 4,096-token model gets what fits, and
    ``stop_reason`` ``max_tokens`` when it is reached (docs/serving.md §10)."""
    room = ctx.caps.max_length - num_prompt_tokens
    if params.max_tokens is None or room <= 0 or params.max_tokens <= room:
        return params
    log.debug("%s %d clamped to %d: the prompt has %d tokens of the %d-token context", max_tokens_param,
              params.max_tokens, room, num_prompt_tokens, ctx.caps.max_length)
    return replace(params, max_tokens=room)


def check_token_ids(ctx: AnyContext, ids: list[int], param: str, what: str = "token id") -> None:
    """400 for an id outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < ctx.caps.vocab_size]
    if bad:
        raise APIError(400, f"{what} {bad[0]} is outside the vocabulary [0, {ctx.caps.vocab_size})",
                       param=param)


# OpenAI's reasoning effort levels (Chat ``reasoning_effort``, Responses ``reasoning.effort``; the openai
# SDK's ReasoningEffort) as reasoning budgets in tokens: ``</think>`` is forced after that many reasoning
# tokens, the mechanism of Anthropic's ``thinking.budget_tokens`` (docs/serving.md §10). None: no budget.
REASONING_BUDGETS: dict[str, int | None] = {
    "none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": None,
}


def effort_budget(effort: Any, param: str) -> int | None:
    """The reasoning budget (tokens, None = none) of an OpenAI reasoning effort level; None when the
    request sent none. Raises APIError 400 naming ``param`` for a value not in :data:`REASONING_BUDGETS`."""
    if effort is None:
        return None
    if not isinstance(effort, str) or effort not in REASONING_BUDGETS:
        raise APIError(400, f"{param}: {effort!r} is not one of {', '.join(REASONING_BUDGETS)}", param=param)
    return REASONING_BUDGETS[effort]


def sampling_params(
    ctx: AnyContext, renames: dict[str, str] | None = None, **fields: Any
) -> SamplingParams:
    """:class:`SamplingParams` from request fields (None = the checkpoint's default). An invalid value
    is a 400 naming the field, under the API's own name (``renames``: SamplingParams name -> wire name,
    e.g. ``max_tokens`` -> ``max_output_tokens``)."""
    try:
        p = SamplingParams(**fields)
        p.check_token_ids(ctx.caps.vocab_size)
    except ValueError as e:  # "invalid sampling parameter <field>...": the field is the param
        m = re.match(r"invalid sampling parameter (\w+)", str(e))
        param = (renames or {}).get(m.group(1), m.group(1)) if m else None
        message = str(e) if m is None else str(e).replace(m.group(1), param, 1)  # the wire name
        raise APIError(400, message, param=param) from e
    return p


def reasoning_mode(llm: Any, reasoning_split: bool | None) -> str | None:
    """Parser mode of a chat job: ``split`` / ``passthrough`` from the job's ``reasoning_split``, else
    from ``llm.reasoning_parser``; None = no reasoning parsing (``--reasoning-parser none``)."""
    if reasoning_split is not None:
        return "split" if reasoning_split else "passthrough"
    return {"minimax_m2": "split", "minimax_m2_append_think": "passthrough"}.get(llm.reasoning_parser)


def starts_reasoning(job: ChatJob, prompt: str) -> bool:
    """P1, the state the output starts in: reasoning when the prompt ends in ``<think>``, or when the
    job continues a final message whose text opens a ``<think>`` it does not close (a prefill of
    reasoning: docs/parsers.md §2; the template writes that text as given, so the prompt does not end
    in the tag)."""
    text = continued_text(job)   # "" unless continuing; a 400 for a text ending inside a tool call
    return starts_in_reasoning(prompt) or opens_reasoning(text)


def continued_text(job: ChatJob) -> str:
    """The text of the message a job continues (its last, ``continue_final_message``), else "". A
    text that opens a tool-call block it does not close is a 400 naming the message: the
    continuation would start inside a call, which the parser cannot read (and would cut)."""
    if not job.continue_final_message or not job.messages:
        return ""
    content = normalize_messages(job.messages[-1:])[0].get("content")   # text parts joined, as rendered
    text = content if isinstance(content, str) else ""
    if opens_tool_block(text):
        index = len(job.messages) - 1
        raise APIError(400, f"{job.messages_param}[{index}]: a continued assistant message cannot end inside "
                            "a tool call (<minimax:tool_call> without its end); send the call as tool_calls",
                       param=job.messages_param)
    return text


def chat_params(llm: Any, params: SamplingParams, in_reasoning: bool,
                reasoning_budget: int | None = None) -> SamplingParams:
    """``params`` with the reasoning-state fields the sampler needs for thinking_temperature (the
    request's, else ``llm.thinking_temperature``; docs/serving.md §10) and the checkpoint's reasoning
    cap (generation_config.json ``max_reasoning_tokens``: a reply still reasoning after that many
    tokens ends with ``length``) unless the params set one, the job has its own ``reasoning_budget``
    (which forces ``</think>`` instead), or the request asks for its length (``ignore_eos``,
    ``min_tokens``: benchmarks); ``in_reasoning``: the output starts in reasoning
    (:func:`starts_reasoning`)."""
    thinking = params.thinking_temperature
    if thinking is None:
        thinking = llm.thinking_temperature
    cap = params.max_reasoning_tokens
    if cap is None and reasoning_budget is None and not params.ignore_eos and not params.min_tokens:
        cap = llm.config.generation.max_reasoning_tokens
    return replace(
        params,
        thinking_temperature=thinking,
        start_in_reasoning=in_reasoning,
        reasoning_end_token_ids=llm.reasoning_end_ids,
        max_reasoning_tokens=cap,
    )


def new_parser(
    llm: Any, in_reasoning: bool, tools: list[dict[str, Any]] | None, mode: str | None, request_id: str = "",
    continued: bool = False,
) -> StreamingParser | None:
    """A streaming parser for one chat choice, or None when nothing is to be parsed. ``in_reasoning``:
    the output starts in reasoning (:func:`starts_reasoning`); ``continued``: it continues a final
    message, whose text already holds any ``<think>`` (no P7 prefix in passthrough).

    mode None (``--reasoning-parser none``): reasoning is not parsed; if tools are on, the parser runs
    in passthrough mode from the CONTENT state, so only tool blocks are extracted. Tools are not parsed
    under ``--tool-parser none``."""
    use_tools = bool(tools) and llm.tool_parser != "none"
    if mode is None and not use_tools:
        return None
    return StreamingParser(
        tools=list(tools) if use_tools else None,
        mode=mode or "passthrough",
        start_in_reasoning=in_reasoning and mode is not None,
        emit_think_prefix=not continued,
        request_id=request_id,
    )


def prepare_blocking(ctx: AnyContext, job: ChatJob) -> PreparedChat:
    """Prepare ``job`` on the calling thread: pick and compile its constraint, render, tokenise, check
    its length, add the reasoning-state sampling fields; the parser factory honours tool_choice
    ``none`` (tools rendered, calls not parsed). Raises APIError (400 naming the field)."""
    llm = ctx.llm
    spec = spec_or_400(job)
    prompt = render_prompt(ctx, job.messages, job.tools, job.chat_template_kwargs, job.add_generation_prompt,
                           job.messages_param, job.continue_final_message)
    ids = encode(ctx, prompt, job.messages_param, check_length=True, tools=job.tools)
    in_reasoning = starts_reasoning(job, prompt)
    params = chat_params(llm, job.params, in_reasoning, job.reasoning_budget)
    reasoning = "inside" if params.start_in_reasoning else "may_open"
    new_constraint = constraint_factory(ctx, spec, reasoning, job.reasoning_budget)
    if job.max_tokens_is_cap:
        params = clamp_max_tokens(ctx, params, len(ids), job.max_tokens_param)
    check_length(ctx, ids, job.messages_param, params.max_tokens, job.max_tokens_param)
    tools = job.tools if job.tools and job.tool_choice != "none" else None
    mode = reasoning_mode(llm, job.reasoning_split)
    return PreparedChat(job, prompt, ids, params,
                        lambda rid: new_parser(llm, in_reasoning, tools, mode, rid,
                                               job.continue_final_message),
                        new_constraint)


async def prepare(ctx: ServeContext, job: ChatJob) -> PreparedChat:
    """:func:`prepare_blocking` off the event loop (rendering, tokenising and compiling take time).
    Under ``--exclude-tools-when-tool-choice-none`` a ``tool_choice`` none job renders no tools."""
    if job.tool_choice == "none" and job.tools and ctx.settings.exclude_tools_when_tool_choice_none:
        job = replace(job, tools=None)
    return await run_in_threadpool(prepare_blocking, ctx, job)


# --------------------------------------------------------------------------- engine


@dataclass(slots=True)
class EngineRequest:
    """One engine request of a job (n = 1): its id, prompt ids, sampling params, output processor and
    constraint (None: unconstrained), and the (prompt index, choice index) slot of its choice."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    processor: OutputProcessor
    constraint: TokenConstraint | None
    slot: tuple[int, int]


def engine_requests(
    ctx: AnyContext,
    base_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    new_parser: Callable[[str], StreamingParser | None] | None = None,
    skip_special_tokens: bool = True,
    new_constraint: Callable[[], TokenConstraint] | None = None,
) -> Iterator[EngineRequest]:
    """The n fan-out, for the server and the offline ``LLM`` alike: for each prompt p and choice
    c < ``params.n``, engine request ``{base_id}-{p}-{c}`` with ``params.child(c)`` (n = 1, seed + c),
    choice index ``p * n + c``, its own parser from ``new_parser`` and constraint from
    ``new_constraint``. Built lazily, one request at a time."""
    for p, ids in enumerate(prompts):
        for c in range(params.n):
            rid, child = f"{base_id}-{p}-{c}", params.child(c)
            parser = new_parser(rid) if new_parser is not None else None
            proc = ctx.llm.new_processor(rid, child, parser, skip_special_tokens)
            constraint = new_constraint() if new_constraint is not None else None
            yield EngineRequest(rid, ids, child, proc, constraint, (p, p * params.n + c))


def submit(
    ctx: ServeContext,
    request: Request,
    base_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    new_parser: Callable[[str], StreamingParser | None] | None = None,
    skip_special_tokens: bool = True,
    one_call: bool = False,
    new_constraint: Callable[[], TokenConstraint] | None = None,
) -> Submission:
    """Queue the engine requests of :func:`engine_requests` (``params.n`` choices of each prompt) into
    one shared delta queue. 503 + Retry-After when the queue is full or the engine is down (nothing
    stays queued)."""
    engine, q = ctx.engine, asyncio.Queue()
    rids: list[str] = []
    slots: dict[str, tuple[int, int]] = {}
    constraints: dict[str, TokenConstraint] = {}
    retry = {"Retry-After": str(ctx.settings.retry_after_s)}
    if ctx.closing:
        raise APIError(503, "the server is shutting down; retry on another replica or after the restart",
                       "server_error", code="server_shutdown", headers=retry)
    try:
        for r in engine_requests(ctx, base_id, prompts, params, new_parser, skip_special_tokens,
                                 new_constraint):
            engine.submit(r.request_id, r.prompt_token_ids, r.params, r.processor, q, constraint=r.constraint)
            rids.append(r.request_id)
            slots[r.request_id] = r.slot
            if r.constraint is not None:
                constraints[r.request_id] = r.constraint
    except QueueFullError as e:
        for rid in rids:
            engine.abort(rid)
        raise APIError(503, str(e), "server_error", code="queue_full", headers=retry) from e
    except EngineDeadError as e:
        for rid in rids:
            engine.abort(rid)
        raise APIError(503, str(e), "server_error", headers=retry) from e
    record = access_record(request.scope)
    n_prompt = record.prompt_tokens = sum(len(ids) for ids in prompts)
    ctx.live[q] = base_id
    return Submission(rids, q, slots, n_prompt, one_call, record, constraints)


class ServerClosing(Exception):
    """Ends a stream at the shutdown deadline (put into its delta queue by :func:`end_in_flight`)."""


def end_in_flight(ctx: ServeContext, grace_s: float) -> int:
    """At the shutdown deadline: refuse new submissions and end every request still streaming, each
    in its API's shape (the stream's error event and terminal events, or a 503 body), with one log
    line per request. Its engine requests are aborted as the stream ends. Returns how many ended."""
    ctx.closing = True
    live = list(ctx.live.items())
    for q, base_id in live:
        log.warning("request %s aborted: the server is shutting down and its grace period "
                    "(--grace-period %g s) ended before the request finished", base_id, grace_s)
        q.put_nowait(ServerClosing(f"the server is shutting down: its grace period ({grace_s:g} s) ended "
                                   "before this request finished; retry it"))
    return len(live)


def engine_error(e: BaseException) -> APIError:
    """An engine failure as an APIError: rejected at admission 400, failed step 500, dead engine or
    server shutdown 503."""
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, ServerClosing):
        return APIError(503, str(e), "server_error", code="server_shutdown")
    if isinstance(e, StepFailedError):
        return APIError(500, str(e), "server_error")
    return APIError(503, str(e), "server_error")


def grammar_failure(constraint: TokenConstraint | None) -> str | None:
    """The 400 message of a choice whose grammar failed while it decoded (``GrammarConstraint.failure``:
    a grammar that compiled but cannot go on), else None. The engine ends such a choice with "stop";
    answered as that, it looked like an empty success (docs/constrained-decoding.md). The server
    answers it as a 400 (or its stream's error event), the offline ``LLM`` raises it as a ValueError."""
    failure = getattr(constraint, "failure", None)
    return failure() if callable(failure) else None


async def stream(ctx: ServeContext, sub: Submission) -> AsyncIterator[ChoiceDelta]:
    """The submission's deltas as they come, each choice's last one carrying the finished
    :class:`Choice` (docs/serving.md §10.1). An engine failure is raised as an APIError (the caller
    sends it in its API's stream shape); leaving the loop early aborts what is still running."""
    try:
        async for d in ctx.engine.stream(sub.request_ids, sub.queue):
            sub._count(d.request_id, d)
            failure = grammar_failure(sub.constraints.get(d.request_id)) if d.finished else None
            if failure is not None:
                sub.record.error = failure
                raise APIError(400, failure, param=_error_field(failure, "response_format"))
            cd = choice_delta(sub.slots, sub.one_call, d)
            sub.collector.add(cd)
            if d.finished:
                cd.choice = sub.collector.choice(d.request_id)
            yield cd
    except (ValueError, EngineDeadError, ServerClosing) as e:
        err = engine_error(e)
        sub.record.error = err.message
        raise err from e
    finally:
        ctx.live.pop(sub.queue, None)


async def consume(
    ctx: ServeContext, request: Request, sub: Submission, on_delta: Callable[[ChoiceDelta], None]
) -> None:
    """Feed every delta of ``sub`` to ``on_delta`` until all choices finish (a non-streamed response);
    abort them if the client disconnects meanwhile (499)."""

    async def run() -> None:
        async for d in stream(ctx, sub):
            on_delta(d)

    task = asyncio.ensure_future(run())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # the stream's finally aborts the requests, freeing their pages
                await asyncio.wait([task])
                raise APIError(499, "client closed the request", code="client_closed_request")
        task.result()
    finally:
        if not task.done():
            task.cancel()


def choice_delta(slots: dict[str, tuple[int, int]], one_call: bool, d: OutputDelta) -> ChoiceDelta:
    """An engine delta as its choice's delta (``slots``: request id -> (prompt index, choice index));
    with ``one_call`` only the choice's first tool call is kept (the one-call rule)."""
    p, index = slots[d.request_id]
    if one_call:
        d.tool_calls = [tc for tc in d.tool_calls if tc.index == 0]
    return ChoiceDelta(index, p, d)


class ChoiceCollector:
    """Assembles the finished :class:`Choice` of each engine request of ``slots`` (request id ->
    (prompt index, choice index)) from its :class:`ChoiceDelta` stream: the server's :func:`collect`
    and the offline ``LLM`` alike."""

    def __init__(self, slots: dict[str, tuple[int, int]]) -> None:
        self.slots = slots
        self.accs = {rid: ChoiceAccumulator(index) for rid, (_, index) in slots.items()}

    def add(self, d: ChoiceDelta) -> None:
        """Append one delta (in stream order)."""
        self.accs[d.delta.request_id].add(d.delta)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (the most of any choice)."""
        return max((a.num_cached_tokens for a in self.accs.values()), default=0)

    def choice(self, rid: str) -> Choice:
        """The choice of engine request ``rid`` as collected so far (finished: the final result);
        ``stop_sequence``: the stop string that ended it (the detokeniser's match, ``stop_reason``)."""
        acc = self.accs[rid]
        o = acc.result()
        stop = o.stop_reason if isinstance(o.stop_reason, str) else None
        return Choice(o.index, self.slots[rid][0], o, acc.prompt_logprobs, stop)

    def choices(self) -> list[Choice]:
        """Every choice, in choice order (:meth:`choice`)."""
        return sorted((self.choice(rid) for rid in self.accs), key=lambda c: c.index)


async def collect(ctx: ServeContext, request: Request, sub: Submission) -> list[Choice]:
    """Every choice of ``sub`` once finished, in choice order (collected by :func:`stream`)."""
    await consume(ctx, request, sub, lambda d: None)
    return sub.collector.choices()


def _lone_surrogate(text: str) -> UnicodeEncodeError | None:
    """The UnicodeEncodeError of ``text``'s first lone UTF-16 surrogate, or None when it has none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e
    return None
