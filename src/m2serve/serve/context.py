"""What every handler reads from ``app.state.ctx``: settings, the async engine, the model's capabilities,
the thinking sealer and the stored responses."""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.errors import APIError
from m2serve.serve.sealing import Sealer

# Responses kept for previous_response_id / GET /v1/responses/{id} (oldest evicted first): at most
# this many, and at most RESPONSE_STORE_BYTES of their JSON (response, conversation and input items).
RESPONSE_STORE_SIZE = 1024
RESPONSE_STORE_BYTES = 256 * 2**20


@dataclass(slots=True)
class ServerSettings:
    """HTTP-level settings. api_key None = no authentication; retry_after_s: the 503 Retry-After;
    max_request_bytes: the largest request body accepted (beyond: 413); thinking_signing_key: the key
    of thinking signatures and sealed reasoning (None: a random key per process, so signatures do not
    survive a restart; set it to share them across restarts and replicas);
    exclude_tools_when_tool_choice_none: with ``tool_choice`` none the tools are not rendered into the
    prompt either (vLLM's ``--exclude-tools-when-tool-choice-none``); by default they are, and the
    grammar keeps every call out of the output."""

    served_model_name: str
    api_key: str | None = None
    model_aliases: tuple[str, ...] = ()
    retry_after_s: int = 1
    max_request_bytes: int = 32 * 2**20
    thinking_signing_key: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


@dataclass(frozen=True, slots=True)
class ModelCapabilities:
    """What the served model and its text pipeline can do, read once at start-up.

    max_length: max context in tokens; vocab_size: valid token ids are [0, vocab_size);
    max_token_chars: the most characters one token covers (bounds a prompt's length before
    tokenising); parses_tools / parses_reasoning: the server's --tool-parser / --reasoning-parser
    are not ``none``.
    """

    max_length: int
    vocab_size: int
    max_token_chars: int
    parses_tools: bool
    parses_reasoning: bool

    @staticmethod
    def of(llm: Any) -> ModelCapabilities:
        """The capabilities of a :class:`~m2serve.serve.llm.LLM`."""
        return ModelCapabilities(
            max_length=llm.max_length,
            vocab_size=llm.config.vocab_size,
            max_token_chars=llm.tokenizer.max_token_chars,
            parses_tools=llm.tool_parser != "none",
            parses_reasoning=llm.reasoning_parser != "none",
        )


@dataclass(slots=True)
class ResponseStore:
    """The last stored Responses-API responses by id, oldest evicted first: at most ``size`` of them
    and at most ``max_bytes`` of their JSON (UTF-8 bytes of the value as JSON, dataclasses as their
    fields; the newest entry is kept even when it alone is larger). ``num_bytes``: what is held."""

    size: int = RESPONSE_STORE_SIZE
    max_bytes: int = RESPONSE_STORE_BYTES
    items: OrderedDict[str, tuple[Any, int]] = field(default_factory=OrderedDict)
    num_bytes: int = 0

    def put(self, key: str, value: Any) -> None:
        self.pop(key)
        size = json_bytes(value)
        self.items[key] = (value, size)
        self.num_bytes += size
        while len(self.items) > 1 and (len(self.items) > self.size or self.num_bytes > self.max_bytes):
            self.num_bytes -= self.items.popitem(last=False)[1][1]

    def get(self, key: str) -> Any | None:
        entry = self.items.get(key)
        return entry[0] if entry is not None else None

    def pop(self, key: str) -> Any | None:
        entry = self.items.pop(key, None)
        if entry is None:
            return None
        self.num_bytes -= entry[1]
        return entry[0]


def json_bytes(value: Any, too_deep: int = RESPONSE_STORE_BYTES) -> int:
    """UTF-8 bytes of ``value`` as JSON (a dataclass as its fields, anything else not JSON as its str);
    ``too_deep`` for a value nested beyond Python's recursion limit (counted as the whole budget)."""
    def fields_of(o: Any) -> Any:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
        return str(o)

    try:
        return len(json.dumps(value, ensure_ascii=False, default=fields_of).encode())
    except (RecursionError, ValueError):
        return too_deep


@dataclass(slots=True)
class ServeContext:
    """Everything a handler needs; one per app, in ``app.state.ctx``.

    live: the delta queue of every submitted request still streaming -> its id (the chat pipeline
    adds and removes them; at the shutdown deadline each gets an end); closing: set at that deadline,
    after which nothing new is submitted.
    """

    engine: AsyncEngine
    settings: ServerSettings
    caps: ModelCapabilities
    sealer: Sealer
    responses: ResponseStore = field(default_factory=ResponseStore)
    live: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    closing: bool = False

    @property
    def llm(self) -> Any:
        return self.engine.llm

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is None, the served name or an alias."""
        if name is None or name in (self.settings.served_model_name, *self.settings.model_aliases):
            return
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{self.settings.served_model_name}'",
            "not_found_error",
            "model",
            "model_not_found",
        )


@dataclass(slots=True)
class AccessRecord:
    """One request's line in the access log, filled as the request runs (api.py writes the line):
    token counts from the chat pipeline, the error message of a 4xx/5xx."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


ACCESS_KEY = "m2serve.access"  # the ASGI scope key of a request's AccessRecord


def access_record(scope: dict[str, Any]) -> AccessRecord:
    """The request's AccessRecord (a detached one when the request bypassed the middleware)."""
    return scope.setdefault(ACCESS_KEY, AccessRecord())
