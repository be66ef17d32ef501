"""Every acceptance case of tests/data/parser_cases.jsonl (docs/parsers.md §3; fields: tests/data/README.md),
parsed in one go and streamed under many chunkings: whole, per character, at and inside every tag (each cut
alone and all together), random splits with fixed seeds, and the case's source_chunks.

Comparison rules are those of tests/data/README.md: null, "" and whitespace-only text are the same
empty value; arguments compare with exact JSON types and key order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stream_check import chunkings, stream

from m2serve.text.parser import parse_output

CASE_FILE = Path(__file__).resolve().parents[1] / "data" / "parser_cases.jsonl"
CASES = [json.loads(line) for line in CASE_FILE.read_text(encoding="utf-8").splitlines() if line]


def _empty(text):
    return text is None or text.strip() == ""


def _same_text(got, want):
    return (_empty(got) and _empty(want)) or got == want


def _typed(value):
    """JSON value with types made explicit, so 1, 1.0 and true differ."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, value)


def _check_calls(got, want, name_only_when_null=False):
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert g["name"] == w["name"]
        if w["arguments"] is None and name_only_when_null:
            continue
        assert g["arguments"] is not None
        args = json.loads(g["arguments"])
        assert _typed(args) == _typed(w["arguments"])
        assert list(args) == list(w["arguments"])  # key order
        assert g["arguments"] == json.dumps(w["arguments"], ensure_ascii=False)  # P17 exact string


def _matches(result, expect, name_only_when_null=False):
    try:
        assert _same_text(result["reasoning"], expect["reasoning"]), ("reasoning", result["reasoning"])
        assert _same_text(result["content"], expect["content"]), ("content", result["content"])
        _check_calls(result["tool_calls"], expect["tool_calls"], name_only_when_null)
    except AssertionError as exc:
        return str(exc) or "mismatch"
    return None


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case_non_streaming(case):  # spec §3 P1–P20, one-shot
    r = parse_output(case["output"], case["tools"], case["mode"], case["prompt_tail"])
    got = {"reasoning": r.reasoning, "content": r.content,
           "tool_calls": [{"name": t.name, "arguments": t.arguments} for t in r.tool_calls]}
    assert _matches(got, case["expect"]) is None, (_matches(got, case["expect"]), got)
    assert [t.index for t in r.tool_calls] == list(range(len(r.tool_calls)))  # P11 dense indices
    assert not r.parser_error


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case_streaming_all_chunkings(case):  # spec §3.6 P21–P26
    splits = chunkings(case["output"])
    for i, chunks in enumerate(case.get("source_chunks") or []):
        splits[f"source_chunks[{i}]"] = chunks
    for label, chunks in splits.items():
        s = stream(case["output"], chunks, case["tools"], case["mode"], case["prompt_tail"])
        closed = {c.index: c.arguments for c in s.closed}
        got = {"reasoning": s.reasoning, "content": s.content,
               "tool_calls": [{"name": s.names[i], "arguments": closed.get(i)} for i in sorted(s.names)]}
        problem = _matches(got, case["expect"])
        if problem and "expect_stream_alt" in case:  # P26: a header already sent cannot be retracted
            problem = _matches(got, case["expect_stream_alt"], name_only_when_null=True)
        assert problem is None, (label, problem, got)
        if case.get("expect_incremental_args"):
            _check_incremental(case)


def _check_incremental(case):
    """Argument text arrives before the chunk holding </invoke> (streamed per character)."""
    out = case["output"]
    end = out.index("</invoke>")
    s_before = stream(out[:end], list(out[:end]), case["tools"], case["mode"], case["prompt_tail"])
    assert any(len(a) > 0 for a in s_before.arguments.values())
