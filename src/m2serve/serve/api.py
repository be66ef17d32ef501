"""App assembly: routers, middleware, error mapping and the access log (docs/serving.md §10).

The APIs live in their own modules (serve/openai/*, serve/anthropic/*), as module-level handlers
reading their context (:class:`ServeContext`) from ``app.state.ctx``; all of them reach the engine
through serve/chat_pipeline.py.

Errors: every :class:`APIError` (and FastAPI's validation errors) is answered in the shape of the API
called: Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``, else
OpenAI's ``{"error": {"message", "type", "param", "code"}}``. Statuses: 400 invalid request (also
prompts longer than the context, template errors, unsupported constrained decoding), 401 bad/missing
API key (``Authorization: Bearer`` or ``x-api-key``), 404 unknown model, 408 body not received in
full within ``BODY_TIMEOUT_S`` (120 s), 413 body too large, 503 + Retry-After when the waiting queue
is full or the engine is down, and on every route while the model loads (:func:`build_loading_app`:
the port answers from the start; ``/health`` is then 503 ``{"status": "loading"}``), 500 when an
engine step failed or a route raised an error nothing else caught: the middleware's catch-all answers
it in the API's shape (a stream already under way ends with an error event in its shape), logs the
traceback, counts and logs the 500 like any answer, and the keep-alive connection stays open. A bad
request never reaches the engine thread. The OpenAPI document (``/openapi.json``) lists exactly these
statuses per route, in the route's error shape (FastAPI's default 422 is never sent, so it is not
listed).

Access log: one line per request at INFO (``m2serve.access``: method, path, status, latency, prompt and
completion tokens), at WARNING with the error message for a 4xx/5xx.

Streams are Server-Sent Events. A client that disconnects cancels its stream task; the ``finally`` in
:meth:`AsyncEngine.stream` aborts the request, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import math
import re
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import m2serve
from m2serve.serve.anthropic import messages as anthropic_messages
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.context import ACCESS_KEY, AccessRecord, ModelCapabilities, ServeContext, ServerSettings
from m2serve.serve.errors import APIError, anthropic_error_body, openai_error_body
from m2serve.serve.metrics import ServerMetrics
from m2serve.serve.openai import chat, completions, models, responses
from m2serve.serve.protocol import sse
from m2serve.serve.sealing import Sealer

__all__ = ["ServerSettings", "build_app", "build_loading_app"]

log = logging.getLogger(__name__)
access_log = logging.getLogger("m2serve.access")
log = logging.getLogger(__name__)

_GEN_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
_AUTH_FREE = ("/health", "/version", "/metrics", "/docs", "/openapi.json")
_ANTHROPIC_PREFIX = "/v1/messages"


def error_response(e: APIError, scope: dict[str, Any]) -> JSONResponse:
    """``e`` in the shape of the API at ``scope``'s path; its message goes to the access log."""
    scope.setdefault(ACCESS_KEY, AccessRecord()).error = e.message
    anthropic = scope.get("path", "").startswith(_ANTHROPIC_PREFIX)
    body = anthropic_error_body(e) if anthropic else openai_error_body(e)
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _api_key_of(headers: dict[bytes, bytes]) -> str:
    """The key of ``Authorization: Bearer <key>``, else of ``x-api-key`` (Anthropic clients)."""
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth.lower().startswith("bearer "):
        return auth[7:]
    return headers.get(b"x-api-key", b"").decode("latin-1")


# Seconds a request body may take to arrive in full: a client that trickles its body (slowloris) or never
# finishes it gets a 408 and loses the connection instead of holding it open forever (uvicorn has no
# such limit). A 32 MiB body (the default --max-request-bytes) needs ~0.3 MiB/s.
BODY_TIMEOUT_S = 120.0
# The ASGI scope key set on a /health answered "loading" (an expected 503: access-logged at INFO).
_LOADING_KEY = "m2serve.loading"
# The answer of every route but /health while the model loads (see build_loading_app).
_LOADING = APIError(503, "the model is still loading; retry when GET /health answers 200", "server_error",
                    code="model_loading", headers={"Retry-After": "1"})


class _AuthCountAndLog:
    """ASGI middleware: API-key check (all routes but health/version/metrics), the 503 of every route
    while the model loads (/health: ``{"status": "loading"}``), the request-body size limit (413 beyond
    ``max_bytes``), the ``m2serve_requests_total{endpoint, status}`` counter, the access log and the
    catch-all for uncaught route errors (a JSON 500 in the API's shape). Pure ASGI (not
    BaseHTTPMiddleware), so client disconnects still reach streaming responses."""

    def __init__(self, app: Any, api_key: str | None, metrics: Any, max_bytes: int, state: Any) -> None:
        self.app, self.api_key, self.metrics, self.max_bytes = app, api_key, metrics, max_bytes
        self.state = state  # the app's state: ``ctx`` is None while the model loads

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, start = scope["path"], time.perf_counter()
        record = scope[ACCESS_KEY] = AccessRecord()
        status = [0]
        try:
            await self._handle(scope, receive, send, status)
        finally:
            ms = (time.perf_counter() - start) * 1e3
            line = (f"{scope.get('method')} {path} {status[0]} {ms:.1f} ms "
                    f"prompt_tokens={record.prompt_tokens} completion_tokens={record.completion_tokens}")
            if (status[0] >= 400 or status[0] == 0) and not scope.get(_LOADING_KEY):
                access_log.warning("%s error=%r", line, record.error)
            else:
                access_log.info("%s%s", line, " (loading)" if scope.get(_LOADING_KEY) else "")

    async def _handle(self, scope: dict, receive: Any, send: Any, status: list[int]) -> None:
        path = scope["path"]
        endpoint = _GEN_ROUTES.get(path)
        headers = dict(scope["headers"])

        sse_started, ended = [False], [False]

        async def send_counting(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                sse_started[0] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                     for k, v in message.get("headers") or ())
                if endpoint is not None:
                    self.metrics.requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended[0] = True
            await send(message)

        if self.api_key is not None and not path.startswith(_AUTH_FREE):
            if not secrets.compare_digest(_api_key_of(headers).encode(), self.api_key.encode()):
                e = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or "
                                  "'x-api-key: <key>'", "authentication_error", code="invalid_api_key")
                await error_response(e, scope)(scope, receive, send_counting)
                return
        if self.state.ctx is None:  # still loading: /health says so, every other route is a 503
            if path == "/health":  # expected while loading: logged at INFO, not as an error
                scope[_LOADING_KEY] = True
                await JSONResponse({"status": "loading"}, status_code=503,
                                   headers=_LOADING.headers)(scope, receive, send_counting)
            else:
                await error_response(_LOADING, scope)(scope, receive, send_counting)
            return
        too_large = APIError(413, f"the request body is larger than the server's limit of {self.max_bytes} "
                                  "bytes (--max-request-bytes)", code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(too_large, scope)(scope, receive, send_counting)
            return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            # read the body here, up to the size limit (chunked bodies have no Content-Length) and
            # within BODY_TIMEOUT_S (a body trickled in or never finished), then replay it
            buffered, size = [], 0
            deadline = time.monotonic() + BODY_TIMEOUT_S
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
                except TimeoutError:
                    slow = APIError(408, f"the request body did not arrive within the server's limit of "
                                         f"{BODY_TIMEOUT_S:g} s", code="request_timeout",
                                    headers={"Connection": "close"})
                    await error_response(slow, scope)(scope, receive, send_counting)
                    return
                buffered.append(message)
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    await error_response(too_large, scope)(scope, receive, send_counting)
                    return
                if not message.get("more_body", False):
                    break
            upstream = receive

            async def receive() -> dict:
                return buffered.pop(0) if buffered else await upstream()

        try:
            await self.app(scope, receive, send_counting)
        except Exception as exc:  # the catch-all: a bug in a route must not drop the connection
            log.exception("%s %s: uncaught error in the route", scope.get("method"), path)
            e = APIError(500, f"internal server error ({type(exc).__name__}); the server log has the "
                              "details", "server_error")
            if status[0] == 0:  # nothing sent yet: a JSON 500 in the API's shape
                await error_response(e, scope)(scope, receive, send_counting)
            elif not ended[0]:  # a response is under way: end it (with an error event if a stream)
                scope[ACCESS_KEY].error = e.message
                frame = _stream_error_frame(path, e) if sse_started[0] else ""
                end = {"type": "http.response.body", "body": frame.encode(), "more_body": False}
                await send_counting(end)


def _stream_error_frame(path: str, e: APIError) -> str:
    """The error event that ends a stream cut by an uncaught error, in the API's stream shape."""
    if path.startswith(_ANTHROPIC_PREFIX):
        return sse(anthropic_error_body(e), "error")
    body = openai_error_body(e)
    if path.startswith("/v1/responses"):
        err = body["error"]
        return sse({"type": "error", "code": str(err["code"]), "message": err["message"], "param": None},
                   "error")
    return sse(body)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(e, request.scope)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errs = e.errors()
    ctype = request.headers.get("content-type", "")
    if "json" not in ctype.lower() and any(tuple(err.get("loc", ())) == ("body",) for err in errs):
        return error_response(APIError(
            400, "invalid request: the body must be a JSON object sent with 'Content-Type: "
            f"application/json' (got {ctype or 'no Content-Type'!r})"), request.scope)
    bad_json = next((err for err in errs if err.get("type") == "json_invalid"), None)
    if bad_json is not None:  # loc is ("body", character offset): not a field
        where = bad_json.get("loc", ())[-1:]
        at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
        msg = (bad_json.get("ctx") or {}).get("error") or bad_json.get("msg")
        return error_response(APIError(400, f"invalid request: the body is not valid JSON ({msg}{at})"),
                              request.scope)
    parts, param = [], None
    for err in errs[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = param or _error_param(loc, str(err.get("msg", "")))
        value = err.get("input")
        bound = err.get("type") in _NUMBER_BOUNDS and isinstance(value, float) and not math.isfinite(value)
        msg = "Input should be a finite number" if bound else err.get("msg")  # NaN / Infinity: pydantic
        # named the range bound they fail
        parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
    return error_response(APIError(400, "invalid request: " + "; ".join(parts), param=param), request.scope)


_NUMBER_BOUNDS = frozenset({"less_than", "less_than_equal", "greater_than", "greater_than_equal",
                            "finite_number"})
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_MESSAGE_FIELD = re.compile(r"(?:Value error, )?([a-z_][a-z0-9_]*): ")
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _error_param(loc: list[str], msg: str) -> str | None:
    """The request field a validation error names: its location without the union-branch tags pydantic
    puts in it (``stop.str``, ``stop.list[str]``, ``tool_choice.literal['none','auto']``, a model's
    class name: ``tool_choice.NamedToolChoice.function.name`` is ``tool_choice.function.name``); for a
    whole-request check (no location) the field its message starts with (``"top_logprobs: ..."``);
    else None."""
    kept = [part for part in loc
            if part.isdigit() or (_FIELD_NAME.fullmatch(part) and part not in _UNION_TAGS)]
    if kept:
        return ".".join(kept)
    m = _MESSAGE_FIELD.match(msg)
    return m.group(1) if m else None


def _unparsable_body_message(cause: BaseException | None) -> str | None:
    """The message of a body FastAPI could not parse for a reason other than a JSON syntax error (it
    answers only "There was an error parsing the body"): the parser limit the body exceeded, or None."""
    if isinstance(cause, RecursionError):
        return ("invalid request: the body is nested too deeply to parse (JSON arrays and objects nested "
                f"beyond the parser's limit, Python's recursion limit of {sys.getrecursionlimit()} "
                "levels); flatten it")
    if isinstance(cause, UnicodeDecodeError):
        return (f"invalid request: the body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at "
                f"offset {cause.start}); JSON text is UTF-8")
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return ("invalid request: the body has an integer literal longer than the parser's limit of "
                f"{sys.get_int_max_str_digits()} digits")
    return None


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    message = (_unparsable_body_message(e.__cause__) if e.status_code == 400 else None) or str(e.detail)
    return error_response(APIError(e.status_code, message, type_), request.scope)


async def health(request: Request) -> Response:
    ctx: ServeContext = request.app.state.ctx
    if not ctx.engine.alive:
        return error_response(APIError(503, "engine is not running", "server_error"), request.scope)
    return JSONResponse({"status": "ok"})


async def version() -> dict[str, str]:
    return {"version": m2serve.__version__}


async def metrics_route(request: Request) -> Response:
    return Response(request.app.state.ctx.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# Seconds between malloc_trim calls (see _trim_native_heap).
TRIM_PERIOD_S = 10.0


async def _trim_native_heap(period_s: float) -> None:
    """Every ``period_s``, glibc's ``malloc_trim(0)``: hand the free pages of every malloc arena back
    to the OS. Tokenising, rendering and step bookkeeping run on many threads, each with its own
    arena; their freed memory otherwise stays resident, so RSS crept up request after request.
    A no-op where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return
    while True:
        await asyncio.sleep(period_s)
        trim(0)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    loader = None
    if app.state.ctx is None:
        loader = asyncio.ensure_future(_load(app, loop))
    else:
        app.state.ctx.engine.start(loop)
    trimmer = asyncio.ensure_future(_trim_native_heap(TRIM_PERIOD_S))
    yield
    trimmer.cancel()
    if loader is not None:
        loader.cancel()
    if app.state.ctx is not None:
        app.state.ctx.engine.shutdown()


async def _load(app: FastAPI, loop: asyncio.AbstractEventLoop) -> None:
    """Run ``app.state.load`` in a daemon thread (the server answers 503 meanwhile), then serve its
    engine. A load that raises is kept in ``app.state.load_error`` and ``app.state.on_load_error`` is
    called (the CLI stops the server and reports it)."""
    done: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            done.set_result(value) if ok else done.set_exception(value)

    def run() -> None:
        try:
            result, ok = app.state.load(), True
        except BaseException as e:  # noqa: BLE001 - handed to the event loop, which reports it
            result, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:  # the loop closed meanwhile (the server stopped while loading)
            pass

    threading.Thread(target=run, name="m2serve-load", daemon=True).start()
    try:
        engine, settings = await done
    except Exception as e:
        app.state.load_error = e
        log.error("loading the model failed: %s", e)
        app.state.on_load_error()
        return
    install(app, engine, settings)
    engine.start(loop)


def _object(**props: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(props), "properties": props}


_STRING = {"type": "string"}
_ERROR_SCHEMAS = {  # errors.py's two wire shapes
    "OpenAIError": _object(error=_object(message=_STRING, type=_STRING, param={"type": ["string", "null"]},
                                         code={"type": ["string", "integer", "null"]})),
    "AnthropicError": _object(type={"const": "error"}, error=_object(type=_STRING, message=_STRING)),
}
_STATUS_TEXT = {
    400: "invalid request (the error names the field at fault)",
    401: "missing or invalid API key",
    404: "unknown model, or unknown stored response",
    408: "request body not received in full within BODY_TIMEOUT_S",
    413: "request body larger than --max-request-bytes",
    500: "an engine step failed while running this request, or an internal error",
    503: "model still loading, waiting queue full or engine not running (with Retry-After)",
}


def _statuses(path: str, method: str, has_body: bool) -> list[int]:
    """The error statuses the server really answers on ``method path`` (see the module docstring)."""
    out = []
    if has_body or path.endswith("/input_items"):  # a bad body / a bad query (limit, order, after)
        out.append(400)
    if not path.startswith(_AUTH_FREE):
        out.append(401)
    if has_body or path.startswith(("/v1/responses/", "/v1/models/")):
        out.append(404)  # unknown model / stored response
    if method == "post":
        out += [408, 413]
    out.append(500)  # the catch-all, on every route
    out.append(503)  # every route while the model loads; generation routes also when queue full / dead
    return out


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI document with the statuses this server answers: validation errors are 400 in
    the API's error shape (FastAPI lists 422, which the server never sends), plus 401/404/408/413/500/503
    where they can happen."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    components.update(_ERROR_SCHEMAS)
    for path, ops in doc.get("paths", {}).items():
        shape = "AnthropicError" if path.startswith(_ANTHROPIC_PREFIX) else "OpenAIError"
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in _statuses(path, method, "requestBody" in op):
                responses[str(status)] = {"description": _STATUS_TEXT[status], "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}}
    app.openapi_schema = doc
    return doc


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The FastAPI application around a (not yet started) AsyncEngine.

    The engine thread starts in the app's lifespan and is shut down (remaining requests aborted)
    when the server stops.
    """
    app = _new_app(settings.api_key, engine.metrics, settings.max_request_bytes)
    install(app, engine, settings)
    return app


def build_loading_app(
    load: Callable[[], tuple[AsyncEngine, ServerSettings]],
    api_key: str | None,
    metrics: ServerMetrics,
    max_request_bytes: int,
    on_load_error: Callable[[], None] = lambda: None,
) -> FastAPI:
    """The application of a server whose model is not loaded yet: the port answers at once.

    ``load`` runs in a background thread once the server starts and returns the (not yet started)
    engine and the settings; until it returns, ``GET /health`` is 503 ``{"status": "loading"}`` and
    every other route a 503 in its API's error shape (``code`` ``model_loading``, with Retry-After), so
    a client without a timeout does not hang on a port that accepts but never answers. If ``load``
    raises, the error is kept in ``app.state.load_error`` and ``on_load_error`` is called.
    ``api_key``, ``metrics`` and ``max_request_bytes`` must be known before the model: the middleware
    applies them from the first request.
    """
    app = _new_app(api_key, metrics, max_request_bytes)
    app.state.load, app.state.on_load_error, app.state.load_error = load, on_load_error, None
    return app


def install(app: FastAPI, engine: AsyncEngine, settings: ServerSettings) -> None:
    """Serve ``engine`` from ``app``: from now on the routes read ``app.state.ctx``; the metrics'
    ``model_name`` label is the served model name."""
    engine.metrics.label_model(settings.served_model_name, engine.llm.engine.stats)
    app.state.ctx = ServeContext(engine, settings, ModelCapabilities.of(engine.llm),
                                 Sealer(settings.thinking_signing_key))


def _new_app(api_key: str | None, metrics: ServerMetrics, max_request_bytes: int) -> FastAPI:
    app = FastAPI(title="m2serve", version=m2serve.__version__, lifespan=_lifespan)
    app.state.ctx = None
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(_AuthCountAndLog, api_key=api_key, metrics=metrics, max_bytes=max_request_bytes,
                       state=app.state)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", metrics_route, methods=["GET"])
    for module in (models, chat, completions, responses, anthropic_messages):
        app.include_router(module.router)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    return app
