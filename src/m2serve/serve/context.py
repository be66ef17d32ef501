"""What every handler reads from ``app.state.ctx``: settings, the async engine, the model's capabilities,
the thinking sealer and the stored responses."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.errors import APIError
from m2serve.serve.sealing import Sealer

# Responses kept for previous_response_id / GET /v1/responses/{id} (oldest evicted first).
RESPONSE_STORE_SIZE = 1024


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
    """The last ``size`` stored Responses-API responses by id (oldest evicted first)."""

    size: int = RESPONSE_STORE_SIZE
    items: OrderedDict[str, Any] = field(default_factory=OrderedDict)

    def put(self, key: str, value: Any) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, key: str) -> Any | None:
        return self.items.get(key)

    def pop(self, key: str) -> Any | None:
        return self.items.pop(key, None)


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
