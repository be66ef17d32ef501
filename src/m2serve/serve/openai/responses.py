"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API on the chat pipeline
(https://platform.openai.com/docs/api-reference/responses, openai SDK 3.x).

Request -> :class:`ChatJob` (:func:`responses_job`):

- ``instructions`` -> a system message (not carried over by ``previous_response_id``, as OpenAI);
  ``input`` as a string or items: ``message`` (``input_text`` / ``output_text`` parts; images and files
  -> 400, text-only model), ``function_call`` -> the assistant's ``tool_calls``,
  ``function_call_output`` -> a ``tool`` message, ``reasoning`` -> the assistant's ``reasoning_content``
  (from ``encrypted_content`` opened with the server key, else its ``content`` / ``summary`` text), so
  the template keeps the current tool loop's reasoning (interleaved thinking).
- ``previous_response_id``: the stored conversation of that response (a bounded in-memory store of the
  last ``RESPONSE_STORE_SIZE`` = 1024 responses created with ``store`` true, the default); unknown or
  evicted -> 404 naming the field.
- ``tools`` (function), ``tool_choice`` ``auto`` / ``none`` / ``required`` / a named function
  (``{"type": "function", "name": ...}``), ``parallel_tool_calls``, ``max_output_tokens``,
  ``temperature``, ``top_p``. ``max_tool_calls`` caps the calls of a forced (``required`` / named)
  turn in its grammar (there are no built-in tools; an ``auto`` turn is not capped). ``text.format``
  json_schema (``schema``) / json_object: the text after the reasoning is JSON matching it
  (docs/constrained-decoding.md).
- ``include: ["reasoning.encrypted_content"]`` returns the reasoning sealed under the server key
  (serve/sealing.py) in each reasoning item. ``reasoning``, ``truncation``, ``prompt_cache_key``,
  ``metadata``, ``user``, ``service_tier``, ``text.verbosity`` and unknown fields are accepted and
  ignored.

Pipeline deltas -> output items (:class:`ResponseBuilder`), one code path for the stream and the
non-streamed response: ``reasoning`` (``reasoning_text`` content), ``message`` (``output_text``),
``function_call`` (``call_id``); streaming events carry ``sequence_number``: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.reasoning_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed`` (``response.incomplete`` when max_output_tokens
cut it; ``error`` then ``response.failed`` when an error cut the stream, e.g. the shutdown
deadline). Wire types are hand-written (plain dicts out, a lenient pydantic model in) rather than the
``openai`` package's, which is a client SDK and a test dependency only; the tests parse every response
and event with that SDK.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from m2serve.serve import chat_pipeline as cp
from m2serve.serve.context import RESPONSE_STORE_SIZE, ServeContext
from m2serve.serve.errors import APIError, openai_error_body
from m2serve.serve.protocol import new_id, sse
from m2serve.serve.sealing import Sealer

log = logging.getLogger(__name__)

router = APIRouter()

ENCRYPTED_REASONING = "reasoning.encrypted_content"


class ResponsesRequest(BaseModel):
    """The fields m2serve uses, validated strictly; others are accepted and ignored (``extra="allow"``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None


@dataclass(slots=True)
class StoredResponse:
    """A stored response: its wire object and the conversation it ended (without instructions)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


# --------------------------------------------------------------------------- request -> chat job


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _parts_text(content: Any, where: str) -> str:
    """The text of a message's content: a string or ``input_text`` / ``output_text`` parts."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content or []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise APIError(
                400,
                f"{where}.{j}: {kind!r} content is not supported; the served model is "
                "text-only (send input_text parts)",
                param=f"{where}.{j}.type",
            )
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], sealer: Sealer, where: str) -> str:
    sealed = item.get("encrypted_content")
    if sealed:
        text = sealer.open(sealed)
        if text is not None:
            return text
        log.warning(
            "%s: encrypted_content was not sealed under this server's key (--thinking-signing-key); "
            "using the item's readable text instead",
            where,
        )
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        texts = [
            p.get("text", "") for p in item.get(key) or () if isinstance(p, dict) and p.get("type") == kind
        ]
        if texts:
            return "".join(texts)
    return ""


def input_messages(items: str | list[dict[str, Any]], sealer: Sealer) -> list[dict[str, Any]]:
    """The template-ready messages of ``input`` (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message the next output items belong to

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for k, item in enumerate(items):
        where = f"input.{k}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: an input item must be an object", param=where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400,
                    f"{where}.role: {role!r} is not one of user, system, developer, assistant",
                    param=f"{where}.role",
                )
            text = _parts_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                msg = assistant()
                if msg["content"] or msg.get("tool_calls"):
                    turn = None
                    msg = assistant()
                msg["content"] = text
            else:
                out.append({"role": role, "content": text})
                turn = None
        elif kind == "reasoning":
            msg = assistant()
            if msg["content"] or msg.get("tool_calls"):
                turn = None
                msg = assistant()
            msg["reasoning_content"] = msg.get("reasoning_content", "") + _reasoning_text(item, sealer, where)
        elif kind == "function_call":
            missing = [f for f in ("call_id", "name") if not item.get(f)]
            if missing:
                raise APIError(
                    400, f"{where}: a function_call item needs {missing[0]}", param=f"{where}.{missing[0]}"
                )
            fn = {"name": item["name"], "arguments": item.get("arguments") or "{}"}
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": fn}
            )
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise APIError(
                    400, f"{where}: a function_call_output item needs call_id", param=f"{where}.call_id"
                )
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            turn = None
        else:
            raise APIError(
                400,
                f"{where}.type: input items of type {kind!r} are not supported (use message, "
                "function_call, function_call_output or reasoning)",
                param=f"{where}.type",
            )
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat-completions function tools (the template's form)."""
    out = []
    for i, t in enumerate(tools or []):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise APIError(
                400,
                f"tools.{i}: only function tools (type 'function' with a name) are supported, "
                f"got type {t.get('type')!r}",
                param=f"tools.{i}.type",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def responses_job(ctx: ServeContext, req: ResponsesRequest) -> tuple[cp.ChatJob, list[dict[str, Any]]]:
    """The chat job of a Responses request, and the conversation to store (without instructions)."""
    choice = req.tool_choice
    named = None
    if isinstance(choice, dict):
        named = choice.get("name") if choice.get("type") == "function" else None
        if not isinstance(named, str) or not named:
            raise APIError(400, "tool_choice: an object choice must be "
                                '{"type": "function", "name": ...}', param="tool_choice")
    elif choice not in (None, "auto", "none", "required"):
        raise APIError(400, f"tool_choice {choice!r} is not one of auto, none, required or a function",
                       param="tool_choice")
    fmt = (req.text or {}).get("format") or {}
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    output = cp.output_format(fmt.get("type"), fmt.get("schema"), "text.format")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = ctx.responses.get(req.previous_response_id)
        if stored is None:
            raise APIError(
                404,
                f"previous_response_id {req.previous_response_id!r} is unknown or was evicted "
                f"(the server keeps the last {RESPONSE_STORE_SIZE} stored responses, in memory); "
                "send the whole conversation as input instead",
                "not_found_error",
                "previous_response_id",
            )
        history = [dict(m) for m in stored.messages]
    if req.input is None and not history:
        raise APIError(400, "input is required (a string or a list of input items)", param="input")
    history += input_messages(req.input or [], ctx.sealer)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    params = cp.sampling_params(
        ctx,
        {"max_tokens": "max_output_tokens"},
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_output_tokens,
    )
    job = cp.ChatJob(
        messages=system + history,
        tools=chat_tools(req.tools),
        tool_choice=choice if choice in ("none", "required") else "auto",  # type: ignore[arg-type]
        tool_name=named,
        output=output,
        params=params,
        reasoning_split=True,
        one_call=req.parallel_tool_calls is False,
        max_tool_calls=req.max_tool_calls,
        messages_param="input",
        max_tokens_param="max_output_tokens",
    )
    return job, history


# --------------------------------------------------------------------------- deltas -> output items


@dataclass(slots=True)
class ResponseBuilder:
    """Turns one choice's pipeline deltas into Responses stream events and the final response object.

    ``response`` is the object the events assemble to (what the non-streamed call returns).
    """

    request: ResponsesRequest
    model: str
    sealer: Sealer
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"
    open: bool = False
    seq: int = 0
    usage: cp.TokenUsage | None = None
    error: dict[str, str] | None = None
    _text: list[str] = field(default_factory=list)  # the open item's text so far

    def start(self) -> list[dict]:
        return [
            self.event("response.created", response=self.response()),
            self.event("response.in_progress", response=self.response()),
        ]

    def feed(self, d: cp.ChoiceDelta) -> list[dict]:
        ev: list[dict] = []
        for piece in d.pieces():
            if piece.kind == "reasoning":
                if not self._is_open("reasoning"):
                    ev += self._close() + self._open(
                        {
                            "id": _id("rs"),
                            "type": "reasoning",
                            "summary": [],
                            "content": [],
                            "status": "in_progress",
                        }
                    )
                    self._text = []
                self._text.append(piece.text)
                ev.append(
                    self.event(
                        "response.reasoning_text.delta", **self._where(), content_index=0, delta=piece.text
                    )
                )
            elif piece.kind == "content":
                if not self._is_open("message"):
                    ev += self._close() + self._open(
                        {
                            "id": _id("msg"),
                            "type": "message",
                            "role": "assistant",
                            "status": "in_progress",
                            "content": [],
                        }
                    )
                    self._text = []
                    part = {"type": "output_text", "text": "", "annotations": []}
                    ev.append(
                        self.event("response.content_part.added", **self._where(), content_index=0, part=part)
                    )
                self._text.append(piece.text)
                ev.append(
                    self.event(
                        "response.output_text.delta",
                        **self._where(),
                        content_index=0,
                        delta=piece.text,
                        logprobs=[],
                    )
                )
            elif piece.kind == "tool_calls":
                for tc in piece.tool_calls:
                    if tc.name is not None:
                        ev += self._close() + self._open(
                            {
                                "id": _id("fc"),
                                "type": "function_call",
                                "call_id": tc.id,
                                "name": tc.name,
                                "arguments": "",
                                "status": "in_progress",
                            }
                        )
                        self._text = []
                    if tc.arguments:
                        self._text.append(tc.arguments)
                        ev.append(
                            self.event(
                                "response.function_call_arguments.delta", **self._where(), delta=tc.arguments
                            )
                        )
        return ev

    def finish(self, d: cp.ChoiceDelta, usage: cp.TokenUsage) -> list[dict]:
        ev = self._close()
        self.usage = usage
        self.status = "incomplete" if d.delta.finish_reason == "length" else "completed"
        return ev + [self.event(f"response.{self.status}", response=self.response())]

    def fail(self, e: APIError) -> list[dict]:
        """The events that end a stream cut by an error: ``error``, then ``response.failed``."""
        body = openai_error_body(e)["error"]
        self.status = "failed"  # the response's error code is one of the API's enum
        code = "server_error" if e.status >= 500 else "invalid_prompt"
        self.error = {"code": code, "message": body["message"]}
        error = self.event("error", code=str(body["code"]), message=body["message"], param=body["param"])
        return [error, self.event("response.failed", response=self.response())]

    def response(self) -> dict[str, Any]:
        r, u = self.request, self.usage
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": r.store,
            "temperature": r.temperature,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [],
            "top_p": r.top_p,
            "truncation": "disabled",
            "metadata": {},
            "usage": None
            if u is None
            else {
                "input_tokens": u.prompt,
                "input_tokens_details": {"cached_tokens": u.cached},
                "output_tokens": u.output,
                "output_tokens_details": {"reasoning_tokens": u.reasoning},
                "total_tokens": u.prompt + u.output,
            },
        }

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat message a following request's history holds."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "reasoning":
                msg["reasoning_content"] = "".join(p["text"] for p in item["content"])
            elif item["type"] == "message":
                msg["content"] += "".join(p["text"] for p in item["content"])
            else:
                fn = {"name": item["name"], "arguments": item["arguments"]}
                msg.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function", "function": fn}
                )
        return msg

    def event(self, type_: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq - 1, **fields}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _is_open(self, kind: str) -> bool:
        return self.open and self.output[-1]["type"] == kind

    def _open(self, item: dict[str, Any]) -> list[dict]:
        self.output.append(item)
        self.open = True
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        item, text, ev = self.output[-1], "".join(self._text), []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if ENCRYPTED_REASONING in (self.request.include or ()):
                item["encrypted_content"] = self.sealer.seal(text)
            ev.append(self.event("response.reasoning_text.done", **self._where(), content_index=0, text=text))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            item["content"] = [part]
            ev.append(
                self.event(
                    "response.output_text.done", **self._where(), content_index=0, text=text, logprobs=[]
                )
            )
            ev.append(self.event("response.content_part.done", **self._where(), content_index=0, part=part))
        else:
            item["arguments"] = text
            ev.append(
                self.event(
                    "response.function_call_arguments.done",
                    **self._where(),
                    arguments=text,
                    name=item["name"],
                )
            )
        item["status"] = "completed"
        return ev + [
            self.event("response.output_item.done", output_index=len(self.output) - 1, item=dict(item))
        ]


# --------------------------------------------------------------------------- routes


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request) -> Response:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)
    job, history = responses_job(ctx, req)
    prepared = await cp.prepare(ctx, job)
    sub = cp.submit(
        ctx,
        request,
        new_id("resp"),
        [prepared.ids],
        prepared.params,
        prepared.new_parser,
        one_call=job.one_call,
        new_constraint=prepared.new_constraint,
    )
    builder = ResponseBuilder(req, ctx.settings.served_model_name, ctx.sealer)

    def finish(d: cp.ChoiceDelta) -> list[dict]:
        ev = builder.finish(d, sub.usage())
        if req.store:
            ctx.responses.put(
                builder.id, StoredResponse(builder.response(), history + [builder.assistant_message()])
            )
        return ev

    if not req.stream:

        def add(d: cp.ChoiceDelta) -> None:
            builder.feed(d)
            if d.delta.finished:
                finish(d)

        await cp.consume(ctx, request, sub, add)
        return JSONResponse(builder.response())
    return StreamingResponse(_stream(ctx, sub, builder, finish), media_type="text/event-stream")


async def _stream(
    ctx: ServeContext, sub: cp.Submission, builder: ResponseBuilder, finish: Any
) -> AsyncIterator[str]:
    for ev in builder.start():
        yield sse(ev, ev["type"])
    try:
        async for d in cp.stream(ctx, sub):
            events = builder.feed(d)
            if d.delta.finished:
                events += finish(d)
            for ev in events:
                yield sse(ev, ev["type"])
    except APIError as e:
        for ev in builder.fail(e):
            yield sse(ev, ev["type"])


def _stored(ctx: ServeContext, response_id: str) -> StoredResponse:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise APIError(
            404,
            f"response {response_id!r} is unknown or was evicted (the server keeps the last "
            f"{RESPONSE_STORE_SIZE} stored responses, in memory)",
            "not_found_error",
            "response_id",
        )
    return stored


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return _stored(request.app.state.ctx, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    ctx: ServeContext = request.app.state.ctx
    _stored(ctx, response_id)
    ctx.responses.pop(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
