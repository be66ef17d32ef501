"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: the OpenAI
Responses API on the chat pipeline
(https://platform.openai.com/docs/api-reference/responses, openai SDK 3.x).

Request -> :class:`ChatJob` (:func:`responses_job`):

- ``instructions`` -> a system message (not carried over by ``previous_response_id``, as OpenAI);
  ``input`` as a string or items: ``message`` (``input_text`` / ``output_text`` parts; images and files
  -> 400, text-only model), ``function_call`` -> the assistant's ``tool_calls``,
  ``function_call_output`` -> a ``tool`` message, ``reasoning`` -> the assistant's ``reasoning_content``
  (from ``encrypted_content`` opened with the server key, else its ``content`` / ``summary`` text), so
  the template keeps the current tool loop's reasoning (interleaved thinking).
- ``previous_response_id``: the stored conversation of that response (a bounded in-memory store of the
  last ``RESPONSE_STORE_SIZE`` = 1024 responses created with ``store`` true, the default, and at most
  ``RESPONSE_STORE_BYTES`` = 256 MiB of their JSON); unknown or
  evicted -> 404 naming the field.
- ``tools`` (function), ``tool_choice`` ``auto`` / ``none`` / ``required`` / a named function
  (``{"type": "function", "name": ...}``), ``parallel_tool_calls``, ``max_output_tokens``,
  ``temperature``, ``top_p``. ``max_tool_calls`` caps the calls of a forced (``required`` / named)
  turn in its grammar (there are no built-in tools; an ``auto`` turn is not capped). ``text.format``
  json_schema (``schema``) / json_object: the text after the reasoning is JSON matching it
  (docs/constrained-decoding.md).
- ``include: ["reasoning.encrypted_content"]`` returns the reasoning sealed under the server key
  (serve/sealing.py) in each reasoning item. ``reasoning.effort`` is a reasoning budget
  (``chat_pipeline.REASONING_BUDGETS``). ``metadata`` (up to 16 string pairs) is echoed in the
  response. ``reasoning.summary``, ``truncation``, ``prompt_cache_key``, ``user``, ``service_tier``,
  ``text.verbosity`` and unknown fields are accepted and ignored. ``input: []`` is a 400; every item's
  fields are type-checked (a 400 naming
  ``input.<k>.<field>``).

The finished choice of the pipeline -> the output items of the response (:func:`output_items`):
``reasoning`` (``reasoning_text`` content), ``message`` (``output_text``), ``function_call``
(``call_id``), for the non-streamed response and the final state of the stream alike (docs/serving.md
§10.1: a call cut by the token limit is no function_call in a non-streamed response; in a stream whose
item already went out it ends with status ``incomplete``). Pipeline deltas -> stream events
(:class:`ResponseBuilder`), with ``sequence_number``: ``response.created``,
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
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from m2serve.serve import chat_pipeline as cp
from m2serve.serve.context import RESPONSE_STORE_BYTES, RESPONSE_STORE_SIZE, ServeContext
from m2serve.serve.errors import APIError, json_type, openai_error_body, typed_field
from m2serve.serve.protocol import MAX_MESSAGES, MAX_TOOLS, APIRequest, new_id, sse
from m2serve.serve.sealing import Sealer

log = logging.getLogger(__name__)

router = APIRouter()

ENCRYPTED_REASONING = "reasoning.encrypted_content"


class ResponsesRequest(APIRequest):
    """The fields m2serve uses, validated strictly; others are accepted and ignored (:class:`APIRequest`)."""

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
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
    reasoning: dict[str, Any] | None = None  # effort: a reasoning budget; summary ... ignored
    metadata: dict[str, str] | None = Field(default=None, max_length=16)  # echoed (OpenAI: 16 pairs)


@dataclass(slots=True)
class StoredResponse:
    """A stored response: its wire object and the conversation it ended (without instructions)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- request -> chat job


_KEPT = f"{RESPONSE_STORE_SIZE} stored responses, up to {RESPONSE_STORE_BYTES // 2**20} MiB of JSON"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _parts_text(content: Any, where: str) -> str:
    """The text of a message's content: a string or ``input_text`` / ``output_text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of input_text parts (got "
                            f"{json_type(content)})", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(
                400,
                f"{where}.{j}: {kind!r} content is not supported; the served model is "
                "text-only (send input_text parts)",
                param=f"{where}.{j}.type",
            )
        texts.append(typed_field(part, "text", str, f"{where}.{j}"))
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], sealer: Sealer, where: str) -> str:
    sealed = typed_field(item, "encrypted_content", str, where, required=False)
    texts = {}
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = typed_field(item, key, list, where, required=False) or []
        for j, p in enumerate(parts):
            if not isinstance(p, dict):
                raise APIError(400, f"{where}.{key}.{j}: must be a {kind} part (an object)",
                               param=f"{where}.{key}.{j}")
        texts[key] = [typed_field(p, "text", str, f"{where}.{key}.{j}") for j, p in enumerate(parts)
                      if p.get("type") == kind]
    if sealed:
        text = sealer.open(sealed)
        if text is not None:
            return text
        log.warning(
            "%s: encrypted_content was not sealed under this server's key (--thinking-signing-key); "
            "using the item's readable text instead",
            where,
        )
    return "".join(texts["content"] or texts["summary"])


def input_messages(items: str | list[dict[str, Any]], sealer: Sealer) -> list[dict[str, Any]]:
    """The template-ready messages of ``input`` (see the module docstring). Each item's fields are
    checked (a 400 naming ``input.<k>.<field>``)."""
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
            call_id, name = typed_field(item, "call_id", str, where), typed_field(item, "name", str, where)
            missing = [f for f, v in (("call_id", call_id), ("name", name)) if not v]
            if missing:
                raise APIError(
                    400, f"{where}: a function_call item needs {missing[0]}", param=f"{where}.{missing[0]}"
                )
            args = typed_field(item, "arguments", str, where, required=False) or "{}"
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = typed_field(item, "call_id", str, where)
            if not call_id:
                raise APIError(
                    400, f"{where}: a function_call_output item needs call_id", param=f"{where}.call_id"
                )
            text = _parts_text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            turn = None
        else:
            raise APIError(
                400,
                f"{where}.type: input items of type {kind!r} are not supported (use message, "
                "function_call, function_call_output or reasoning)",
                param=f"{where}.type",
            )
    return out


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                     "reasoning": "rs"}


def input_item_list(items: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A request's ``input`` as the items ``GET /v1/responses/{id}/input_items`` lists: a string is one
    user message; every item gets an ``id`` (kept when sent) and a message's string content becomes one
    ``input_text`` part, as OpenAI lists them. Called after :func:`input_messages` accepted them."""
    if items is None:
        return []
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": "input_text", "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", _id(_ITEM_ID_PREFIXES.get(kind, "item")))
        out.append(item)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat-completions function tools (the template's form)."""
    out = []
    for i, t in enumerate(tools or []):
        if isinstance(t, dict) and t.get("type") == "function" and not isinstance(t.get("name"), str):
            nested = " (the Responses API takes name, parameters ... at the tool's top level, not under " \
                     "'function' as Chat Completions does)" if isinstance(t.get("function"), dict) else ""
            raise APIError(400, f"tools.{i}.name: a function tool needs a string name, got "
                                f"{json_type(t.get('name'))}{nested}", param=f"tools.{i}.name")
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else json_type(t)
            raise APIError(
                400,
                f"tools.{i}: only function tools (type 'function' with a name) are supported, "
                f"got type {kind!r}",
                param=f"tools.{i}.type",
            )
        typed_field(t, "description", str, f"tools.{i}", required=False)
        typed_field(t, "parameters", dict, f"tools.{i}", required=False)
        typed_field(t, "strict", bool, f"tools.{i}", required=False)
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
                f"previous_response_id {req.previous_response_id!r} is unknown, was created with "
                f"store: false, or was evicted (the server keeps the last {_KEPT} stored, in memory); "
                "send the whole conversation as input instead",
                "not_found_error",
                "previous_response_id",
            )
        history = [dict(m) for m in stored.messages]
    if req.input is None and not history:
        raise APIError(400, "input is required (a string or a list of input items)", param="input")
    if req.input == []:
        raise APIError(400, "input: an empty list; send at least one input item (or a string)", param="input")
    history += input_messages(req.input or [], ctx.sealer)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    params = cp.sampling_params(
        ctx,
        {"max_tokens": "max_output_tokens"},
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_output_tokens,
    )
    effort = (req.reasoning or {}).get("effort")
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
        reasoning_budget=cp.effort_budget(effort, "reasoning.effort"),
        messages_param="input",
        max_tokens_param="max_output_tokens",
    )
    return job, history


# --------------------------------------------------------------------------- choice -> output items


def reasoning_item(id_: str, text: str, status: str, encrypted: Sealer | None) -> dict[str, Any]:
    """A ``reasoning`` output item (``encrypted``: seal the text into ``encrypted_content``)."""
    item: dict[str, Any] = {"id": id_, "type": "reasoning", "summary": [],
                            "content": [{"type": "reasoning_text", "text": text}], "status": status}
    if encrypted is not None:
        item["encrypted_content"] = encrypted.seal(text)
    return item


def message_item(id_: str, text: str, status: str) -> dict[str, Any]:
    """An assistant ``message`` output item with one ``output_text`` part."""
    return {"id": id_, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A ``function_call`` output item; ``status`` ``incomplete`` for a call cut by the limit."""
    return {"id": id_, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(choice: cp.Choice, streamed: bool, encrypted: Sealer | None,
                 sent: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The output items of a finished choice: its returned parts (docs/serving.md §10.1) as reasoning,
    message and function_call items. Not streamed, a call cut by the limit is no item (its raw text is
    the message); streamed, its item already went out and stays, with status ``incomplete``. ``sent``:
    the items the stream sent, in order; the final items keep their ids and sealed reasoning."""
    sent = list(sent or ())
    out = []
    parts = choice.output.returned_parts(streamed)
    cut = choice.output.finish_reason == "length"
    for k, part in enumerate(parts):
        # the limit cut the last reasoning or message item: its status says so, as OpenAI's does
        status = "incomplete" if cut and k == len(parts) - 1 else "completed"
        kind = "rs" if part.kind == "reasoning" else "msg" if part.kind == "content" else "fc"
        item_id = sent[k]["id"] if k < len(sent) else _id(kind)
        if part.kind == "reasoning":
            sealed = sent[k].get("encrypted_content") if k < len(sent) and encrypted is not None else None
            item = reasoning_item(item_id, part.text, status, None if sealed else encrypted)
            if sealed:
                item["encrypted_content"] = sealed  # as the stream sent it (each seal draws a new nonce)
            out.append(item)
        elif part.kind == "content":
            out.append(message_item(item_id, part.text, status))
        elif part.call is not None:
            c = part.call
            status = "completed" if c.complete else "incomplete"
            out.append(function_call_item(item_id, c.id, c.name, c.arguments, status))
    return out


# --------------------------------------------------------------------------- the response and its stream


@dataclass(slots=True)
class ResponseBuilder:
    """The response object of one choice and its stream events.

    Not streamed: :meth:`complete` sets the output from the finished choice. Streamed: ``feed`` returns
    the events of one delta, :meth:`finish` the closing events and ``response.completed`` /
    ``response.incomplete``, whose response holds the items built from the same finished choice
    (docs/serving.md §10.1: a function_call item whose call the limit cut ends with status
    ``incomplete``, no ``function_call_arguments.done``, and the call's raw text follows as a message
    item).
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
    _final: cp.Choice | None = None  # the finished choice, once its last delta arrived

    @property
    def encrypted(self) -> Sealer | None:
        """The sealer when the request includes ``reasoning.encrypted_content``, else None."""
        return self.sealer if ENCRYPTED_REASONING in (self.request.include or ()) else None

    def complete(self, choice: cp.Choice, usage: cp.TokenUsage, streamed: bool = False) -> None:
        """Set the response's final state from the finished choice (``streamed``: keep the ids of the
        items the stream sent)."""
        self.output = output_items(choice, streamed, self.encrypted, self.output if streamed else None)
        self.usage = usage
        self.status = "incomplete" if choice.output.finish_reason == "length" else "completed"

    def start(self) -> list[dict]:
        return [
            self.event("response.created", response=self.response()),
            self.event("response.in_progress", response=self.response()),
        ]

    def feed(self, d: cp.ChoiceDelta) -> list[dict]:
        ev: list[dict] = []
        self._final = d.choice or self._final
        for piece in d.pieces():
            if piece.kind == "reasoning":
                if not self._is_open("reasoning"):
                    item = {**reasoning_item(_id("rs"), "", "in_progress", None), "content": []}
                    ev += self._close() + self._open(item)
                self._text.append(piece.text)
                ev.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                     delta=piece.text))
            elif piece.kind == "content":
                if not self._is_open("message"):
                    item = message_item(_id("msg"), "", "in_progress")
                    part = item["content"].pop()
                    ev += self._close() + self._open(item)
                    ev.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                         part=part))
                self._text.append(piece.text)
                ev.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                     delta=piece.text, logprobs=[]))
            elif piece.kind == "tool_calls":
                for tc in piece.tool_calls:
                    if tc.name is not None:
                        ev += self._close() + self._open(
                            function_call_item(_id("fc"), tc.id or "", tc.name, "", "in_progress"))
                    if tc.arguments:
                        self._text.append(tc.arguments)
                        ev.append(self.event("response.function_call_arguments.delta", **self._where(),
                                             delta=tc.arguments))
        return ev

    def finish(self, choice: cp.Choice, usage: cp.TokenUsage) -> list[dict]:
        """Close the last item and end the stream with the response built from the finished choice."""
        self._final = choice
        ev = self._close(cut=choice.output.finish_reason == "length")
        self.complete(choice, usage, streamed=True)
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
            "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
            "store": r.store,
            "temperature": r.temperature,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [],
            "top_p": r.top_p,
            "truncation": "disabled",
            "metadata": dict(r.metadata or {}),
            "usage": None
            if u is None
            else {
                "input_tokens": u.prompt,
                "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": 0},
                "output_tokens": u.output,
                "output_tokens_details": {"reasoning_tokens": u.reasoning},
                "total_tokens": u.prompt + u.output,
            },
        }

    def event(self, type_: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq - 1, **fields}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _is_open(self, kind: str) -> bool:
        return self.open and self.output[-1]["type"] == kind

    def _open(self, item: dict[str, Any]) -> list[dict]:
        self.output.append(item)
        self.open, self._text = True, []
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _cut(self, call_id: str) -> bool:
        """Whether the call ``call_id`` was cut by the limit (known from the finished choice only: an
        invoke that never closed is the choice's last call)."""
        parts = self._final.output.parts if self._final is not None else ()
        return any(p.call is not None and p.call.id == call_id and not p.call.complete for p in parts)

    def _close(self, cut: bool = False) -> list[dict]:
        """Close the open item (``cut``: the token limit ended it, so a reasoning or message item ends
        with status ``incomplete``)."""
        if not self.open:
            return []
        self.open = False
        at, text, ev = self._where(), "".join(self._text), []
        old = self.output[-1]
        status = "incomplete" if cut else "completed"
        if old["type"] == "reasoning":
            item = reasoning_item(old["id"], text, status, self.encrypted)
            ev.append(self.event("response.reasoning_text.done", **at, content_index=0, text=text))
        elif old["type"] == "message":
            item = message_item(old["id"], text, status)
            part = item["content"][0]
            ev.append(self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=[]))
            ev.append(self.event("response.content_part.done", **at, content_index=0, part=part))
        elif self._cut(old["call_id"]):  # its header went out: it ends incomplete (docs/serving.md §10.1)
            item = function_call_item(old["id"], old["call_id"], old["name"], text, "incomplete")
        else:
            item = function_call_item(old["id"], old["call_id"], old["name"], text, "completed")
            ev.append(self.event("response.function_call_arguments.done", **at, arguments=text,
                                 name=old["name"]))
        self.output[-1] = item
        done = self.event("response.output_item.done", output_index=at["output_index"], item=dict(item))
        return ev + [done]


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

    def store(choice: cp.Choice) -> None:
        if req.store:
            ctx.responses.put(builder.id, StoredResponse(builder.response(),
                                                         history + [choice.output.history_message()],
                                                         input_item_list(req.input)))

    if not req.stream:
        choice = (await cp.collect(ctx, request, sub))[0]
        builder.complete(choice, sub.usage())
        store(choice)
        return JSONResponse(builder.response())
    return StreamingResponse(_stream(ctx, sub, builder, store), media_type="text/event-stream")


async def _stream(
    ctx: ServeContext, sub: cp.Submission, builder: ResponseBuilder, store: Any
) -> AsyncIterator[str]:
    for ev in builder.start():
        yield sse(ev, ev["type"])
    try:
        async for d in cp.stream(ctx, sub):
            events = builder.feed(d)
            if d.choice is not None:
                events += builder.finish(d.choice, sub.usage())
                store(d.choice)
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
            f"response {response_id!r} is unknown, was created with store: false, or was evicted (the "
            f"server keeps the last {_KEPT} stored, in memory)",
            "not_found_error",
            "response_id",
        )
    return stored


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return _stored(request.app.state.ctx, response_id).response


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: int = 20,
                           order: Literal["asc", "desc"] = "desc",
                           after: str | None = None) -> dict[str, Any]:
    """The input items of a stored response (those of its own request, not of ``previous_response_id``),
    OpenAI's cursor page: ``limit`` 1-100 (default 20), ``order`` (default ``desc``, newest first),
    ``after`` an item id. 404 for an unknown response, 400 for a bad ``limit`` or ``after``."""
    items = list(_stored(request.app.state.ctx, response_id).input_items)
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit {limit} is not in [1, 100]", param="limit")
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after {after!r} is not an input item of response {response_id!r}",
                           param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    ctx: ServeContext = request.app.state.ctx
    _stored(ctx, response_id)
    ctx.responses.pop(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
