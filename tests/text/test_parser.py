"""Parser policy beyond the shared case file: the spec's own acceptance table (docs/parsers.md
§4, rows not in parser_cases.jsonl), counters (P13, P20), finish reasons (P19), hold-back (P22) and
incremental arguments (P23/P24). Expected values are derived by hand from the spec's rules."""

from __future__ import annotations

import json

import pytest
from stream_check import chunkings, stream

from m2serve.text import parser as parser_mod
from m2serve.text.parser import ParserDelta, StreamingParser, finish_reason, parse_output


def tool(name, props):
    schema = {"type": "object", "properties": props}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


S = {"type": "string"}
SEARCH = tool("search", {"query": S})
WEATHER = tool("get_weather", {"city": S})
WRITE = tool("write_file", {"path": S, "content": S})


def inv(name, *params, quote='"'):
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params)
    return f"<invoke name={quote}{name}{quote}>\n{body}</invoke>"


def block(*invokes):
    return "<minimax:tool_call>\n" + "".join(i + "\n" for i in invokes) + "</minimax:tool_call>"


# (id, prompt_tail, tools, output, reasoning, content, [(name, args)], rejected)
TABLE = [
    ("9-undeclared-skipped", "", [SEARCH],
     block(inv("img_gen", ("prompt", "cat")), inv("search", ("query", "news"))),
     None, None, [("search", {"query": "news"})], 1),
    ("10-only-undeclared", "", [SEARCH], block(inv("img_gen", ("prompt", "cat"))), None, None, [], 1),
    ("11-literal-param-end", "", [WRITE],
     block(inv("write_file", ("path", "a"), ("content", "x</parameter>y"))),
     None, None, [("write_file", {"path": "a", "content": "x</parameter>y"})], 0),
    ("13-code-value", "", [WRITE],
     block(inv("write_file", ("content", "\n    def f():\n        return 1\n"))),
     None, None, [("write_file", {"content": "    def f():\n        return 1"})], 0),
    ("14-null", "", [tool("f", {"v": {"type": ["integer", "null"]}})], inv("f", ("v", "null")),
     None, None, [("f", {"v": None})], 0),
    ("14-int", "", [tool("f", {"v": {"type": ["integer", "null"]}})], inv("f", ("v", "42")),
     None, None, [("f", {"v": 42})], 0),
    ("14-nil", "", [tool("f", {"v": {"type": ["integer", "null"]}})], inv("f", ("v", "nil")),
     None, None, [("f", {"v": "nil"})], 0),
    ("16-bad-int", "", [tool("f", {"n": {"type": "integer"}})], inv("f", ("n", "not_a_number")),
     None, None, [("f", {"n": "not_a_number"})], 0),
    ("18-nested-coercion", "", [tool("f", {"task": {"type": "dict", "properties": {"n": {"type": "int"}}}})],
     inv("f", ("task", '{"n": "5"}')), None, None, [("f", {"task": {"n": 5}})], 0),
    ("20-two-blocks", "", [WEATHER, SEARCH],
     block(inv("get_weather", ("city", "Tokyo"))) + "\n" + block(inv("search", ("query", "food"))),
     None, "\n", [("get_weather", {"city": "Tokyo"}), ("search", {"query": "food"})], 0),
    ("21-quotes", "", [tool("f", {})], inv("f", ("a", "1"), quote="'") + inv("f", ("a", "2"), quote=""),
     None, None, [("f", {"a": "1"}), ("f", {"a": "2"})], 0),
    ("22-after-block", "", [tool("f", {})], block(inv("f", ("a", "1"))) + "\nDone.",
     None, "\nDone.", [("f", {"a": "1"})], 0),
    ("25-stray-end", "", None, "</think>Hello", None, "Hello", [], 0),
    ("p12-duplicate-first-wins", "", [tool("f", {})], inv("f", ("a", "1"), ("a", "2"), ("b", "3")),
     None, None, [("f", {"a": "1", "b": "3"})], 0),
    ("p12-block-text", "", [tool("f", {})],
     "<minimax:tool_call>  note \n" + inv("f") + " tail </minimax:tool_call>",
     None, "notetail", [("f", {})], 0),
    ("p8-nested-open-ignored", "", [tool("f", {})],
     "<minimax:tool_call><minimax:tool_call>" + inv("f") + "</minimax:tool_call>",
     None, None, [("f", {})], 0),
    ("p10-close-in-value-literal", "", [WRITE], inv("write_file", ("content", "a</minimax:tool_call>b")),
     None, None, [("write_file", {"content": "a</minimax:tool_call>b"})], 0),
    ("p18-unclosed-block-no-call", "", [tool("f", {})], "Hi <minimax:tool_call>\n  just text",
     None, "Hi <minimax:tool_call>\n  just text", [], 0),
    ("p18-second-invoke-unclosed", "", [tool("f", {})],
     "<minimax:tool_call>" + inv("f", ("a", "1")) + '<invoke name="f">\n<parameter name="a">2',
     None, '<invoke name="f">\n<parameter name="a">2', [("f", {"a": "1"})], 0),
    ("p2-leading-ws-think", "", None, " \n<think>\nplan\n</think>\n\nok", "plan", "ok", [], 0),
    ("p2-late-think-literal", "", None, "a <think>b", None, "a <think>b", [], 0),
    ("p6-reasoning-only-newlines", "<think>\n", None, "\n\nR1\nR2\n\n", "R1\nR2", None, [], 0),
]


@pytest.mark.parametrize("row", TABLE, ids=[r[0] for r in TABLE])
def test_policy_table(row):  # spec §4 table rows 9–25 and P2/P6/P8/P10/P12/P18 by hand
    _, tail, tools, output, reasoning, content, calls, rejected = row
    r = parse_output(output, tools, "split", tail)
    assert (r.reasoning, r.content) == (reasoning, content)
    assert [(t.name, json.loads(t.arguments)) for t in r.tool_calls] == calls
    assert [t.arguments for t in r.tool_calls] == [json.dumps(a, ensure_ascii=False) for _, a in calls]
    assert r.rejected_tool_calls == rejected  # P13 counter
    for label, chunks in chunkings(output).items():  # P21 chunking independence
        s = stream(output, chunks, tools, "split", tail)
        assert (s.reasoning or None, s.content or None) == (reasoning, content), label
        assert [(c.name, json.loads(c.arguments)) for c in s.closed] == calls, label
        assert s.rejected == rejected, label


def test_undeclared_takes_no_index_in_stream():  # P13: rejected invoke sends nothing, no index
    out = block(inv("img_gen", ("prompt", "cat")), inv("search", ("query", "news")))
    s = stream(out, list(out), [SEARCH], "split", "")
    assert s.names == {0: "search"} and s.rejected == 1


def test_finish_reasons():  # P19 and P26
    assert finish_reason(0, False) == "stop"
    assert finish_reason(2, False) == "tool_calls"
    assert finish_reason(2, True) == "length"
    full = parse_output(inv("f", ("a", "1")), [tool("f", {})])
    assert full.finish_reason() == "tool_calls" and full.finish_reason(stopped_by_length=True) == "length"
    cut = 'Hi <minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par'
    r = parse_output(cut, [WEATHER])  # spec §4 row 19
    assert r.content == cut and r.tool_calls == [] and r.finish_reason(stopped_by_length=True) == "length"
    p = StreamingParser([WEATHER])
    first = p.feed(cut)
    assert first.tool_calls and first.tool_calls[0].name == "get_weather"  # header sent (P23)
    assert p.finish().content.endswith("Par") and p.finish_reason() == "stop"  # P26: closed calls only


def test_string_arguments_stream_before_invoke_closes():  # P24
    out = inv("write_file", ("path", "a.txt"), ("content", "hello world"))
    p = StreamingParser([WRITE])
    args = ""
    for ch in out[:out.index("</parameter>\n</invoke>")]:
        for tc in p.feed(ch).tool_calls:
            args += tc.arguments
    assert args == '{"path": "a.txt", "content": "hello world'


def test_typed_value_withheld_until_end():  # P24: non-string values are sent whole at their end
    out = inv("f", ("n", "12345"))
    p = StreamingParser([tool("f", {"n": {"type": "integer"}})])
    args = "".join(tc.arguments for ch in out[:out.index("</parameter>")] for tc in p.feed(ch).tool_calls)
    assert args == '{"n": '
    rest = p.feed(out[out.index("</parameter>"):])
    assert "".join(tc.arguments for tc in rest.tool_calls) == "12345}"


def test_holds_param_end_until_follower():  # P10(a) + P22
    p = StreamingParser([WRITE])
    d = p.feed('<invoke name="write_file"><parameter name="content">x</parameter>')
    args = "".join(tc.arguments for tc in d.tool_calls)
    assert args == '{"content": "x'  # the closing quote waits for the follower
    d = p.feed("y</parameter></invoke>")
    assert "".join(tc.arguments for tc in d.tool_calls) == '</parameter>y"}'


def test_trailing_newline_held_in_value_and_reasoning():  # P22 (P6, P15)
    p = StreamingParser([WRITE])
    d = p.feed('<invoke name="write_file"><parameter name="content">\nab\n')
    assert "".join(tc.arguments for tc in d.tool_calls).endswith('"ab')
    r = StreamingParser(None, prompt_tail="<think>\n")
    assert r.feed("plan\n").reasoning == "plan"
    assert r.feed("more").reasoning == "\nmore"


def test_one_delta_keeps_reasoning_and_content_apart():  # P25 (the stream split: test_chat_apis_units)
    d = StreamingParser(None, prompt_tail="<think>\n").feed("R</think>C")
    assert (d.reasoning, d.content) == ("R", "C")
    assert ParserDelta().is_empty() and not d.is_empty()


def test_passthrough_without_think_prefix():  # P7 variant for a server without reasoning parser
    out = "R</think>C"
    p = StreamingParser(None, "passthrough", "<think>\n", emit_think_prefix=False)
    assert p.feed(out).content + p.finish().content == out
    assert parse_output(out, None, "passthrough", "<think>\n").content == "<think>" + out


def test_internal_error_never_raises(monkeypatch):  # P20
    def boom(raw, schema):
        raise RuntimeError("boom")

    monkeypatch.setattr(parser_mod, "coerce_value", boom)
    text = 'A <invoke name="f"><parameter name="a">1</parameter></invoke> tail'
    p = StreamingParser([tool("f", {})])
    d1 = p.feed(text)
    d2 = p.feed(" more")
    d3 = p.finish()
    assert p.parser_error
    content = d1.content + d2.content + d3.content
    assert content.startswith("A ") and content.endswith("</invoke> tail more")
    assert p.tool_calls == []


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="mode='x'"):
        StreamingParser(None, "x")  # type: ignore[arg-type]


def test_internal_error_on_fast_path_never_raises(monkeypatch):  # P20, chunks without '<'
    def boom(text):
        raise RuntimeError("boom")

    monkeypatch.setattr(parser_mod, "_json_chars", boom)
    p = StreamingParser([WRITE])
    head = '<invoke name="write_file"><parameter name="content">'
    deltas = [p.feed(head), p.feed("abc"), p.feed(" <x>"), p.finish()]
    assert p.parser_error
    assert "".join(d.content for d in deltas) == head + "abc <x>"


def _snapshot(d: ParserDelta):
    return (d.reasoning, d.content, [(c.index, c.id, c.type, c.name, c.arguments) for c in d.tool_calls])


def test_returned_deltas_never_change():  # issue 16 item 2: deltas are immutable once returned
    text = ("I will check.</think>Checking. "
            + block(inv("get_weather", ("city", "Paris")), inv("forecast", ("days", "5"))) + " done")
    tools = [WEATHER, tool("forecast", {"days": {"type": "integer"}})]
    p = StreamingParser(tools, prompt_tail="<think>\n")
    kept, snaps = [], []
    for ch in [*text, None]:
        d = p.feed(ch) if ch is not None else p.finish()
        kept.append(d)
        snaps.append(_snapshot(d))  # as returned
    for ch in "more text, fed after":  # later feeds (content) must not reach earlier deltas
        p.feed(ch)
    assert [_snapshot(d) for d in kept] == snaps
    headers = [c for d in kept for c in d.tool_calls if c.id is not None]
    assert [c.name for c in headers] == ["get_weather", "forecast"]  # one header per call (P23)
    args = {}
    for d in kept:
        for c in d.tool_calls:
            args[c.index] = args.get(c.index, "") + c.arguments
    assert args == {0: '{"city": "Paris"}', 1: '{"days": 5}'}  # hand-derived P17/P24
    with pytest.raises(AttributeError):  # frozen: a consumer cannot change a delta either
        kept[0].content = "x"  # type: ignore[misc]


@pytest.mark.parametrize("depth", [128, 129, 600, 100_000])
def test_deeply_nested_argument_keeps_the_call(depth):
    # issue 26 item 8 / P16: an object nested 600 levels deep raised RecursionError inside the parser
    # and the call was lost (P20); past 128 levels the value stays its text and the call is returned
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "object"}}}}}]
    value = '{"a": ' * depth + "1" + "}" * depth
    text = (f'<minimax:tool_call>\n<invoke name="f">\n<parameter name="x">{value}</parameter>\n'
            "</invoke>\n</minimax:tool_call>")
    out = parse_output(text, tools, mode="split")
    assert out.content is None and [c.name for c in out.tool_calls] == ["f"]
    expected = json.loads(value) if depth <= 128 else value
    assert out.tool_calls[0].arguments == json.dumps({"x": expected}, ensure_ascii=False)
