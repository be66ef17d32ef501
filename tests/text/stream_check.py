"""Test helpers: stream a text through StreamingParser under a chunking and accumulate the result,
checking the streaming invariants of spec chat-and-parsers.md §3.6 on the way (P21–P25)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

from m2serve.text.parser import StreamingParser

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


REASONING_TAGS = ("<think>", "</think>", "<minimax:tool_call>")
CONTENT_TAGS = ("</think>",)
CONTENT_TOOL_TAGS = ("</think>", "<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=")


def _partial_tag_suffix(text: str, tags) -> bool:
    """True if text ends with a proper, non-empty prefix of one of ``tags``."""
    return any(text.endswith(tag[:k]) for tag in tags for k in range(1, len(tag)))


def stream(output: str, chunks: list[str], tools, mode: str, prompt_tail: str) -> Streamed:
    """Feed ``chunks`` (which must join to ``output``) and check invariants on every delta."""
    assert "".join(chunks) == output
    parser = StreamingParser(tools, mode, prompt_tail)
    result = Streamed()
    deltas = [(parser.feed(c), False) for c in chunks] + [(parser.finish(), True)]
    for delta, final in deltas:
        for chunk in delta.chunks():  # P25: no chunk mixes reasoning and content
            assert not (chunk.reasoning and chunk.content)
        if not final:  # P22: no partial tag leaves before finish()
            assert not _partial_tag_suffix(delta.content, CONTENT_TOOL_TAGS if tools else CONTENT_TAGS)
            assert not _partial_tag_suffix(delta.reasoning, REASONING_TAGS)
        result.reasoning += delta.reasoning
        result.content += delta.content
        for tc in delta.tool_calls:
            if tc.id is not None:  # P23: one first delta per index with id, type, name, ""
                assert tc.index not in result.names
                assert CALL_ID.fullmatch(tc.id) and tc.type == "function" and tc.name
                assert tc.arguments == ""
                assert tc.index == len(result.names)  # dense indices
                result.names[tc.index] = tc.name
                result.arguments[tc.index] = ""
            else:
                assert tc.index in result.names and tc.type is None and tc.name is None
                result.arguments[tc.index] += tc.arguments
    result.closed = list(parser.tool_calls)
    for call in result.closed:  # P24: concatenated deltas == non-streaming arguments, byte for byte
        assert result.arguments[call.index] == call.arguments
        assert json.dumps(json.loads(call.arguments), ensure_ascii=False) == call.arguments
    result.rejected = parser.rejected_tool_calls
    result.error = parser.parser_error
    return result


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
