"""Constrained decoding driven by random logits (issue 20; docs/parsers.md §2-§3).

Random logits carry no structure, so every structure in the output comes from the constraint. A
batched sampling loop (temperature 1.0, seeded) applies ``GrammarConstraint`` bitmasks through the real
tokenizers of tiny-random (special-token tags) and tiny-chat (tags as non-special added tokens), with
the reasoning closed by a budget of 16 tokens. The outputs are checked with independent readers:
``json.loads`` + the ``jsonschema`` package, and m2serve's own output parser (``parse_output``) whose
arguments are validated with ``jsonschema`` against each tool's parameters.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from constraint_helpers import TOKENIZERS, make_compiler, sample_batch, unpack_bitmask

from m2serve.text.constraint import json_spec, no_tool_call_spec, tool_calls_spec
from m2serve.text.parser import parse_output

pytestmark = pytest.mark.slow  # ~130 s in all on a loaded 2-core box (~60 s idle)

N = 300
MAX_TOKENS = 256
BUDGET = 16
PROMPT_TAIL = "]~b]ai\n<think>\n"  # the generation prompt: output starts inside reasoning (P1)

SCHEMAS = {
    "nested_enum": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 12},
                                    "role": {"enum": ["admin", "user", "guest"]}},
                     "required": ["name", "role"], "additionalProperties": False},
            "active": {"type": "boolean"},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["user"], "additionalProperties": False,
    },
    "integer_bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "integer", "minimum": -50, "maximum": 50},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["age", "score"], "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {"type": "array", "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                               "tag": {"type": "string", "maxLength": 6}},
                                "required": ["id"], "additionalProperties": False}},
            "count": {"type": "integer", "minimum": 0, "maximum": 3},
        },
        "required": ["items"], "additionalProperties": False,
    },
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        }, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Book a table",
        "parameters": {"type": "object", "properties": {
            "guests": {"type": "integer", "minimum": 1, "maximum": 12},
            "outdoor": {"type": "boolean"},
            "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
            "when": {"type": "object",
                     "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                     "required": ["hour"], "additionalProperties": False},
        }, "required": ["guests", "when"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=TOKENIZERS)
def compiler(request):
    return make_compiler(request.param)


def _run(compiler, spec, seed):
    outs = sample_batch(compiler, [compiler.constraint(spec, "inside", BUDGET) for _ in range(N)],
                        MAX_TOKENS, seed)
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:3]
    # the budget closed every reasoning: </think> within BUDGET tokens (+ a few to finish a character)
    assert all(o.reasoning_tokens <= BUDGET + 3 for o in outs)
    return outs


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(compiler, name):
    schema = SCHEMAS[name]
    outs = _run(compiler, json_spec(schema), seed=1)
    stopped = [o for o in outs if o.finish == "stop"]
    assert len(stopped) >= 0.99 * N
    for o in stopped:
        parsed = parse_output(o.text, None, prompt_tail=PROMPT_TAIL)
        assert parsed.reasoning is not None
        jsonschema.validate(json.loads(parsed.content), schema)


def _check_calls(outs, names):
    """Every output ended its turn (``stop``) with >= 1 valid call of ``names`` and nothing else after
    the reasoning; returns the call count per output."""
    counts = []
    for o in outs:
        assert o.finish == "stop", o.text
        parsed = parse_output(o.text, TOOLS, prompt_tail=PROMPT_TAIL)
        assert parsed.finish_reason() == "tool_calls" and len(parsed.tool_calls) >= 1, o.text
        assert parsed.rejected_tool_calls == 0 and not parsed.parser_error
        assert parsed.content is None  # nothing but the calls after the reasoning
        for call in parsed.tool_calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
        counts.append(len(parsed.tool_calls))
    return counts


def test_tool_choice_required(compiler):
    """Capped at one call per declared tool (2), so every forced turn ends within max_tokens."""
    outs = _run(compiler, tool_calls_spec(TOOLS), seed=2)
    counts = _check_calls(outs, set(PARAMETERS))
    names = {c.name for o in outs for c in parse_output(o.text, TOOLS, prompt_tail=PROMPT_TAIL).tool_calls}
    assert names == set(PARAMETERS)  # both tools are reachable
    assert set(counts) == {1, 2}  # parallel calls are allowed, up to the cap


def test_tool_choice_named(compiler):
    outs = _run(compiler, tool_calls_spec(TOOLS, name="book_table"), seed=3)
    assert set(_check_calls(outs, {"book_table"})) == {1}  # a named tool: one call


def test_parallel_tool_calls_false(compiler):
    outs = _run(compiler, tool_calls_spec(TOOLS, parallel_tool_calls=False), seed=4)
    assert set(_check_calls(outs, set(PARAMETERS))) == {1}


def test_tool_choice_none_never_opens_a_call(compiler):
    outs = _run(compiler, no_tool_call_spec(), seed=5)
    for o in outs:
        assert "<minimax:tool_call>" not in o.text
        assert compiler.tokenizer.tool_call_id not in o.token_ids
        assert not parse_output(o.text, TOOLS, prompt_tail=PROMPT_TAIL).tool_calls


def test_bitmask_rows_never_empty_and_padding_never_allowed(compiler):
    """The padded ids past the tokenizer (V > tokenizer size) are never allowed; every row allows
    something (checked by the sampler too: an empty row would be all -inf)."""
    constraint = compiler.constraint(json_spec(SCHEMAS["nested_enum"]), "inside", 0)
    bitmask = torch.zeros(1, compiler.words, dtype=torch.int32)
    constraint.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, compiler.vocab_size)[0]
    assert allowed.nonzero().flatten().tolist() == [compiler.tokenizer.think_end_id]  # budget 0: forced
    assert compiler.vocab_size > compiler.tokenizer.vocab_size
    assert not allowed[compiler.tokenizer.vocab_size:].any()


LOOKUP = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
        "word": {"type": "string", "minLength": 2, "maxLength": 5},
        "mode": {"const": "fast"},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "rows": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"k": {"type": "string", "maxLength": 3}},
            "required": ["k"], "additionalProperties": False}},
    }, "required": ["code", "word", "mode", "ratio"]}}}


def test_raw_string_constraints_and_json_parameters(compiler):
    """pattern / minLength / const on raw-string parameters, number and array-of-object JSON values."""
    spec = tool_calls_spec([LOOKUP], parallel_tool_calls=False)
    outs = sample_batch(compiler, [compiler.constraint(spec, "may_open", BUDGET) for _ in range(100)],
                        MAX_TOKENS, seed=6)
    stopped = [o for o in outs if o.finish == "stop"]
    assert len(stopped) >= 95 and all(o.error is None for o in outs)
    for o in stopped:
        calls = parse_output(o.text, [LOOKUP], prompt_tail="]~b]ai\n").tool_calls
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0].arguments), LOOKUP["function"]["parameters"])
