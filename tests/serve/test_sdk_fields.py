"""Every field the official SDKs can send is accepted (issue 26 item 1).

The field lists come from the INSTALLED ``openai`` and ``anthropic`` packages' request TypedDicts
(``typing.get_type_hints``), so a field a newer SDK adds is sent here as soon as the SDK is upgraded.
Each field is sent alone, on top of a minimal valid request, with a plausible value built from its
type hint (the first member of a union or Literal, a TypedDict with its required keys ...): the answer
must be a 200, never the 400 ``Extra inputs are not permitted`` that broke the Agents SDK and
LangChain. Fields m2serve ignores are named in one DEBUG log line; the fields it uses keep their
strict types; ``reasoning_effort`` / ``reasoning.effort`` are reasoning budgets (chat_pipeline
REASONING_BUDGETS), checked against the reasoning tokens the usage reports.
"""

from __future__ import annotations

import logging
import types
import typing
from pathlib import Path
from typing import Any

import anthropic.types.message_create_params as anthropic_messages  # test extras: a missing one fails
import openai.types.chat.completion_create_params as openai_chat
import openai.types.completion_create_params as openai_completions
import openai.types.responses.response_create_params as openai_responses
import pytest
import typing_extensions as te
from fastapi.testclient import TestClient

from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.chat_pipeline import REASONING_BUDGETS
from m2serve.serve.cli import _make_llm, build_parser, resolve_options

USER = [{"role": "user", "content": "Hi"}]
BASES = {  # route -> (minimal valid body, the SDK's request TypedDict)
    "/v1/chat/completions": ({"model": "m", "messages": USER, "max_tokens": 1},
                             openai_chat.CompletionCreateParamsBase),
    "/v1/completions": ({"model": "m", "prompt": "Hi", "max_tokens": 1},
                        openai_completions.CompletionCreateParamsBase),
    "/v1/responses": ({"model": "m", "input": "Hi", "max_output_tokens": 1},
                      openai_responses.ResponseCreateParamsBase),
    "/v1/messages": ({"model": "m", "messages": USER, "max_tokens": 1},
                     anthropic_messages.MessageCreateParamsBase),
}
# Plausible values where the one built from the type hint is not (a value m2serve refuses by design,
# with a 400 naming it: suffix, a hosted tool, a second model name, an audio output ...).
OVERRIDES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "top_logprobs": 0,  # needs logprobs: true
        "logit_bias": {"5": 1},  # keys are token ids
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
        "response_format": {"type": "text"},
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "prediction": {"type": "content", "content": "Hi"},
    },
    "/v1/completions": {"suffix": None, "best_of": 1, "logprobs": 0, "logit_bias": {"5": 1}},
    "/v1/responses": {
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}],
        "tool_choice": "auto",
        "previous_response_id": None,  # an unknown id is a 404
        "conversation": "conv_1",
        "include": ["reasoning.encrypted_content"],
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "reasoning": {"effort": "low", "summary": "auto"},
    },
    "/v1/messages": {
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "output_config": {"effort": "low"},
        "system": "Be brief.",
    },
}


def plausible(hint: Any, depth: int = 0) -> Any:
    """A JSON value of type ``hint`` (a TypedDict, union, Literal, container or scalar)."""
    origin, args = te.get_origin(hint), te.get_args(hint)
    if depth > 6:
        return None
    if origin in (te.Required, te.NotRequired, te.Annotated):
        return plausible(args[0], depth)
    if origin is te.Literal:
        return args[0]
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        return plausible(members[0], depth) if members else None
    if te.is_typeddict(hint):  # its required keys (``Required[...]`` in a total=False TypedDict too)
        fields = te.get_type_hints(hint, include_extras=True)
        required = set(getattr(hint, "__required_keys__", ())) | {
            k for k, t in fields.items() if te.get_origin(t) is te.Required}
        return {k: plausible(t, depth + 1) for k, t in fields.items() if k in required}
    if origin in (dict, typing.Dict) or hint is dict:  # noqa: UP006
        return {"key": plausible(args[1], depth + 1) if args else "value"}
    if origin is not None and origin not in (type,):
        name = getattr(origin, "__name__", "")
        if name in ("list", "Iterable", "Sequence", "SequenceNotStr", "List"):
            return [plausible(args[0], depth + 1)] if args else []
    if hint is str or getattr(hint, "__supertype__", None) is str:
        return "x"
    if hint is bool:
        return False
    if hint is int:
        return 1
    if hint is float:
        return 0.5
    return {}


def sdk_fields(route: str) -> list[tuple[str, Any]]:
    base, params = BASES[route]
    hints = typing.get_type_hints(params)
    assert len(hints) > 10, hints  # the SDK's field list was found
    out = []
    for name, hint in sorted(hints.items()):
        if name in base:
            continue
        value = OVERRIDES[route].get(name, plausible(hint))
        out.append((name, value))
    return out


@pytest.fixture(scope="module")
def client(tiny_random_dir):
    parser = build_parser()
    argv = ["serve", "--model", str(tiny_random_dir), "--dtype", "float32", "--num-kv-pages", "128",
            "--kv-cache-page-size", "16"]
    llm = _make_llm(resolve_options(parser.parse_args(argv), parser, {}))
    app = build_app(AsyncEngine(llm), ServerSettings(served_model_name="m"))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("route", list(BASES))
def test_every_sdk_field_is_accepted(client, route):
    base, _ = BASES[route]
    refused = []
    for name, value in sdk_fields(route):
        r = client.post(route, json={**base, name: value})
        if r.status_code != 200:
            refused.append(f"{name}={value!r}: {r.status_code} {r.text[:300]}")
    assert not refused, "\n".join(refused)


def test_ignored_fields_named_in_one_debug_line(client, caplog):
    body = {"model": "m", "messages": USER, "max_tokens": 1, "store": False, "metadata": {"a": "b"},
            "service_tier": "auto", "verbosity": "low"}
    with caplog.at_level(logging.DEBUG, logger="m2serve.serve.protocol"):
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "m2serve.serve.protocol"]
    assert len(lines) == 1, lines
    assert lines[0].endswith(": metadata, service_tier, store, verbosity"), lines


@pytest.mark.parametrize("route, body, field", [
    ("/v1/chat/completions", {"model": "m", "messages": USER, "max_tokens": 1, "reasoning_effort": "lots"},
     "reasoning_effort"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "max_tokens": 1, "reasoning_effort": 5},
     "reasoning_effort"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "max_tokens": 1, "temperature": "0.5"},
     "temperature"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1, "reasoning": {"effort": "lots"}},
     "reasoning.effort"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1, "reasoning": "low"}, "reasoning"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1, "temperature": "0.5"}, "temperature"),
])
def test_used_fields_keep_their_types(client, route, body, field):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


@pytest.mark.parametrize("effort, budget", [("none", None), ("minimal", 6)])
def test_reasoning_effort_is_a_reasoning_budget(client, monkeypatch, effort, budget):
    # the tiny random model never closes its reasoning by itself: with a budget of B tokens, the
    # reasoning is cut at B (``</think>`` forced) and the answer follows. "none" runs with its real
    # budget (0); "minimal" with its entry of the table set to 6 tokens, so the test stays fast while
    # showing that the table is what the routes use
    if budget is None:
        budget = REASONING_BUDGETS[effort]
    else:
        monkeypatch.setitem(REASONING_BUDGETS, effort, budget)
    limit = budget + 8
    chat = client.post("/v1/chat/completions", json={
        "model": "m", "messages": USER, "max_tokens": limit, "temperature": 0, "reasoning_effort": effort})
    resp = client.post("/v1/responses", json={
        "model": "m", "input": "Hi", "max_output_tokens": limit, "temperature": 0,
        "reasoning": {"effort": effort}})
    free = client.post("/v1/chat/completions", json={
        "model": "m", "messages": USER, "max_tokens": limit, "temperature": 0})
    assert chat.status_code == resp.status_code == free.status_code == 200, (chat.text, resp.text)
    assert free.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == limit  # never closes
    # the budget's tokens, up to 3 more to complete a UTF-8 character (the tiny model's tokens are
    # bytes), then the forced </think> (itself counted as reasoning): text/constraint.py
    chat_reasoning = chat.json()["usage"]["completion_tokens_details"]["reasoning_tokens"]
    resp_reasoning = resp.json()["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert budget <= chat_reasoning <= budget + 4, chat.json()
    assert resp_reasoning == chat_reasoning, resp.json()
    assert resp.json()["reasoning"]["effort"] == effort


def test_reasoning_budgets_documented():
    # docs/serving.md §10 and the README state the table's numbers
    root = Path(__file__).resolve().parents[2]
    for doc in (root / "docs/serving.md", root / "README.md"):
        text = doc.read_text(encoding="utf-8")
        for effort, budget in REASONING_BUDGETS.items():
            shown = "no budget" if budget is None else f"{budget:,}"
            assert f"`{effort}` {shown}" in text, (doc.name, effort, shown)


def test_responses_echo_their_metadata(client):
    # OpenAI echoes a response's metadata as sent (it was always {}); more than 16 pairs is a 400
    r = client.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 1,
                                           "metadata": {"a": "b", "trace": "x1"}})
    assert r.status_code == 200 and r.json()["metadata"] == {"a": "b", "trace": "x1"}, r.text
    r = client.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 1,
                                           "metadata": {str(i): "v" for i in range(17)}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text
