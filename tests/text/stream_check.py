"""Test helpers: stream a text through StreamingParser under a chunking and accumulate the result,
checking the streaming invariants of docs/parsers.md §3.6 on the way (P21–P25)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

from m2serve.text.parser import StreamingParser, parse_output

TAGS = ("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=",
        "</invoke>", "<parameter name=", "</parameter>")
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


@dataclass
class Streamed:
    reasoning: str = ""
    content: str = ""
    names: dict[int, str] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)
    closed: list = field(default_factory=list)  # ToolCall objects from the parser
    rejected: int = 0
    error: bool = False


def _tag_prefixes(text: str) -> list[str]:
    """Tags of which a proper, non-empty suffix-prefix ends ``text`` (they could still complete)."""
    return [tag for tag in TAGS if any(text.endswith(tag[:k]) for k in range(1, len(tag)))]


def stream(output: str, chunks: list[str], tools, mode: str, prompt_tail: str) -> Streamed:
    """Feed ``chunks`` (which must join to ``output``) and check invariants on every delta.

    P25: no reasoning follows content (a delta's reasoning precedes its content; the serve layer's
    ``ChoiceDelta.pieces`` sends them as separate chunks, tests/serve/test_chat_apis_units.py).
    P22: whenever the text fed so far ends with a possible partial tag, what was emitted so far is
    a prefix of the one-shot parse of that text with the tag completed, i.e. nothing that the tag
    could still change has left.
    """
    assert "".join(chunks) == output
    parser = StreamingParser(tools, mode, prompt_tail)
    result = Streamed()
    fed = ""
    for chunk in [*chunks, None]:
        delta = parser.feed(chunk) if chunk is not None else parser.finish()
        assert not (result.content and delta.reasoning)  # P25: no reasoning after content has started
        result.reasoning += delta.reasoning
        result.content += delta.content
        _collect_calls(result, delta)
        if chunk is None:
            break
        fed += chunk
        for tag in _tag_prefixes(fed):
            k = max(k for k in range(1, len(tag)) if fed.endswith(tag[:k]))
            done = parse_output(fed + tag[k:], tools, mode, prompt_tail)
            assert (done.reasoning or "").startswith(result.reasoning), (fed, tag, result.reasoning)
            assert (done.content or "").startswith(result.content), (fed, tag, result.content)
    result.closed = list(parser.tool_calls)
    for call in result.closed:  # P24: concatenated deltas == non-streaming arguments, byte for byte
        assert result.arguments[call.index] == call.arguments
        assert json.dumps(json.loads(call.arguments), ensure_ascii=False) == call.arguments
    result.rejected = parser.rejected_tool_calls
    result.error = parser.parser_error
    return result


def _collect_calls(result: Streamed, delta) -> None:
    for tc in delta.tool_calls:
        if tc.id is not None:  # P23: one first delta per index with id, type, name and ""
            assert tc.index not in result.names
            assert CALL_ID.fullmatch(tc.id) and tc.type == "function" and tc.name
            assert tc.arguments == ""
            assert tc.index == len(result.names)  # P11 dense indices
            result.names[tc.index] = tc.name
            result.arguments[tc.index] = ""
        else:  # later deltas carry only argument text
            assert tc.index in result.names and tc.type is None and tc.name is None
            result.arguments[tc.index] += tc.arguments


def tag_positions(text: str) -> list[int]:
    """Every position at and strictly inside each tag occurrence (for 'at and inside every tag')."""
    cuts = set()
    for tag in TAGS:
        start = text.find(tag)
        while start != -1:
            cuts.update(range(start, start + len(tag) + 1))
            start = text.find(tag, start + 1)
    return sorted(c for c in cuts if 0 < c < len(text))


def split_at(text: str, cuts) -> list[str]:
    cuts = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a] or [""]


def chunkings(text: str, seeds=(0, 1, 2, 3)) -> dict[str, list[str]]:
    """Whole, per character, at/inside every tag (one cut each, and all cuts), random splits."""
    out = {"whole": [text], "per-char": list(text) or [""],
           "all-tag-cuts": split_at(text, tag_positions(text))}
    for cut in tag_positions(text):
        out[f"cut@{cut}"] = split_at(text, [cut])
    for seed in seeds:
        rng = random.Random(seed)
        cuts = [rng.randrange(1, len(text)) for _ in range(rng.randint(1, 12))] if len(text) > 1 else []
        out[f"random-{seed}"] = split_at(text, cuts)
    return out
