"""Property tests for the parser (docs/parsers.md §3): random tool calls rendered by OUR
chat template come back exactly (excluding the §3.7 format limits), arbitrary text never raises and
gives the same result under any chunking (P20, P21), and render(parse(render(x))) == render(x)."""

from __future__ import annotations

import json
import re

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from stream_check import split_at, stream

import m2serve.checkpoints
from m2serve.text.parser import parse_output
from m2serve.text.template import ChatTemplate

TEMPLATE = ChatTemplate.from_file(m2serve.checkpoints.CHAT_TEMPLATE)
USER = {"role": "user", "content": "go"}
EOM = "[e~[\n"
TAGS = ("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=",
        "</invoke>", "<parameter name=", "</parameter>")
LIMITS = re.compile(r"<parameter name=|</invoke>")  # §3.7: a value containing these ends there
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text with the hard parts: XML-like fragments, tag pieces, CJK, emoji (incl. ZWJ), code indentation.
FRAGMENTS = ["<div>", "</div>", "</parameter>", "<parameter", "</think", "<b>", "&lt;", "\n", "    ",
             "\t", '"', "\\", "名字", "天气", "🙂", "👩\u200d💻", "def f():\n    return 1", "{", "]", "x"]
text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=8).map("".join)
name = st.text(st.characters(blacklist_characters=">", blacklist_categories=("Cs",)), min_size=1,
               max_size=12).filter(lambda s: s == s.strip() and s.strip())


def _json_values(depth=2):
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                       st.floats(allow_nan=False, allow_infinity=False), text)
    if depth == 0:
        return scalar
    return st.one_of(scalar, st.lists(_json_values(depth - 1), max_size=3),
                     st.dictionaries(text, _json_values(depth - 1), max_size=3))


TYPES = {"string": text, "integer": st.integers(-10**15, 10**15),
         "number": st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
         "boolean": st.booleans(), "null": st.none(),
         "object": st.dictionaries(text, _json_values(), max_size=3),
         "array": st.lists(_json_values(), max_size=3)}


@st.composite
def tool_turns(draw):
    """(tools, calls): tools with typed keys; calls with values drawn from each key's type."""
    names = draw(st.lists(name, min_size=1, max_size=3, unique=True))
    specs = {n: draw(st.dictionaries(name, st.sampled_from(sorted(TYPES)), max_size=4)) for n in names}
    tools = [{"type": "function", "function": {"name": n, "description": "d", "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in spec.items()}}}}
        for n, spec in specs.items()]
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.sampled_from(names))
        keys = [k for k in specs[n] if draw(st.booleans())]
        calls.append((n, {k: draw(TYPES[specs[n][k]]) for k in keys}))
    return tools, calls


def _within_format(value) -> bool:
    """False for the documented limits of docs/parsers.md §3.7."""
    if isinstance(value, str):
        return not (value.startswith("\n") or value.endswith("\n") or LIMITS.search(value))
    return not LIMITS.search(json.dumps(value, ensure_ascii=False))


def _free_of_tags(s: str) -> bool:
    return not any(tag in s for tag in TAGS)


def _generation(messages, tools):
    """Split our template's rendering of the last (assistant) message into prompt and model output."""
    full = TEMPLATE.render(messages, tools, add_generation_prompt=False)
    with_prompt = TEMPLATE.render(messages[:-1], tools, add_generation_prompt=True)
    plain = TEMPLATE.render(messages[:-1], tools, add_generation_prompt=False) + "]~b]ai\n"
    prompt = with_prompt if full.startswith(with_prompt) else plain
    assert full.startswith(prompt) and full.endswith(EOM)
    return prompt, full[len(prompt):-len(EOM)]


def _assistant(reasoning, content, calls):
    msg = {"role": "assistant", "content": content,
           "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                          for i, (n, a) in enumerate(calls)]}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def _typed(v):
    if isinstance(v, dict):
        return [(k, _typed(x)) for k, x in v.items()]
    if isinstance(v, list):
        return [_typed(x) for x in v]
    return (type(v).__name__, v)


@SETTINGS
@given(tool_turns(), st.one_of(st.none(), text), text, st.randoms(use_true_random=False))
def test_rendered_tool_calls_come_back_exactly(turn, reasoning, content, rnd):  # §3.3–3.6, limits §3.7
    tools, calls = turn
    assume(all(_within_format(v) for _, args in calls for v in args.values()))
    assume(_free_of_tags(content) and (reasoning is None or _free_of_tags(reasoning)))
    prompt, output = _generation([USER, _assistant(reasoning, content, calls)], tools)
    cuts = [rnd.randrange(1, len(output)) for _ in range(rnd.randint(0, 20))] if len(output) > 1 else []
    s = stream(output, split_at(output, cuts), tools, "split", prompt)
    assert s.rejected == 0 and not s.error
    kept = (reasoning or "").strip("\n")
    assert s.reasoning == (kept if kept and prompt.endswith("<think>\n") else "")
    assert s.content.strip() == content.strip()


@SETTINGS
@given(tool_turns(), st.one_of(st.none(), text), text)
def test_round_trip_render_parse_render(turn, reasoning, content):  # render(parse(render(x))) == render(x)
    tools, calls = turn
    assume(all(_within_format(v) for _, args in calls for v in args.values()))
    assume(_free_of_tags(content) and (reasoning is None or _free_of_tags(reasoning)))
    messages = [USER, _assistant(reasoning, content, calls)]
    prompt, output = _generation(messages, tools)
    r = parse_output(output, tools, "split", prompt)
    again = {"role": "assistant", "content": r.content, "reasoning_content": r.reasoning,
             "tool_calls": [{"id": t.id, "type": t.type,
                             "function": {"name": t.name, "arguments": t.arguments}} for t in r.tool_calls]}
    assert TEMPLATE.render([USER, again], tools, add_generation_prompt=False) == \
        TEMPLATE.render(messages, tools, add_generation_prompt=False)


NOISE = st.lists(st.one_of(st.sampled_from([*TAGS, "<", ">", "</", "name=", '"f"', "f", "\n", " ", "x", "1",
                                            "<minimax:tool", "</param", "<invoke name=\"f\">", "null", "{}"]),
                           st.text(max_size=4)), max_size=40).map("".join)
NOISE_PROPS = {"n": {"type": "integer"}, "o": {"anyOf": [{"type": "object"}, {"type": "null"}]},
               "s": {"type": "string"}}
NOISE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": NOISE_PROPS}}}]


@SETTINGS
@given(NOISE, st.sampled_from([None, NOISE_TOOLS]), st.sampled_from(["split", "passthrough"]),
       st.sampled_from(["", "<think>\n"]), st.randoms(use_true_random=False))
def test_arbitrary_text_never_raises_and_is_chunking_independent(out, tools, mode, tail, rnd):  # P20, P21
    whole = stream(out, [out], tools, mode, tail)
    cuts = [rnd.randrange(1, len(out)) for _ in range(rnd.randint(1, 30))] if len(out) > 1 else []
    for chunks in (split_at(out, cuts), list(out) or [""]):
        s = stream(out, chunks, tools, mode, tail)
        assert (s.reasoning, s.content, s.names, s.rejected) == \
            (whole.reasoning, whole.content, whole.names, whole.rejected)
        assert [(c.name, c.arguments) for c in s.closed] == [(c.name, c.arguments) for c in whole.closed]
    assert not whole.error
    if tools is None and mode == "split" and tail == "" and "think>" not in out:
        assert whole.content == out  # nothing lost (P18)


@SETTINGS
@given(tool_turns(), st.one_of(st.none(), text), text, st.randoms(use_true_random=False))
def test_empty_chunks_interleaved_change_nothing(turn, reasoning, content, rnd):  # feed("") is a no-op
    tools, calls = turn
    assume(all(_within_format(v) for _, args in calls for v in args.values()))
    assume(_free_of_tags(content) and (reasoning is None or _free_of_tags(reasoning)))
    prompt, output = _generation([USER, _assistant(reasoning, content, calls)], tools)
    # values on their own lines, as the model writes them (P15 strips one newline each side)
    output = re.sub(r"(<parameter name=[^>]*>)", "\\1\n", output).replace("</parameter>", "\n</parameter>")
    cuts = [rnd.randrange(1, len(output)) for _ in range(rnd.randint(0, 20))] if len(output) > 1 else []
    chunks = split_at(output, cuts)
    with_empties = [c for chunk in chunks for c in ([""] * rnd.randint(0, 2) + [chunk])] + [""]
    plain = stream(output, chunks, tools, "split", prompt)
    s = stream(output, with_empties, tools, "split", prompt)
    assert (s.reasoning, s.content, s.names, s.arguments, s.rejected, s.error) == \
        (plain.reasoning, plain.content, plain.names, plain.arguments, plain.rejected, plain.error)
    assert [(c.name, c.arguments) for c in s.closed] == [(c.name, c.arguments) for c in plain.closed]
