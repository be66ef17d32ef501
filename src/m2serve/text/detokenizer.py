"""Incremental detokenisation for streaming (docs/parsers.md §1).

Each ``push`` decodes only a short window of ids: the text of ``ids[prefix:]`` minus the text of
``ids[prefix:read]`` is the new text, emitted only when it does not end in U+FFFD (a character
whose UTF-8 bytes are split across tokens). The concatenated output equals
``tokenizer.decode(all_ids)``. Optionally, text that may still become a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence

from m2serve.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of one request's generated ids.

    Args:
        tokenizer: the checkpoint's :class:`Tokenizer`.
        skip_special_tokens: drop special tokens except the four parser tags (``<think>``,
            ``</think>``, ``<minimax:tool_call>``, ``</minimax:tool_call>``), which stay text
            (docs/parsers.md §1).
        stop: stop strings matched on the decoded text; the match and what follows are never
            emitted, and a suffix that may still become one is held back. ``stopped`` turns True
            at a match; later pushes return "".

    ``push(ids) -> str`` returns the newly confirmed text; ``flush() -> str`` returns what is
    still held (call it once at the end). Without a stop match, the concatenation of all returned
    pieces equals ``tokenizer.decode(ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] were decoded already (context for the next window)
        self._read = 0
        self._stops = [s for s in stop if s]
        self._pending = ""  # decoded text held back for stop strings
        self.stopped = False
        self.stop_matched: str | None = None  # the stop string that ended the text (earliest in it)

    @property
    def has_stops(self) -> bool:
        """Whether stop strings are matched."""
        return bool(self._stops)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text that is now certain."""
        if self.stopped:
            return ""
        for tid in token_ids:
            if not (self._skip and self._tok.is_skipped(tid)):
                self._ids.append(tid)
        return self._confirm(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """Return everything still held (an incomplete character becomes U+FFFD)."""
        if self.stopped:
            return ""
        return self._confirm(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        window = self._ids[self._prefix:]
        text = self._tok.decode(window, skip_special_tokens=False)
        if text.endswith(_REPLACEMENT) and not final:
            return ""  # wait for the rest of the character
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=False)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def _confirm(self, text: str, final: bool) -> str:
        if not self._stops:
            return text
        text = self._pending + text
        hits = [(i, n, s) for n, s in enumerate(self._stops) if (i := text.find(s)) >= 0]
        if hits:
            at, _, self.stop_matched = min(hits)   # the earliest; a tie goes to the first listed
            self.stopped = True
            self._pending = ""
            return text[:at]
        keep = 0 if final else _stop_prefix_len(text, self._stops)
        self._pending = text[len(text) - keep:]
        return text[:len(text) - keep]


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
