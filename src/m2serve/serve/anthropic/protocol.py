"""Anthropic Messages request types (https://docs.anthropic.com/en/api/messages; anthropic SDK 2.15).

Hand-written pydantic models, not the ``anthropic`` package's: that package is a client SDK (its request
params are TypedDicts for building requests, its response models are for parsing them), and making it a
runtime dependency of the server would tie m2serve's releases to an SDK's. The tests run the real SDK
against the server, so the shapes here are checked against it.

Unknown top-level fields (``container``, ``diagnostics``, ``inference_geo``, ``service_tier``, ``speed``,
``user_profile_id``, ``workspace_id``, ``metadata`` ...) are accepted and ignored (one DEBUG line naming
them, :class:`~m2serve.serve.protocol.APIRequest`): the SDK sends fields a server has no use for, and
they must never be a 400. Declared fields are validated strictly (``"10"``
is not an integer, ``"yes"`` not a boolean). Content blocks stay dicts, checked one by one in
messages.py so that an error names ``messages.<i>.content.<j>``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from m2serve.serve.protocol import MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOOLS, APIRequest


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(_Lenient):
    """A client tool (``type`` absent or ``custom``); server tools (web search ...) are refused."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Lenient):
    type: Literal["enabled", "adaptive", "disabled", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)


class CountTokensRequest(APIRequest):
    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    output_config: dict[str, Any] | None = None
