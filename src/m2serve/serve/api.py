"""FastAPI routes: the OpenAI-compatible HTTP surface (docs/serving.md §10).

Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``: 400
invalid request (also prompts longer than the context, template errors, unsupported
constrained decoding), 401 bad/missing API key, 404 unknown model, 503 + Retry-After when the
waiting queue is full or the engine is down. A bad request never reaches the engine thread.

Streams are Server-Sent Events (``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n``). A client that
disconnects cancels its stream task; the ``finally`` in :meth:`AsyncEngine.stream` aborts the
request, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import m2serve
from m2serve.engine.sampling import SamplingParams, TokenLogprobs
from m2serve.serve import protocol as P
from m2serve.serve.async_engine import AsyncEngine, EngineDeadError, QueueFullError, StepFailedError
from m2serve.serve.llm import ChoiceAccumulator
from m2serve.text.template import TemplateError

log = logging.getLogger(__name__)

_GEN_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_AUTH_FREE = ("/health", "/version", "/metrics", "/docs", "/openapi.json")


@dataclass(slots=True)
class ServerSettings:
    """HTTP-level settings. api_key None = no authentication; retry_after_s: the 503 Retry-After;
    max_request_bytes: the largest request body accepted (beyond: 413)."""

    served_model_name: str
    api_key: str | None = None
    model_aliases: tuple[str, ...] = ()
    retry_after_s: int = 1
    max_request_bytes: int = 32 * 2**20


class APIError(Exception):
    """An error answered in the OpenAI shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def _error_response(e: APIError) -> JSONResponse:
    def utf8(s: str | None) -> str | None:  # a lone surrogate echoed from the request cannot be sent
        return None if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")

    return JSONResponse(
        P.error_body(utf8(e.message), e.type, utf8(e.param), e.code if e.code is not None else e.status),
        status_code=e.status,
        headers=e.headers,
    )


class _AuthAndCount:
    """ASGI middleware: bearer-key check (all routes but health/version/metrics), the request-body
    size limit (413 beyond ``max_bytes``) and the ``m2serve_requests_total{endpoint, status}``
    counter. Pure ASGI (not BaseHTTPMiddleware), so client disconnects still reach streaming
    responses."""

    def __init__(self, app: Any, api_key: str | None, metrics: Any, max_bytes: int) -> None:
        self.app, self.api_key, self.metrics, self.max_bytes = app, api_key, metrics, max_bytes

    def _too_large(self) -> JSONResponse:
        return _error_response(
            APIError(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes "
                          "(--max-request-bytes)", code="request_too_large")
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = _GEN_ROUTES.get(path)

        def count(status: int) -> None:
            if endpoint is not None:
                self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

        if self.api_key is not None and not path.startswith(_AUTH_FREE):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                count(401)
                resp = _error_response(
                    APIError(
                        401,
                        "missing or invalid API key: send 'Authorization: Bearer <key>'",
                        "authentication_error",
                        code="invalid_api_key",
                    )
                )
                await resp(scope, receive, send)
                return

        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            count(413)
            await self._too_large()(scope, receive, send)
            return
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # no Content-Length (chunked): read the body here, up to the limit, then replay it
            buffered, size = [], 0
            while True:
                message = await receive()
                buffered.append(message)
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    count(413)
                    await self._too_large()(scope, receive, send)
                    return
                if not message.get("more_body", False):
                    break
            upstream = receive

            async def receive() -> dict:
                return buffered.pop(0) if buffered else await upstream()

        async def send_counting(message: dict) -> None:
            if message["type"] == "http.response.start":
                count(message["status"])
            await send(message)

        await self.app(scope, receive, send_counting)


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The FastAPI application around a (not yet started) AsyncEngine.

    The engine thread starts in the app's lifespan and is shut down (remaining requests aborted)
    when the server stops.
    """
    llm, metrics = engine.llm, engine.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        yield
        engine.shutdown()

    app = FastAPI(title="m2serve", version=m2serve.__version__, lifespan=lifespan)

    # -------------------------------------------------------------- errors, auth, counting

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        ctype = request.headers.get("content-type", "")
        if "json" not in ctype.lower() and any(tuple(err.get("loc", ())) == ("body",) for err in errs):
            return _error_response(APIError(
                400, "invalid request: the body must be a JSON object sent with 'Content-Type: "
                f"application/json' (got {ctype or 'no Content-Type'!r})"))
        bad_json = next((err for err in errs if err.get("type") == "json_invalid"), None)
        if bad_json is not None:  # loc is ("body", character offset): not a field
            where = bad_json.get("loc", ())[-1:]
            at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
            msg = (bad_json.get("ctx") or {}).get("error") or bad_json.get("msg")
            return _error_response(APIError(400, f"invalid request: the body is not valid JSON ({msg}{at})"))
        parts, param = [], None
        for err in errs[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (".".join(loc) or None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return _error_response(APIError(400, "invalid request: " + "; ".join(parts), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), type_))

    app.add_middleware(
        _AuthAndCount, api_key=settings.api_key, metrics=metrics, max_bytes=settings.max_request_bytes
    )

    def check_model(name: str | None) -> None:
        if name is None or name in (settings.served_model_name, *settings.model_aliases):
            return
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{settings.served_model_name}'",
            "not_found_error",
            "model",
            "model_not_found",
        )

    # -------------------------------------------------------------- simple routes

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return _error_response(APIError(503, "engine is not running", "server_error"))
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": m2serve.__version__}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=settings.served_model_name, max_model_len=llm.max_length)])

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)

        def work() -> list[int]:
            if req.messages is not None:
                text = _render(req.messages, req.tools, req.chat_template_kwargs, req.add_generation_prompt)
                return _encode(text, "messages", tools=req.tools)
            return _encode(req.prompt or "", "prompt")

        ids = await run_in_threadpool(work)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_length}

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < llm.config.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the vocabulary [0, {llm.config.vocab_size})",
                param="tokens",
            )
        return {"prompt": llm.decode(req.tokens, skip_special_tokens=False)}

    # -------------------------------------------------------------- helpers

    def _render(
        messages: list[P.ChatMessage],
        tools: list[P.ToolDef] | None,
        kwargs: dict[str, Any] | None,
        add_generation_prompt: bool = True,
    ) -> str:
        msgs = [m.model_dump(exclude_unset=True) for m in messages]
        for m in msgs:  # OpenAI's "developer" role is the system role of newer models
            if m["role"] == "developer":
                m["role"] = "system"
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            return llm.render_chat(msgs, tool_dicts, kwargs, add_generation_prompt)
        except TemplateError as e:  # raise_exception, bad history: the request's fault
            param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise APIError(400, f"chat template error: {e}", param=param) from e
        except RecursionError as e:  # e.g. a tool schema nested thousands of levels deep
            raise APIError(
                400,
                "messages, tools or chat_template_kwargs are nested too deeply to render "
                f"(Python's recursion limit {sys.getrecursionlimit()}); flatten them",
                param="tools" if tools else "messages",
            ) from e

    def _check_unicode(text: str, param: str, tools: list[P.ToolDef] | None = None) -> None:
        """A lone UTF-16 surrogate (legal in JSON "\\ud800", not Unicode) is a 400 naming ``param``, or
        ``tools`` when ``text`` is a rendered chat and the surrogate is in its ``tools``."""
        e = _lone_surrogate(text)
        if e is not None:
            if tools and _lone_surrogate(json.dumps([t.model_dump() for t in tools], ensure_ascii=False)):
                param = "tools"
            raise APIError(
                400,
                f"{param}: contains a lone UTF-16 surrogate {text[e.start:e.end]!r} (not valid "
                "Unicode; a JSON \\uD800-\\uDFFF escape must be part of a surrogate pair)",
                param=param,
            ) from e

    def _encode(text: str, param: str, check_length: bool = False,
                tools: list[P.ToolDef] | None = None) -> list[int]:
        """Token ids of ``text`` (lone surrogates: 400). With ``check_length``, a text too long to fit the
        context whatever its tokenisation (more than max_length x the longest token's characters) is
        refused before tokenising: a huge body costs neither the tokenizer's time nor its memory."""
        _check_unicode(text, param, tools)
        if check_length and len(text) > llm.max_length * llm.tokenizer.max_token_chars:
            raise APIError(
                400,
                f"the prompt has {len(text)} characters, more than the model's max context of "
                f"{llm.max_length} tokens can hold (a token covers at most "
                f"{llm.tokenizer.max_token_chars} characters); shorten it",
                param=param,
                code="context_length_exceeded",
            )
        return llm.encode(text)

    def _check_length(ids: list[int], param: str) -> None:
        if len(ids) >= llm.max_length:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but the model's max context is "
                f"{llm.max_length} tokens (at least one must be left to generate); shorten it",
                param=param,
                code="context_length_exceeded",
            )
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")

    def _params(
        req: P._SamplingFields,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        thinking_temperature: float | None = None,
    ) -> SamplingParams:
        try:
            p = SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                logit_bias=req.logit_bias,
                seed=req.seed,
                stop=tuple(req.stop_list()),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                max_tokens=req.token_limit(),
                n=req.n,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                thinking_temperature=thinking_temperature,
            )
            p.check_token_ids(llm.config.vocab_size)
        except ValueError as e:  # "invalid sampling parameter <field>...": the field is the param
            field = re.match(r"invalid sampling parameter (\w+)", str(e))
            raise APIError(400, str(e), param=field.group(1) if field else None) from e
        return p

    def _submit(
        base_id: str,
        ids: list[int],
        params: SamplingParams,
        make_parser: Any,
        skip_special_tokens: bool,
        q: asyncio.Queue,
    ) -> list[str]:
        """Submit the n choices of one prompt into the shared delta queue ``q``; returns their ids."""
        rids: list[str] = []
        try:
            for i in range(params.n):
                rid = f"{base_id}-{i}"
                child = params.child(i)
                proc = llm.new_processor(rid, child, make_parser(), skip_special_tokens)
                engine.submit(rid, ids, child, proc, q)
                rids.append(rid)
        except QueueFullError as e:
            for rid in rids:
                engine.abort(rid)
            raise APIError(
                503,
                str(e),
                "server_error",
                code="queue_full",
                headers={"Retry-After": str(settings.retry_after_s)},
            ) from e
        except EngineDeadError as e:
            for rid in rids:
                engine.abort(rid)
            raise APIError(
                503, str(e), "server_error", headers={"Retry-After": str(settings.retry_after_s)}
            ) from e
        return rids

    async def _collect(request: Request, rids: list[str], q: asyncio.Queue) -> dict[str, ChoiceAccumulator]:
        """Wait for every choice to finish; abort them if the client disconnects meanwhile."""
        accs = {rid: ChoiceAccumulator(i) for i, rid in enumerate(rids)}

        async def consume() -> None:
            async for d in engine.stream(rids, q):
                accs[d.request_id].add(d)

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait([task], timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()  # the stream's finally aborts the requests, freeing their pages
                    await asyncio.wait([task])
                    raise APIError(499, "client closed the request", code="client_closed_request")
            task.result()
            return accs
        except (ValueError, EngineDeadError) as e:
            raise _engine_error(e) from e
        finally:
            if not task.done():
                task.cancel()

    # -------------------------------------------------------------- chat

    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest, request: Request) -> Response:
        check_model(req.model)
        if req.tool_choice == "required" or isinstance(req.tool_choice, P.NamedToolChoice):
            raise APIError(
                400,
                "tool_choice 'required' and named tool choices need constrained decoding, "
                "which m2serve does not support yet; use tool_choice 'auto' or 'none'",
                param="tool_choice",
            )
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(
                400,
                f"response_format {req.response_format.type!r} needs constrained decoding, "
                "which m2serve does not support yet; use 'text'",
                param="response_format",
            )
        def work() -> tuple[str, list[int]]:  # rendering and tokenising: off the event loop
            text = _render(req.messages, req.tools, req.chat_template_kwargs)
            return text, _encode(text, "messages", check_length=True, tools=req.tools)

        prompt, ids = await run_in_threadpool(work)
        _check_length(ids, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = llm.chat_params(
            _params(req, logprobs, thinking_temperature=req.thinking_temperature), prompt
        )
        tools = (
            [t.model_dump(exclude_none=True) for t in req.tools]
            if req.tools and req.tool_choice != "none"
            else None
        )
        mode = llm.reasoning_mode(req.reasoning_split)
        base = P.new_id("chatcmpl")
        q: asyncio.Queue = asyncio.Queue()
        rids = _submit(
            base, ids, params, lambda: llm.new_parser(prompt, tools, mode, base), req.skip_special_tokens, q
        )
        model = settings.served_model_name
        one_call = req.parallel_tool_calls is False  # only the first call of each choice is returned
        if not req.stream:
            accs = await _collect(request, rids, q)
            resp = _chat_response(base, model, accs, len(ids), req.logprobs, one_call)
            return JSONResponse(resp.model_dump(mode="json"))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        gen = _chat_stream(base, model, rids, q, len(ids), include_usage, req.logprobs, one_call)
        return StreamingResponse(gen, media_type="text/event-stream")

    def _chat_response(
        base: str,
        model: str,
        accs: dict[str, ChoiceAccumulator],
        n_prompt: int,
        want_logprobs: bool,
        one_call: bool,
    ) -> P.ChatCompletionResponse:
        choices, n_out, n_reason, cached = [], 0, 0, 0
        for acc in accs.values():
            o = acc.result()
            n_out += len(o.token_ids)
            n_reason += o.num_reasoning_tokens
            cached = max(cached, acc.num_cached_tokens)
            msg = P.AssistantMessage(
                content=o.content,
                reasoning_content=o.reasoning,
                tool_calls=[
                    P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments))
                    for c in (o.tool_calls[:1] if one_call else o.tool_calls)
                ]
                or None,
            )
            lp = P.ChoiceLogprobs(content=_chat_logprobs(o.logprobs)) if want_logprobs else None
            choices.append(
                P.ChatChoice(index=o.index, message=msg, logprobs=lp, finish_reason=o.finish_reason)
            )
        return P.ChatCompletionResponse(
            id=base, model=model, choices=choices, usage=_usage(n_prompt, n_out, n_reason, cached)
        )

    async def _chat_stream(
        base: str,
        model: str,
        rids: list[str],
        q: asyncio.Queue,
        n_prompt: int,
        include_usage: bool,
        want_logprobs: bool,
        one_call: bool,
    ) -> AsyncIterator[str]:
        index = {rid: i for i, rid in enumerate(rids)}
        n_out, n_reason, cached = {}, {}, 0

        def chunk(
            i: int,
            delta: P.DeltaMessage,
            finish: str | None = None,
            logprobs: list[TokenLogprobs] | None = None,
        ) -> str:
            lp = P.ChoiceLogprobs(content=_chat_logprobs(logprobs)) if want_logprobs and logprobs else None
            c = P.ChatCompletionChunk(
                id=base,
                model=model,
                choices=[P.ChatStreamChoice(index=i, delta=delta, logprobs=lp, finish_reason=finish)],
            )
            return _sse(c.model_dump(mode="json", exclude_none=True))

        for i in range(len(rids)):
            yield chunk(i, P.DeltaMessage(role="assistant", content=""))
        try:
            async for d in engine.stream(rids, q):
                i = index[d.request_id]
                n_out[i], n_reason[i] = d.num_output_tokens, d.num_reasoning_tokens
                cached = max(cached, d.num_cached_tokens)
                calls = [tc for tc in d.tool_calls if tc.index == 0] if one_call else d.tool_calls
                lps = d.logprobs
                if d.reasoning:
                    yield chunk(i, P.DeltaMessage(reasoning_content=d.reasoning), logprobs=lps)
                    lps = None
                if d.content:
                    yield chunk(i, P.DeltaMessage(content=d.content), logprobs=lps)
                    lps = None
                if calls:
                    yield chunk(i, P.DeltaMessage(tool_calls=[_tool_delta(tc) for tc in calls]), logprobs=lps)
                    lps = None
                if lps:
                    yield chunk(i, P.DeltaMessage(content=""), logprobs=lps)
                if d.finished:
                    yield chunk(i, P.DeltaMessage(), finish=d.finish_reason)
        except (ValueError, EngineDeadError) as e:
            err = _engine_error(e)
            yield _sse(P.error_body(err.message, err.type, err.param, err.status))
        if include_usage:
            u = _usage(n_prompt, sum(n_out.values()), sum(n_reason.values()), cached)
            c = P.ChatCompletionChunk(id=base, model=model, choices=[], usage=u)
            yield _sse(c.model_dump(mode="json", exclude_none=True))
        yield "data: [DONE]\n\n"

    def _chat_logprobs(lps: list[TokenLogprobs] | None) -> list[P.TokenLogprob]:
        out = []
        for lp in lps or []:
            raw = llm.tokenizer.token_bytes
            out.append(
                P.TokenLogprob(
                    token=llm.token_text(lp.token_id),
                    logprob=lp.logprob,
                    bytes=list(raw(lp.token_id)),
                    top_logprobs=[
                        P.TopLogprob(token=llm.token_text(tid), logprob=v, bytes=list(raw(tid)))
                        for tid, v in lp.top
                    ],
                )
            )
        return out

    # -------------------------------------------------------------- completions

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of is not supported (use n)", param="best_of")
        prompts: list[tuple[str, list[int]]] = []
        raw = _completion_prompts(req.prompt)
        texts = [p for p in raw if isinstance(p, str)]
        encoded = iter(
            await run_in_threadpool(lambda: [_encode(p, "prompt", check_length=True) for p in texts])
        )
        for p in raw:
            if isinstance(p, str):
                prompts.append((p, next(encoded)))
            else:
                bad = [t for t in p if not 0 <= t < llm.config.vocab_size]
                if bad:
                    raise APIError(
                        400,
                        f"prompt token id {bad[0]} is outside the vocabulary [0, {llm.config.vocab_size})",
                        param="prompt",
                    )
                prompts.append((llm.decode(p, skip_special_tokens=False), list(p)))
        for _, ids in prompts:
            _check_length(ids, "prompt")
        params = _params(
            req,
            req.logprobs,
            prompt_logprobs=req.logprobs if (req.echo and req.logprobs is not None) else None,
        )
        base = P.new_id("cmpl")
        rids: list[str] = []
        q: asyncio.Queue = asyncio.Queue()
        meta: dict[str, tuple[int, int]] = {}
        try:
            for pi, (_, ids) in enumerate(prompts):
                sub = _submit(f"{base}-{pi}", ids, params, lambda: None, req.skip_special_tokens, q)
                for ci, rid in enumerate(sub):
                    meta[rid] = (pi, pi * req.n + ci)
                rids += sub
        except APIError:
            for rid in rids:
                engine.abort(rid)
            raise
        model = settings.served_model_name
        if not req.stream:
            accs = await _collect(request, rids, q)
            return JSONResponse(
                _completion_response(base, model, accs, meta, prompts, req).model_dump(mode="json")
            )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _completion_stream(base, model, rids, q, meta, prompts, req, include_usage),
            media_type="text/event-stream",
        )

    def _completion_logprobs(lps: list[TokenLogprobs | None], offset: int) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
        for lp in lps:
            if lp is None:  # the first prompt token has no logprob
                continue
            text = llm.token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({llm.token_text(t): v for t, v in lp.top} or None)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _echo_logprobs(ids: list[int], acc_prompt: list[TokenLogprobs | None] | None) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
        offset = 0
        for pos, tid in enumerate(ids):
            text = llm.token_text(tid)
            lp = acc_prompt[pos] if acc_prompt and pos < len(acc_prompt) else None
            out.tokens.append(text)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else {llm.token_text(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _completion_response(
        base: str,
        model: str,
        accs: dict[str, ChoiceAccumulator],
        meta: dict[str, tuple[int, int]],
        prompts: list[tuple[str, list[int]]],
        req: P.CompletionRequest,
    ) -> P.CompletionResponse:
        choices, n_out = [], 0
        for rid, acc in accs.items():
            pi, index = meta[rid]
            o = acc.result()
            n_out += len(o.token_ids)
            prompt_text, ids = prompts[pi]
            text = (prompt_text if req.echo else "") + o.text
            lp = None
            if req.logprobs is not None:
                lp = P.CompletionLogprobs()
                if req.echo:
                    lp = _echo_logprobs(ids, acc.prompt_logprobs)
                gen = _completion_logprobs(o.logprobs or [], len(prompt_text) if req.echo else 0)
                lp.tokens += gen.tokens
                lp.token_logprobs += gen.token_logprobs
                lp.top_logprobs += gen.top_logprobs
                lp.text_offset += gen.text_offset
            choices.append(
                P.CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=o.finish_reason)
            )
        choices.sort(key=lambda c: c.index)
        n_prompt = sum(len(ids) for _, ids in prompts)
        return P.CompletionResponse(
            id=base, model=model, choices=choices, usage=_usage(n_prompt, n_out, None)
        )

    async def _completion_stream(
        base: str,
        model: str,
        rids: list[str],
        q: asyncio.Queue,
        meta: dict[str, tuple[int, int]],
        prompts: list[tuple[str, list[int]]],
        req: P.CompletionRequest,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        n_out: dict[str, int] = {}
        offsets: dict[str, int] = {}
        echoed: set[str] = set()
        try:
            async for d in engine.stream(rids, q):
                pi, index = meta[d.request_id]
                prompt_text, ids = prompts[pi]
                n_out[d.request_id] = d.num_output_tokens
                text, lp = d.text, None
                if req.echo and d.request_id not in echoed:
                    echoed.add(d.request_id)
                    text = prompt_text + text
                    if req.logprobs is not None:
                        lp = _echo_logprobs(ids, d.prompt_logprobs)
                    offsets[d.request_id] = len(prompt_text)
                if req.logprobs is not None:
                    gen = _completion_logprobs(d.logprobs or [], offsets.get(d.request_id, 0))
                    offsets[d.request_id] = offsets.get(d.request_id, 0) + sum(len(t) for t in gen.tokens)
                    if lp is None:
                        lp = gen
                    else:
                        lp.tokens += gen.tokens
                        lp.token_logprobs += gen.token_logprobs
                        lp.top_logprobs += gen.top_logprobs
                        lp.text_offset += gen.text_offset
                if text or lp is not None or d.finished:
                    c = P.CompletionResponse(
                        id=base,
                        model=model,
                        choices=[
                            P.CompletionChoice(
                                index=index,
                                text=text,
                                logprobs=lp,
                                finish_reason=d.finish_reason if d.finished else None,
                            )
                        ],
                    )
                    yield _sse(c.model_dump(mode="json", exclude_none=True))
        except (ValueError, EngineDeadError) as e:
            err = _engine_error(e)
            yield _sse(P.error_body(err.message, err.type, err.param, err.status))
        if include_usage:
            n_prompt = sum(len(ids) for _, ids in prompts)
            c = P.CompletionResponse(
                id=base, model=model, choices=[], usage=_usage(n_prompt, sum(n_out.values()), None)
            )
            yield _sse(c.model_dump(mode="json", exclude_none=True))
        yield "data: [DONE]\n\n"

    return app


def _lone_surrogate(text: str) -> UnicodeEncodeError | None:
    """The UnicodeEncodeError of ``text``'s first lone UTF-16 surrogate (which UTF-8 cannot encode), or
    None when it has none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e
    return None


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompt) > P.MAX_PROMPTS:
        raise APIError(400, f"prompt: {len(prompt)} prompts in one request; the limit is {P.MAX_PROMPTS}",
                       param="prompt")
    return list(prompt)


def _usage(n_prompt: int, n_out: int, n_reason: int | None, n_cached: int | None = None) -> P.Usage:
    """OpenAI usage; reasoning_tokens (chat) and cached prompt tokens (prefix cache) when known."""
    details = P.CompletionTokensDetails(reasoning_tokens=n_reason) if n_reason is not None else None
    cached = P.PromptTokensDetails(cached_tokens=n_cached) if n_cached is not None else None
    return P.Usage(
        prompt_tokens=n_prompt,
        completion_tokens=n_out,
        total_tokens=n_prompt + n_out,
        completion_tokens_details=details,
        prompt_tokens_details=cached,
    )


def _tool_delta(tc: Any) -> P.ToolCallDelta:
    if tc.name is not None:
        return P.ToolCallDelta(
            index=tc.index,
            id=tc.id,
            type="function",
            function=P.FunctionCallDelta(name=tc.name, arguments=tc.arguments),
        )
    return P.ToolCallDelta(index=tc.index, function=P.FunctionCallDelta(arguments=tc.arguments))


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, StepFailedError):
        return APIError(500, str(e), "server_error")
    return APIError(503, str(e), "server_error")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
