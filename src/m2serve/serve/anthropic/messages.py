"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the chat pipeline
(https://docs.anthropic.com/en/api/messages, anthropic SDK 2.15).

Request -> :class:`ChatJob` (:func:`messages_job`):

- ``system`` (string or text blocks) -> a system message; ``messages`` content as a string or blocks:
  ``text``; ``thinking`` (its ``signature`` checked against this server's key: one that does not verify
  is still used and a warning is logged) and ``redacted_thinking`` (not produced here: dropped);
  ``tool_use`` -> the assistant's ``tool_calls``; ``tool_result`` (string or text blocks, ``is_error``
  -> the text is prefixed ``Error: ``) -> ``tool`` messages; ``image`` / ``document`` -> 400 (text-only
  model). Thinking blocks sent back become the assistant's ``reasoning_content``, so the template keeps
  the current tool loop's reasoning (interleaved thinking, docs/parsers.md §2).
- ``max_tokens`` (required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``: sampling; the
  official SDK sends none of the last three, so the checkpoint's generation defaults apply.
- ``tools`` (``input_schema``); ``tool_choice`` ``auto``, ``none`` (the tool-call tag cannot be
  generated), ``any`` (1 to N calls of the declared tools, N = their number), ``tool`` (one call of
  that tool); ``disable_parallel_tool_use`` -> exactly one tool_use (docs/constrained-decoding.md,
  "Tool-call cap").
- ``thinking``: ``enabled`` / ``adaptive`` / ``between_tools`` / absent return the reasoning as thinking
  blocks (M2 always reasons: its template opens ``<think>``); ``disabled`` drops them.
  ``budget_tokens`` is the reasoning budget: ``</think>`` is forced after that many reasoning tokens.
- ``output_config.format`` (``{"type": "json_schema", "schema": ...}``): the text after the reasoning
  is JSON matching the schema; ``output_config.effort``, ``metadata``, ``cache_control`` and unknown
  fields are ignored.

Pipeline deltas -> Anthropic content blocks (:class:`MessageBuilder`), one code path for both the
stream (``message_start``, ``ping``, ``content_block_start`` / ``_delta`` (``thinking_delta``,
``signature_delta``, ``text_delta``, ``input_json_delta``) / ``_stop``, ``message_delta``,
``message_stop``) and the non-streamed message, so the two agree by construction. Thinking blocks are
signed (serve/sealing.py); tool_use ids are ``toolu_`` + the parser's 24 hex digits; ``stop_reason``
``end_turn`` / ``max_tokens`` / ``stop_sequence`` / ``tool_use``; usage: input (not from the prefix
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
from m2serve.serve.errors import APIError, anthropic_error_body
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
    parts = []
    for j, b in enumerate(blocks or []):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise APIError(400, f"{where}.{j}: a {kind!r} block is not supported here; the served model is "
                                "text-only (send text blocks)", param=f"{where}.{j}")
        parts.append(b["text"])
    return "".join(parts)


def _block(b: Any, where: str, *keys: str) -> dict[str, Any]:
    if not isinstance(b, dict):
        raise APIError(400, f"{where}: a content block must be an object", param=where)
    missing = [k for k in keys if k not in b]
    if missing:
        raise APIError(400, f"{where}: a {b.get('type')!r} block needs {', '.join(missing)}",
                       param=f"{where}.{missing[0]}")
    return b


def chat_messages(req: CountTokensRequest, sealer: Sealer) -> list[dict[str, Any]]:
    """The template-ready history of an Anthropic request (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
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
                texts.append(str(_block(raw, at, "text")["text"]))
            elif kind == "thinking" and m.role == "assistant":
                b = _block(raw, at, "thinking")
                if not sealer.verify(b["thinking"], b.get("signature")):
                    log.warning("%s: the thinking block's signature does not verify under this server's key "
                                "(--thinking-signing-key); using its text as reasoning anyway", at)
                reasoning.append(b["thinking"])
            elif kind == "redacted_thinking" and m.role == "assistant":
                continue  # never produced by this server: nothing to recover
            elif kind == "tool_use" and m.role == "assistant":
                b = _block(raw, at, "id", "name", "input")
                args = json.dumps(b["input"], ensure_ascii=False)
                fn = {"name": b["name"], "arguments": args}
                calls.append({"id": b["id"], "type": "function", "function": fn})
            elif kind == "tool_result" and m.role == "user":
                b = _block(raw, at, "tool_use_id")
                text = _text_of(b.get("content") or "", f"{at}.content")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": ("Error: " + text) if b.get("is_error") else text})
            else:
                raise APIError(400, f"{at}: a {kind!r} block is not supported in a {m.role} message",
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


def messages_job(ctx: ServeContext, req: MessagesRequest) -> tuple[cp.ChatJob, bool]:
    """The chat job of a Messages request and whether thinking blocks are returned."""
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise APIError(400, "tool_choice.name: a 'tool' choice needs the tool's name",
                       param="tool_choice.name")
    fmt = (req.output_config or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "output_config.format must be an object", param="output_config.format")
    output = cp.output_format(fmt.get("type"), fmt.get("schema"), "output_config.format") if fmt else None
    thinking = req.thinking
    budget = thinking.budget_tokens if thinking is not None and thinking.type != "disabled" else None
    params = cp.sampling_params(
        ctx, {"stop": "stop_sequences"}, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        max_tokens=req.max_tokens, stop=tuple(s for s in req.stop_sequences or () if s),
    )
    job = cp.ChatJob(
        messages=chat_messages(req, ctx.sealer),
        tools=chat_tools(req),
        tool_choice={"none": "none", "any": "required"}.get(choice.type, "auto") if choice else "auto",
        tool_name=choice.name if choice is not None and choice.type == "tool" else None,
        output=output,
        reasoning_budget=budget,
        params=params,
        reasoning_split=True,
        one_call=bool(choice is not None and choice.disable_parallel_tool_use),
    )
    return job, thinking is None or thinking.type != "disabled"


# --------------------------------------------------------------------------- deltas -> blocks


@dataclass(slots=True)
class MessageBuilder:
    """Turns one choice's pipeline deltas into Anthropic stream events and the final message.

    ``feed`` returns the events of one delta, ``finish`` those that end the message; ``message`` is
    the message the events assemble to (what the non-streamed call returns).
    """

    id: str
    model: str
    sealer: Sealer
    thinking: bool
    stops: tuple[str, ...] = ()
    content: list[dict[str, Any]] = field(default_factory=list)
    open: bool = False
    stop_reason: str | None = None
    stop_sequence: str | None = None
    _args: str = ""
    _text: list[str] = field(default_factory=list)
    _ids: list[int] = field(default_factory=list)

    def start(self, usage: cp.TokenUsage) -> list[tuple[str, dict]]:
        msg = {**self.message(usage), "content": [], "stop_reason": None, "stop_sequence": None}
        return [("message_start", {"type": "message_start", "message": msg}), ("ping", {"type": "ping"})]

    def feed(self, d: cp.ChoiceDelta) -> list[tuple[str, dict]]:
        ev: list[tuple[str, dict]] = []
        self._text.append(d.delta.text)
        self._ids += d.delta.token_ids
        for piece in d.pieces():
            if piece.kind == "reasoning" and self.thinking:
                ev += self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                  {"type": "thinking_delta", "thinking": piece.text})
            elif piece.kind == "content":
                ev += self._delta("text", {"type": "text", "text": ""},
                                  {"type": "text_delta", "text": piece.text})
            elif piece.kind == "tool_calls":
                for tc in piece.tool_calls:
                    if tc.name is not None:  # a new call: a new block
                        ev += self._close()
                        call_id = "toolu_" + (tc.id or "").removeprefix("call_")
                        ev += self._open({"type": "tool_use", "id": call_id, "name": tc.name, "input": {}})
                        self._args = ""
                    if tc.arguments:
                        self._args += tc.arguments
                        ev.append(self._event({"type": "input_json_delta", "partial_json": tc.arguments}))
        return ev

    def finish(self, ctx: ServeContext, d: cp.ChoiceDelta, usage: cp.TokenUsage) -> list[tuple[str, dict]]:
        """Close the last block and end the message (``d``: the choice's finished delta)."""
        ev = self._close()
        if d.delta.stop_hit:
            self.stop_sequence = cp.matched_stop(ctx, "".join(self._text), self._ids, self.stops)
        reason = d.delta.finish_reason or "stop"
        self.stop_reason = "stop_sequence" if self.stop_sequence else _STOP_REASONS.get(reason, "end_turn")
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        ev.append(("message_delta", {"type": "message_delta", "delta": delta,
                                     "usage": {"output_tokens": usage.output}}))
        ev.append(("message_stop", {"type": "message_stop"}))
        return ev

    def message(self, usage: cp.TokenUsage) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": {"input_tokens": usage.prompt - usage.cached, "output_tokens": usage.output,
                      "cache_read_input_tokens": usage.cached, "cache_creation_input_tokens": 0},
        }

    def _event(self, delta: dict) -> tuple[str, dict]:
        b = self.content[-1]
        if delta["type"] == "thinking_delta":
            b["thinking"] += delta["thinking"]
        elif delta["type"] == "text_delta":
            b["text"] += delta["text"]
        index = len(self.content) - 1
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}

    def _delta(self, kind: str, empty: dict, delta: dict) -> list[tuple[str, dict]]:
        ev = []
        if not (self.open and self.content[-1]["type"] == kind):
            ev += self._close() + self._open(empty)
        return ev + [self._event(delta)]

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        self.content.append(block)
        self.open = True
        return [("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                         "content_block": dict(block)})]

    def _close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        b, ev, index = self.content[-1], [], len(self.content) - 1
        if b["type"] == "thinking":
            b["signature"] = self.sealer.sign(b["thinking"])
            delta = {"type": "signature_delta", "signature": b["signature"]}
            ev.append(("content_block_delta",
                       {"type": "content_block_delta", "index": index, "delta": delta}))
        elif b["type"] == "tool_use":
            b["input"] = _arguments(self._args)
        return ev + [("content_block_stop", {"type": "content_block_stop", "index": index})]


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments JSON as an object (the parser emits a JSON object; {} if it did not)."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# --------------------------------------------------------------------------- routes


@router.post("/v1/messages")
async def create_message(req: MessagesRequest, request: Request) -> Response:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)
    job, thinking = messages_job(ctx, req)
    prepared = await cp.prepare(ctx, job)
    sub = cp.submit(ctx, request, new_id("msg"), [prepared.ids], prepared.params, prepared.new_parser,
                    one_call=job.one_call, new_constraint=prepared.new_constraint)
    builder = MessageBuilder("msg_" + uuid.uuid4().hex[:24], ctx.settings.served_model_name, ctx.sealer,
                             thinking, stops=prepared.params.stop)
    if not req.stream:
        def add(d: cp.ChoiceDelta) -> None:
            builder.feed(d)
            if d.delta.finished:
                builder.finish(ctx, d, sub.usage())

        await cp.consume(ctx, request, sub, add)
        return JSONResponse(builder.message(sub.usage()))
    return StreamingResponse(_stream(ctx, sub, builder), media_type="text/event-stream")


async def _stream(ctx: ServeContext, sub: cp.Submission, builder: MessageBuilder) -> AsyncIterator[str]:
    for ev in builder.start(sub.usage()):
        yield sse(ev[1], ev[0])
    try:
        async for d in cp.stream(ctx, sub):
            events = builder.feed(d)
            if d.delta.finished:
                events += builder.finish(ctx, d, sub.usage())
            for ev in events:
                yield sse(ev[1], ev[0])
    except APIError as e:
        yield sse(anthropic_error_body(e), "error")


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request) -> dict[str, int]:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)
    messages, tools = chat_messages(req, ctx.sealer), chat_tools(req)

    def work() -> list[int]:
        return cp.encode(ctx, cp.render_prompt(ctx, messages, tools), "messages", check_length=True,
                         tools=tools)

    return {"input_tokens": len(await run_in_threadpool(work))}
