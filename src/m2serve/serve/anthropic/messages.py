"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the chat pipeline
(https://docs.anthropic.com/en/api/messages, anthropic SDK 2.15).

Request -> :class:`ChatJob` (:func:`messages_job`):

- ``system`` (string or text blocks) -> a system message; ``messages`` content as a string or blocks:
  ``text``; ``thinking`` (its ``signature`` checked against this server's key: one that does not verify
  is still used and a warning is logged) and ``redacted_thinking`` (not produced here: dropped);
  ``tool_use`` -> the assistant's ``tool_calls``; ``tool_result`` (string or text blocks, ``is_error``
  -> the text is prefixed ``Error: ``; its ``tool_use_id`` must name a ``tool_use`` of an earlier
  assistant message) -> ``tool`` messages; ``image`` / ``document`` -> 400 (text-only
  model). Thinking blocks sent back become the assistant's ``reasoning_content``, so the template keeps
  the current tool loop's reasoning (interleaved thinking, docs/parsers.md §2).
- ``max_tokens`` (required) is a cap: clamped to the room the prompt leaves in the context
  (``stop_reason`` ``max_tokens`` when reached), where the OpenAI routes answer 400;
  ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``: sampling; the official SDK sends none of
  the last three, so the checkpoint's generation defaults apply.
- ``tools`` (``input_schema``); ``tool_choice`` ``auto``, ``none`` (no tool-call syntax can be
  generated), ``any`` (1 to N calls of the declared tools, N = their number), ``tool`` (one call of
  that tool); ``disable_parallel_tool_use`` -> exactly one tool_use (docs/constrained-decoding.md,
  "Tool-call cap").
- a last message of role ``assistant`` is a prefilled response: the reply continues its text (no new
  turn; the returned content is the continuation), as the Messages API does.
- ``thinking``: ``enabled`` / ``adaptive`` / ``between_tools`` / absent return the reasoning as thinking
  blocks (M2 always reasons: its template opens ``<think>``); ``disabled`` drops them.
  ``budget_tokens`` is the reasoning budget: ``</think>`` is forced after that many reasoning tokens
  (a cap like ``max_tokens``: a budget beyond the context is clamped to it, so Claude Code's
  ``max_tokens`` 32000 with ``budget_tokens`` 31999 runs on a shorter context; OpenAI's reasoning
  effort levels map to the same budgets, ``chat_pipeline.REASONING_BUDGETS``).
- ``output_config.format`` (``{"type": "json_schema", "schema": ...}``): the text after the reasoning
  is JSON matching the schema; ``output_config.effort``, ``metadata``, ``cache_control`` and unknown
  fields are ignored.

The finished choice of the pipeline -> the non-streamed message (:func:`message`): its returned parts
as ``thinking`` (signed, serve/sealing.py), ``text`` and ``tool_use`` blocks (docs/serving.md §10.1:
a call cut by the token limit is text, never a ``tool_use``). Pipeline deltas -> stream events
(:class:`MessageStream`: ``message_start``, ``ping``, ``content_block_start`` / ``_delta``
(``thinking_delta``, ``signature_delta``, ``text_delta``, ``input_json_delta``) / ``_stop``,
``message_delta``, ``message_stop``), the stop reason from the same finished choice; the events
assemble to the non-streamed message except for a cut call whose block already started. tool_use ids
are ``toolu_`` + the parser's 24 hex digits; ``stop_reason`` ``end_turn`` / ``max_tokens`` /
``stop_sequence`` / ``tool_use``; usage: input (not from the prefix
cache), output and cache-read tokens.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from m2serve.serve import chat_pipeline as cp
from m2serve.serve.anthropic.protocol import CountTokensRequest, MessagesRequest
from m2serve.serve.context import ServeContext
from m2serve.serve.errors import APIError, anthropic_error_body, json_type, typed_field
from m2serve.serve.protocol import new_id, sse
from m2serve.serve.sealing import Sealer

log = logging.getLogger(__name__)

router = APIRouter()

_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


# --------------------------------------------------------------------------- request -> chat job


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks (tool_result content, system)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, f"{where}: must be a string or a list of text blocks, got "
                            f"{json_type(blocks)}", param=where)
    parts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else json_type(b)
            raise APIError(400, f"{where}.{j}: a {kind!r} block is not supported here; the served model is "
                                "text-only (send text blocks)", param=f"{where}.{j}")
        parts.append(typed_field(b, "text", str, f"{where}.{j}"))
    return "".join(parts)


def chat_messages(req: CountTokensRequest, sealer: Sealer) -> list[dict[str, Any]]:
    """The template-ready history of an Anthropic request (see the module docstring). Each block's
    fields are checked (a 400 naming ``messages.<i>.content.<j>.<field>``); a ``tool_result`` must
    answer a ``tool_use`` of an earlier assistant message."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    tool_use_ids: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, reasoning, calls, results = [], [], [], []
        for j, raw in enumerate(m.content):
            at = f"{where}.{j}"
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind in ("image", "document"):
                raise APIError(400, f"{at}: {kind} content is not supported; the served model is text-only",
                               param=f"{at}.type")
            if kind == "text":
                texts.append(typed_field(raw, "text", str, at))
            elif kind == "thinking" and m.role == "assistant":
                text = typed_field(raw, "thinking", str, at)
                if not sealer.verify(text, typed_field(raw, "signature", str, at, required=False)):
                    log.warning("%s: the thinking block's signature does not verify under this server's key "
                                "(--thinking-signing-key); using its text as reasoning anyway", at)
                reasoning.append(text)
            elif kind == "redacted_thinking" and m.role == "assistant":
                typed_field(raw, "data", str, at)  # checked as Anthropic checks it, then dropped:
                continue  # never produced by this server, nothing to recover
            elif kind == "tool_use" and m.role == "assistant":
                call_id, name = typed_field(raw, "id", str, at), typed_field(raw, "name", str, at)
                args = json.dumps(typed_field(raw, "input", dict, at), ensure_ascii=False)
                fn = {"name": name, "arguments": args}
                calls.append({"id": call_id, "type": "function", "function": fn})
                tool_use_ids.add(call_id)
            elif kind == "tool_result" and m.role == "user":
                call_id = typed_field(raw, "tool_use_id", str, at)
                if call_id not in tool_use_ids:
                    raise APIError(400, f"{at}.tool_use_id: {call_id!r} answers no tool_use block of an "
                                        "earlier assistant message (each tool_result must follow the "
                                        "tool_use it answers)", param=f"{at}.tool_use_id")
                content = raw.get("content")
                text = _text_of("" if content is None else content, f"{at}.content")
                error = typed_field(raw, "is_error", bool, at, required=False)
                results.append({"role": "tool", "tool_call_id": call_id,
                                "content": ("Error: " + text) if error else text})
            else:
                raise APIError(400, f"{at}: a {kind!r} block is not supported in the {m.role} role's message",
                               param=f"{at}.type")
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    """Anthropic client tools as OpenAI function tools (the template's form)."""
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise APIError(400, f"tools.{i}.type: server tool {t.type!r} is not supported; declare client "
                                "tools (name, description, input_schema)", param=f"tools.{i}.type")
        fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
        tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return tools or None


def tool_choice_fields(req: CountTokensRequest) -> dict[str, Any]:
    """A request's ``tool_choice`` as the chat job's ``tool_choice``, ``tool_name`` and ``one_call``
    (``any`` -> required, ``tool`` -> that one tool, ``none``, else auto). Raises APIError 400 naming
    ``tool_choice.name`` for a ``tool`` choice without a name."""
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise APIError(400, "tool_choice.name: a 'tool' choice needs the tool's name",
                       param="tool_choice.name")
    return {"tool_choice": {"none": "none", "any": "required"}.get(choice.type, "auto") if choice else "auto",
            "tool_name": choice.name if choice is not None and choice.type == "tool" else None,
            "one_call": bool(choice is not None and choice.disable_parallel_tool_use)}


def prefilled(req: CountTokensRequest) -> bool:
    """True when the conversation ends with an assistant message: Anthropic's prefilled response,
    which the reply continues (the prompt ends right after that message's text; the returned content
    is the continuation only, as the Messages API returns it). A prefill the Messages API refuses is
    a 400 naming it here too: one with a ``tool_use`` block, one whose text ends in whitespace (the
    template would strip it, and the reply would not continue what the client holds)."""
    if not req.messages or req.messages[-1].role != "assistant":
        return False
    i, content = len(req.messages) - 1, req.messages[-1].content
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if any(isinstance(b, dict) and b.get("type") == "tool_use" for b in blocks):
        raise APIError(400, f"messages.{i}.content: a prefilled (last) assistant message holds text only; "
                            "this one has a tool_use block", param=f"messages.{i}.content")
    texts = [b["text"] for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str)]
    if texts and texts[-1] != texts[-1].rstrip():
        raise APIError(400, f"messages.{i}: final assistant content cannot end with trailing whitespace",
                       param=f"messages.{i}.content")
    return True


def messages_job(ctx: ServeContext, req: MessagesRequest) -> tuple[cp.ChatJob, bool]:
    """The chat job of a Messages request and whether thinking blocks are returned."""
    choice_fields = tool_choice_fields(req)
    fmt = (req.output_config or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "output_config.format must be an object", param="output_config.format")
    output = cp.output_format(fmt.get("type"), fmt.get("schema"), "output_config.format") if fmt else None
    thinking = req.thinking
    budget = thinking.budget_tokens if thinking is not None and thinking.type != "disabled" else None
    if budget is not None and budget > ctx.caps.max_length:   # a cap, as max_tokens is: never reached
        log.debug("thinking.budget_tokens %d clamped to the %d-token context", budget, ctx.caps.max_length)
        budget = ctx.caps.max_length
    params = cp.sampling_params(
        ctx, {"stop": "stop_sequences"}, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        max_tokens=req.max_tokens, stop=tuple(s for s in req.stop_sequences or () if s),
    )
    messages = chat_messages(req, ctx.sealer)
    job = cp.ChatJob(
        messages=messages,
        tools=chat_tools(req),
        **choice_fields,
        output=output,
        reasoning_budget=budget,
        params=params,
        reasoning_split=True,
        max_tokens_is_cap=True,
        continue_final_message=prefilled(req),
    )
    return job, thinking is None or thinking.type != "disabled"


# --------------------------------------------------------------------------- choice -> message


def stop_reason(choice: cp.Choice) -> str:
    """The Anthropic ``stop_reason`` of a finished choice: ``stop_sequence`` when a stop string ended
    it, ``max_tokens`` at the token limit, ``tool_use`` with complete calls, else ``end_turn``."""
    if choice.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(choice.output.finish_reason or "stop", "end_turn")


def message_usage(usage: cp.TokenUsage) -> dict[str, int]:
    """Anthropic usage: input tokens not served from the prefix cache, output and cache-read tokens."""
    return {"input_tokens": usage.prompt - usage.cached, "output_tokens": usage.output,
            "cache_read_input_tokens": usage.cached, "cache_creation_input_tokens": 0}


def content_blocks(choice: cp.Choice, thinking: bool, sealer: Sealer) -> list[dict[str, Any]]:
    """The content blocks of a non-streamed message: the finished choice's returned parts
    (docs/serving.md §10.1: a call cut by the limit is no ``tool_use``, its raw text is text) as
    ``thinking`` (signed; left out when thinking is disabled), ``text`` and ``tool_use`` blocks."""
    blocks: list[dict[str, Any]] = []
    for part in choice.output.returned_parts(streamed=False):
        if part.kind == "reasoning" and thinking:
            blocks.append({"type": "thinking", "thinking": part.text, "signature": sealer.sign(part.text)})
        elif part.kind == "content":
            blocks.append({"type": "text", "text": part.text})
        elif part.call is not None:
            blocks.append({"type": "tool_use", "id": _tool_use_id(part.call.id), "name": part.call.name,
                           "input": json.loads(part.call.arguments)})
    return blocks


def _tool_use_id(call_id: str | None) -> str:
    """``toolu_`` + the parser's 24 hex digits."""
    return "toolu_" + (call_id or "").removeprefix("call_")


def message(id_: str, model: str, choice: cp.Choice | None, usage: cp.TokenUsage, thinking: bool,
            sealer: Sealer) -> dict[str, Any]:
    """The Messages API object of a finished choice (None: the empty message ``message_start`` sends)."""
    return {
        "id": id_,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(choice, thinking, sealer) if choice is not None else [],
        "stop_reason": stop_reason(choice) if choice is not None else None,
        "stop_sequence": choice.stop_sequence if choice is not None else None,
        "usage": message_usage(usage),
    }


# --------------------------------------------------------------------------- deltas -> stream events


@dataclass(slots=True)
class MessageStream:
    """Turns one choice's pipeline deltas into Anthropic stream events: ``feed`` returns the events of
    one delta (a block opens when the kind of piece changes or a call starts; a thinking block is
    signed as it closes), ``finish`` those that end the message, from the finished choice.

    A ``tool_use`` block starts with the call's name and streams its arguments as ``input_json_delta``;
    if the limit cuts the call it cannot be taken back (docs/serving.md §10.1): the block stops as it
    stands and the call's raw text follows as a text block, with stop_reason ``max_tokens``.
    """

    id: str
    model: str
    sealer: Sealer
    thinking: bool
    kinds: list[str] = field(default_factory=list)  # the type of each block started
    open: bool = False
    _thinking: list[str] = field(default_factory=list)  # the open thinking block's text

    def start(self, usage: cp.TokenUsage) -> list[tuple[str, dict]]:
        msg = message(self.id, self.model, None, usage, self.thinking, self.sealer)
        return [("message_start", {"type": "message_start", "message": msg}), ("ping", {"type": "ping"})]

    def feed(self, d: cp.ChoiceDelta) -> list[tuple[str, dict]]:
        ev: list[tuple[str, dict]] = []
        for piece in d.pieces():
            if piece.kind == "reasoning" and self.thinking:
                ev += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self._thinking.append(piece.text)
                ev.append(self._event({"type": "thinking_delta", "thinking": piece.text}))
            elif piece.kind == "content":
                ev += self._ensure("text", {"type": "text", "text": ""})
                ev.append(self._event({"type": "text_delta", "text": piece.text}))
            elif piece.kind == "tool_calls":
                for tc in piece.tool_calls:
                    if tc.name is not None:  # a new call: a new block
                        ev += self._close()
                        ev += self._open({"type": "tool_use", "id": _tool_use_id(tc.id), "name": tc.name,
                                          "input": {}})
                    if tc.arguments:
                        ev.append(self._event({"type": "input_json_delta", "partial_json": tc.arguments}))
        return ev

    def finish(self, choice: cp.Choice, usage: cp.TokenUsage) -> list[tuple[str, dict]]:
        """Close the last block and end the message with the finished choice's stop reason."""
        delta = {"stop_reason": stop_reason(choice), "stop_sequence": choice.stop_sequence}
        # cumulative counts, all of them (the SDKs' accumulators overwrite the message_start values)
        end = {"type": "message_delta", "delta": delta, "usage": message_usage(usage)}
        return self._close() + [("message_delta", end), ("message_stop", {"type": "message_stop"})]

    def _event(self, delta: dict) -> tuple[str, dict]:
        index = len(self.kinds) - 1
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}

    def _ensure(self, kind: str, empty: dict) -> list[tuple[str, dict]]:
        if self.open and self.kinds[-1] == kind:
            return []
        return self._close() + self._open(empty)

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        self.kinds.append(block["type"])
        self.open = True
        return [("content_block_start", {"type": "content_block_start", "index": len(self.kinds) - 1,
                                         "content_block": block})]

    def _close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        ev, index = [], len(self.kinds) - 1
        if self.kinds[-1] == "thinking":
            text, self._thinking = "".join(self._thinking), []
            ev.append(self._event({"type": "signature_delta", "signature": self.sealer.sign(text)}))
        return ev + [("content_block_stop", {"type": "content_block_stop", "index": index})]


# --------------------------------------------------------------------------- routes


@router.post("/v1/messages")
async def create_message(req: MessagesRequest, request: Request) -> Response:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)
    job, thinking = messages_job(ctx, req)
    prepared = await cp.prepare(ctx, job)
    sub = cp.submit(ctx, request, new_id("msg"), [prepared.ids], prepared.params, prepared.new_parser,
                    one_call=job.one_call, new_constraint=prepared.new_constraint)
    msg_id, model = "msg_" + uuid.uuid4().hex[:24], ctx.settings.served_model_name
    if not req.stream:
        choice = (await cp.collect(ctx, request, sub))[0]
        return JSONResponse(message(msg_id, model, choice, sub.usage(), thinking, ctx.sealer))
    events = MessageStream(msg_id, model, ctx.sealer, thinking)
    return StreamingResponse(_stream(ctx, sub, events), media_type="text/event-stream")


async def _stream(ctx: ServeContext, sub: cp.Submission, events: MessageStream) -> AsyncIterator[str]:
    """The SSE events of one streamed message. ``message_start`` goes out with the first delta, after
    the prompt's prefill: only then is the prefix-cache hit known, so its usage splits the prompt into
    ``input_tokens`` and ``cache_read_input_tokens`` as the non-streamed message does (sent before,
    it counted every prompt token as uncached input)."""
    started = False
    try:
        async for d in cp.stream(ctx, sub):
            out = [] if started else events.start(sub.usage())
            started = True
            out += events.feed(d)
            if d.choice is not None:
                out += events.finish(d.choice, sub.usage())
            for ev in out:
                yield sse(ev[1], ev[0])
    except APIError as e:
        yield sse(anthropic_error_body(e), "error")


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request) -> dict[str, int]:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)
    messages, tools = chat_messages(req, ctx.sealer), chat_tools(req)
    job = cp.ChatJob(messages=messages, tools=tools, **tool_choice_fields(req))

    def work() -> list[int]:
        # the tool choice refused as /v1/messages refuses it (its grammar compiled, off the event loop)
        cp.constraint_factory(ctx, cp.spec_or_400(job), "inside", None)
        prompt = cp.render_prompt(ctx, messages, tools, continue_final_message=prefilled(req))
        return cp.encode(ctx, prompt, "messages", check_length=True, tools=tools)

    return {"input_tokens": len(await run_in_threadpool(work))}
