"""One streaming parser for MiniMax-M2 output: reasoning, content and tool calls in a single pass.

The normative policy is docs/parsers.md §3, rules P1–P26; comments cite the rule they
implement. The machine reads the decoded text once, left to right: every feed appends the chunk to a
small buffer that holds only what is still undecided (a possible partial tag, a trailing newline that
may be dropped, a tool-call name waiting for its ``>``), so the cost is linear in the output length.
``parse_output`` (non-streaming) feeds the whole text to the same machine.

States: REASONING, CONTENT, BLOCK (inside ``<minimax:tool_call>``, outside invokes), and the invoke
states INVOKE_NAME, INVOKE_BODY, PARAM_NAME, VALUE. PLAIN is entered after an internal error (P20).
"""

from __future__ import annotations

import enum
import json
import logging
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from m2serve.text.schema import coerce_value, is_string_only, resolve_refs

log = logging.getLogger(__name__)

THINK = "<think>"
THINK_END = "</think>"
BLOCK = "<minimax:tool_call>"
BLOCK_END = "</minimax:tool_call>"
INVOKE = "<invoke name="
INVOKE_END = "</invoke>"
PARAM = "<parameter name="
PARAM_END = "</parameter>"

_REASONING_TAGS = (THINK, THINK_END, BLOCK)
_CONTENT_TAGS_NO_TOOLS = (THINK_END,)
_CONTENT_TAGS = (THINK_END, BLOCK, BLOCK_END, INVOKE)
_BLOCK_TAGS = (INVOKE, BLOCK_END, BLOCK)
_INVOKE_TAGS = (PARAM, INVOKE_END)
_VALUE_TAGS = (PARAM_END, PARAM, INVOKE_END)
_WS = " \t\n\r\f\v"

Mode = Literal["split", "passthrough"]


class _State(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    BLOCK = "block"
    INVOKE_NAME = "invoke_name"
    INVOKE_BODY = "invoke_body"
    PARAM_NAME = "param_name"
    VALUE = "value"
    PLAIN = "plain"


@dataclass(slots=True, frozen=True)
class ToolCallDelta:
    """One OpenAI-style streamed tool-call fragment (P23/P24).

    The first delta of an index carries ``id`` (``call_`` + 24 lowercase hex), ``type="function"``,
    ``name`` and ``arguments=""``; later ones carry only ``arguments`` text (``id``/``type``/``name``
    None). Concatenating an index's ``arguments`` gives its JSON arguments string. Frozen: a
    delta never changes once the parser has returned it.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    type: str | None = None
    name: str | None = None


@dataclass(slots=True, frozen=True)
class ParserDelta:
    """What one ``feed``/``finish`` call adds: reasoning text, content text and tool-call fragments.

    Within one delta all reasoning precedes all content in the output text, so the serve layer's
    one stream split (serve/chat_pipeline.py ``ChoiceDelta.pieces``) can send reasoning first and
    never mix the two in a chunk (P25). Immutable
    (frozen, ``tool_calls`` a tuple of frozen deltas): later feeds never change a returned delta.
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def is_empty(self) -> bool:
        """True when the delta carries nothing to send."""
        return not (self.reasoning or self.content or self.tool_calls)


@dataclass(slots=True)
class ToolCall:
    """A complete (closed, declared) tool call. ``arguments`` is the JSON string of P17."""

    index: int
    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass(slots=True)
class ParsedOutput:
    """Non-streaming result. Empty reasoning/content are None (P7)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    rejected_tool_calls: int = 0
    parser_error: bool = False

    def finish_reason(self, stopped_by_length: bool = False) -> str:
        """P19: ``length`` if the token limit stopped generation, else ``tool_calls`` / ``stop``."""
        return finish_reason(len(self.tool_calls), stopped_by_length)


def finish_reason(num_tool_calls: int, stopped_by_length: bool) -> str:
    """P19 finish reason from the number of returned (closed) calls and how generation stopped."""
    if stopped_by_length:
        return "length"
    return "tool_calls" if num_tool_calls else "stop"


def starts_in_reasoning(prompt_tail: str) -> bool:
    """P1: output starts in reasoning iff the rendered prompt, right-stripped, ends with ``<think>``."""
    return prompt_tail.rstrip().endswith(THINK)


def opens_reasoning(text: str) -> bool:
    """P1 for a continued assistant message (docs/parsers.md §2): its text holds a ``<think>`` that no
    ``</think>`` after it closes, so the continuation starts in reasoning."""
    return text.rfind(THINK) > text.rfind(THINK_END)


def opens_tool_block(text: str) -> bool:
    """A continued assistant message's text opens a ``<minimax:tool_call>`` block it does not close:
    its continuation would start inside a call, where the parser never starts (docs/parsers.md §2)."""
    return text.rfind(BLOCK) > text.rfind(BLOCK_END)


def _find_tag(buf: str, pos: int, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """Earliest tag in ``buf[pos:]``.

    Returns ``(i, tag)`` for a complete tag at ``i``; ``(i, None)`` when ``buf[i:]`` is a proper
    prefix of a tag (must be held back, P22); ``(len(buf), None)`` when neither occurs.
    """
    n = len(buf)
    i = buf.find("<", pos)
    while i != -1:
        for tag in tags:
            if buf.startswith(tag, i):
                return i, tag
        tail = buf[i:i + 24]
        if len(tail) == n - i and any(len(tag) > len(tail) and tag.startswith(tail) for tag in tags):
            return i, None
        i = buf.find("<", i + 1)
    return n, None


def _clean_name(text: str) -> str:
    """P9: trim, then remove one pair of matching surrounding quotes (double or single)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return text


_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')


def _json_chars(text: str) -> str:
    """``text`` as it appears inside a JSON string (json.dumps with ensure_ascii=False, no quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1] if _NEEDS_ESCAPE.search(text) else text


@dataclass(slots=True)
class _Call:
    index: int
    id: str
    name: str
    properties: dict[str, Any]
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Param:
    key: str
    schema: Any
    skip: bool
    streaming: bool
    parts: list[str] = field(default_factory=list)
    started: bool = False
    pending_newline: bool = False


class StreamingParser:
    """Incremental reasoning + tool-call parser for one chat-completion request (docs/parsers.md §3).

    Args:
        tools: the request's OpenAI tool list (``[{"type": "function", "function": {"name", "parameters"}}]``)
            or None. Tool parsing is on iff the list is non-empty (the server passes None when
            ``tool_choice`` is ``"none"``).
        mode: ``"split"`` (reasoning_content + clean content) or ``"passthrough"`` (raw text as content,
            tool blocks extracted), P7.
        prompt_tail: the end of the rendered prompt; decides the start state (P1) unless
            ``start_in_reasoning`` is given (a continued message, :func:`opens_reasoning`).
        request_id: used only in the one-line error log of P20.
        emit_think_prefix: passthrough only; False leaves out the ``<think>`` that P7 puts before
            output that started in reasoning (for a server run without a reasoning parser).

    ``feed(text)`` returns the new :class:`ParserDelta`; ``finish()`` flushes what was held back.
    Counters for the server: ``rejected_tool_calls`` (P13, undeclared names), ``parser_error`` (P20).
    ``tool_calls`` lists the closed, returned calls. Never raises from ``feed``/``finish``.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, mode: Mode = "split",
                 prompt_tail: str = "", request_id: str = "", emit_think_prefix: bool = True,
                 start_in_reasoning: bool | None = None) -> None:
        if mode not in ("split", "passthrough"):
            raise ValueError(f"parser mode={mode!r} is not one of 'split', 'passthrough'")
        self.request_id = request_id
        self.rejected_tool_calls = 0
        self.parser_error = False
        self.tool_calls: list[ToolCall] = []
        self._split = mode == "split"
        self._tools: dict[str, dict[str, Any]] = {}
        for tool in tools or ():
            fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                props = params.get("properties") if isinstance(params, Mapping) else None
                props = props if isinstance(props, Mapping) else {}
                self._tools.setdefault(fn["name"], {k: resolve_refs(v, params) for k, v in props.items()})
        self._tools_on = bool(self._tools)
        reasoning = starts_in_reasoning(prompt_tail) if start_in_reasoning is None else start_in_reasoning
        self._state = _State.REASONING if reasoning else _State.CONTENT
        self._at_start = not reasoning  # P2 window: only whitespace seen so far in CONTENT
        self._think_prefix = reasoning and not self._split and emit_think_prefix  # P7 "<think>" prefix
        self._buf = ""
        self._pos = 0
        self._name_scanned = 0
        self._drop_ws = False  # P4
        self._reasoning_started = False  # P6
        self._reasoning_newlines = ""  # P6: held newlines that may directly precede the end
        self._raw: list[str] | None = None  # P18: raw text to return if the invoke/block never completes
        self._in_block = False
        self._block_committed = False
        self._block_pending: list[str] = []  # P12 text of a block that has not produced a call yet
        self._run_started = False  # P12 current text run inside a block
        self._run_ws = ""
        self._call: _Call | None = None
        self._param: _Param | None = None
        self._num_params = 0
        self._out_reasoning = ""
        self._out_content = ""
        self._out_calls: list[ToolCallDelta] = []
        self._steps = {_State.CONTENT: self._step_content, _State.REASONING: self._step_reasoning,
                       _State.BLOCK: self._step_block, _State.VALUE: self._step_value,
                       _State.INVOKE_BODY: self._step_invoke_body, _State.INVOKE_NAME: self._step_name,
                       _State.PARAM_NAME: self._step_name, _State.PLAIN: self._step_plain}

    # ---------------------------------------------------------------- public API
    def feed(self, text: str) -> ParserDelta:
        """Consume the next decoded text chunk; return what can be emitted now (P21, P22). An empty
        chunk changes nothing (it must not count as a parameter value's first text, for one)."""
        if not text:
            return self._take_delta()
        if self._pos == len(self._buf) and "<" not in text:
            try:
                if self._feed_plain(text):
                    return self._take_delta()
            except Exception as exc:  # P20
                self._buf, self._pos = text, 0
                self._fail(exc)
                return self._take_delta()
        if self._pos:
            self._buf = self._buf[self._pos:] + text
            self._pos = 0
        else:
            self._buf += text
        self._guarded(final=False)
        return self._take_delta()

    def _feed_plain(self, text: str) -> bool:
        """Fast path for a chunk with no ``<`` and nothing held: same result as the full step."""
        state = self._state
        if state is _State.CONTENT and not self._at_start:
            self._emit_content(text)
        elif state is _State.REASONING:
            self._emit_reasoning(text)
        elif state is _State.VALUE or state is _State.INVOKE_BODY:
            if state is _State.VALUE:
                self._value_text(text)
            self._raw.append(text)
        else:
            return False
        self._buf, self._pos = "", 0
        return True

    def finish(self) -> ParserDelta:
        """Flush everything held back under the same rules (P22) and close the stream (P18)."""
        self._guarded(final=True)
        if not self.parser_error:
            try:
                self._finish_state()
            except Exception as exc:  # P20
                self._fail(exc)
        self._buf, self._pos = "", 0
        return self._take_delta()

    def finish_reason(self, stopped_by_length: bool = False) -> str:
        """P19/P26 finish reason counting only closed, returned calls."""
        return finish_reason(len(self.tool_calls), stopped_by_length)

    # ---------------------------------------------------------------- emission
    def _take_delta(self) -> ParserDelta:
        delta = ParserDelta(self._out_reasoning, self._out_content, tuple(self._out_calls))
        self._out_reasoning = self._out_content = ""
        self._out_calls = []
        return delta

    def _emit_content(self, text: str) -> None:
        if self._drop_ws:  # P4 (split mode only; never set in passthrough)
            text = text.lstrip(_WS)
            if not text:
                return
            self._drop_ws = False
        if not text:
            return
        if self._think_prefix:
            self._think_prefix = False
            text = THINK + text
        self._out_content += text

    def _emit_reasoning(self, text: str) -> None:
        if not self._split:  # P7 passthrough: reasoning is raw content
            self._emit_content(text)
            return
        if not self._reasoning_started:  # P6 leading newlines
            text = text.lstrip("\n")
            if not text:
                return
            self._reasoning_started = True
        text = self._reasoning_newlines + text
        body = text.rstrip("\n")
        self._reasoning_newlines = text[len(body):]  # P6: may directly precede the end
        if body:
            self._out_reasoning += body

    def _swallow(self, tag: str) -> None:
        """A swallowed reasoning tag: dropped in split mode, kept verbatim in passthrough (P3/P5/P7)."""
        if not self._split:
            self._emit_content(tag)

    def _emit_args(self, text: str) -> None:
        last = self._out_calls[-1] if self._out_calls else None
        if last is not None and last.index == self._call.index and last.id is None:
            self._out_calls[-1] = replace(last, arguments=last.arguments + text)
        else:
            self._out_calls.append(ToolCallDelta(self._call.index, text))

    def _take(self, n: int) -> str:
        """Consume ``n`` buffered characters, recording them for a P18 rollback when one is armed."""
        text = self._buf[self._pos:self._pos + n]
        self._pos += n
        if self._raw is not None:
            self._raw.append(text)
        return text

    # ---------------------------------------------------------------- machine
    def _guarded(self, final: bool) -> None:
        if self.parser_error:
            self._emit_content(self._buf[self._pos:])
            self._pos = len(self._buf)
            return
        try:
            while self._step(final):
                pass
        except Exception as exc:  # P20: never raise into the server
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        log.error("parser error %s request_id=%s buffered_chars=%d calls=%d", type(exc).__name__,
                  self.request_id, len(self._buf) - self._pos, len(self.tool_calls))
        self.parser_error = True
        unconsumed = "".join(self._raw or ()) + self._buf[self._pos:]
        self._raw = None
        self._state = _State.PLAIN
        self._drop_ws = False
        self._emit_content(unconsumed)
        self._pos = len(self._buf)

    def _step(self, final: bool) -> bool:
        """Advance the machine once; False when it needs more text."""
        return self._pos < len(self._buf) and self._steps[self._state](final)

    def _step_plain(self, final: bool) -> bool:
        self._emit_content(self._take(len(self._buf) - self._pos))
        return False

    def _step_reasoning(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        i, tag = _find_tag(buf, pos, _REASONING_TAGS)
        if i > pos:
            self._emit_reasoning(buf[pos:i])
        if tag is None:
            if final and i < len(buf):
                self._emit_reasoning(buf[i:])  # a partial tag at the very end is text
                i = len(buf)
            self._pos = i
            return False
        self._pos = i + len(tag)
        if tag == THINK:  # P3 stray <think>
            self._swallow(tag)
            return True
        self._reasoning_newlines = ""  # P6: newlines directly before the end are dropped
        if tag == THINK_END:
            self._swallow(tag)
            self._state = _State.CONTENT
            self._drop_ws = self._split  # P4
        elif self._tools_on:  # P3: <minimax:tool_call> ends reasoning and opens a block
            self._open_block(tag_consumed=True)
        else:
            self._state = _State.CONTENT
            self._emit_content(tag)
        return True

    def _step_content(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        if self._at_start:  # P2
            k = pos
            while k < len(buf) and buf[k] in _WS:
                k += 1
            if buf.startswith(THINK, k):
                self._swallow(buf[pos:k + len(THINK)])
                self._pos = k + len(THINK)
                self._at_start = False
                self._state = _State.REASONING
                return True
            if not final and (k == len(buf) or THINK.startswith(buf[k:])):
                return False
            self._at_start = False
        i, tag = _find_tag(buf, pos, _CONTENT_TAGS if self._tools_on else _CONTENT_TAGS_NO_TOOLS)
        if i > pos:
            self._emit_content(buf[pos:i])
        if tag is None:
            if final and i < len(buf):
                self._emit_content(buf[i:])
                i = len(buf)
            self._pos = i
            return False
        self._drop_ws = False  # a tag is not whitespace (P4 ends)
        if tag == BLOCK:
            self._pos = i
            self._open_block(tag_consumed=False)
        elif tag == INVOKE:
            self._pos = i
            self._open_invoke(in_block=False)
        else:  # P5 stray </think>, P8 stray </minimax:tool_call>
            self._pos = i + len(tag)
            if tag == THINK_END:
                self._swallow(tag)
        return True

    def _open_block(self, tag_consumed: bool) -> None:
        """Enter BLOCK; arm the P18 rollback from the ``<minimax:tool_call>`` tag."""
        if tag_consumed:  # implicit end of reasoning (P3)
            self._raw = [BLOCK]
        else:
            self._raw = []
            self._take(len(BLOCK))
        self._state = _State.BLOCK
        self._in_block = True
        self._block_committed = False
        self._block_pending = []
        self._run_started, self._run_ws = False, ""

    def _block_text(self, text: str) -> None:
        """P12: text inside a block outside invokes is content, each run stripped of surrounding space."""
        if not self._run_started:
            text = text.lstrip(_WS)
            if not text:
                return
            self._run_started = True
        text = self._run_ws + text
        body = text.rstrip(_WS)
        self._run_ws = text[len(body):]
        if body:
            if self._block_committed:
                self._emit_content(body)
            else:
                self._block_pending.append(body)

    def _step_block(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        i, tag = _find_tag(buf, pos, _BLOCK_TAGS)
        if i > pos:
            self._block_text(self._take(i - pos))
        if tag is None:
            if final and i < len(buf) and self._block_committed:
                self._block_text(self._take(len(buf) - i))
            return False
        self._run_started, self._run_ws = False, ""
        if tag == INVOKE:
            self._open_invoke(in_block=True)
        elif tag == BLOCK_END:
            self._take(len(tag))
            self._close_block()
        else:  # P8 nested block open is ignored
            self._take(len(tag))
        return True

    def _close_block(self) -> None:
        self._raw = None
        self._in_block = False
        self._state = _State.CONTENT
        self._release_block_text()

    def _release_block_text(self) -> None:
        if self._block_pending:
            self._emit_content("".join(self._block_pending))
            self._block_pending = []

    def _open_invoke(self, in_block: bool) -> None:
        if self._raw is None:
            self._raw = []
        self._take(len(INVOKE))
        self._in_block = in_block
        self._state = _State.INVOKE_NAME
        self._name_scanned = 0

    def _step_name(self, final: bool) -> bool:
        """INVOKE_NAME / PARAM_NAME: NAME is the text up to the next ``>`` (P9)."""
        buf, pos = self._buf, self._pos
        j = buf.find(">", pos + self._name_scanned)
        if j == -1:
            self._name_scanned = len(buf) - pos
            return False
        name = _clean_name(self._take(j - pos))
        self._take(1)
        self._name_scanned = 0
        if self._state is _State.INVOKE_NAME:
            self._start_call(name)
            self._state = _State.INVOKE_BODY
        else:
            self._start_param(name)
            self._state = _State.VALUE
        return True

    def _start_call(self, name: str) -> None:
        self._num_params = 0
        if name not in self._tools:  # P13
            log.warning("tool call to undeclared function %r rejected (request_id=%s)", name,
                        self.request_id)
            self._call = None
            return
        index = len(self.tool_calls)
        self._call = _Call(index, "call_" + secrets.token_hex(12), name, self._tools[name])
        self._out_calls.append(ToolCallDelta(index, "", self._call.id, "function", name))  # P23

    def _start_param(self, key: str) -> None:
        call = self._call
        skip = call is None or key in call.args
        schema = None if call is None else call.properties.get(key)
        self._param = _Param(key, schema, skip, not skip and is_string_only(schema))
        if skip:
            if call is not None:
                log.info("duplicate parameter %r in call %s skipped (first wins)", key, call.name)
            return
        call.args[key] = None  # reserve the key: first occurrence wins (P12)
        self._emit_args(("{" if self._num_params == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
        self._num_params += 1
        if self._param.streaming:
            self._emit_args('"')

    def _step_invoke_body(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        i, tag = _find_tag(buf, pos, _INVOKE_TAGS)
        if i > pos:
            self._take(i - pos)  # P12: text inside an invoke outside parameters is ignored
        if tag is None:
            return False
        self._take(len(tag))
        if tag == PARAM:
            self._state = _State.PARAM_NAME
            self._name_scanned = 0
        else:
            self._close_invoke()
        return True

    def _value_text(self, text: str) -> None:
        param = self._param
        if param.skip:
            return
        param.parts.append(text)
        if not param.streaming:
            return
        if not param.started:  # P15: at most one leading newline
            param.started = True
            if text.startswith("\n"):
                text = text[1:]
        if param.pending_newline:
            text = "\n" + text
            param.pending_newline = False
        if text.endswith("\n"):  # P15/P22: at most one trailing newline, held back
            text = text[:-1]
            param.pending_newline = True
        if text:
            self._emit_args(_json_chars(text))

    def _step_value(self, final: bool) -> bool:
        """P10 value boundaries."""
        buf, pos = self._buf, self._pos
        i, tag = _find_tag(buf, pos, _VALUE_TAGS)
        if i > pos:
            self._value_text(self._take(i - pos))
        if tag is None:
            return False
        if tag != PARAM_END:  # (b) unclosed parameter, (c) unclosed last parameter
            self._end_value()
            return True
        k = i + len(PARAM_END)
        while k < len(buf) and buf[k] in _WS:
            k += 1
        if buf.startswith(PARAM, k) or buf.startswith(INVOKE_END, k):  # (a)
            self._take(k - i)
            self._end_value()
            return True
        rest = buf[k:k + len(PARAM)]
        if len(rest) == len(buf) - k and (PARAM.startswith(rest) or INVOKE_END.startswith(rest)):
            return False  # the follower is still undecided (P22)
        self._value_text(self._take(k - i))  # a literal </parameter> inside the value
        return True

    def _end_value(self) -> None:
        param = self._param
        self._param = None
        self._state = _State.INVOKE_BODY
        if param.skip:
            return
        value = coerce_value("".join(param.parts), param.schema)  # P14-P16
        self._call.args[param.key] = value
        self._emit_args('"' if param.streaming else json.dumps(value, ensure_ascii=False))

    def _close_invoke(self) -> None:
        call = self._call
        if call is None:
            self.rejected_tool_calls += 1  # P13
        else:
            self._emit_args("}" if self._num_params else "{}")
            arguments = json.dumps(call.args, ensure_ascii=False)  # P17
            self.tool_calls.append(ToolCall(call.index, call.id, call.name, arguments))
        self._call = None
        self._raw = None
        if self._in_block:
            self._state = _State.BLOCK
            self._block_committed = True
            self._release_block_text()
        else:
            self._state = _State.CONTENT

    def _finish_state(self) -> None:
        """After the final run: P18 rollback of an incomplete invoke or call-less unclosed block."""
        state = self._state
        if state is _State.REASONING:
            self._reasoning_newlines = ""  # P6
        elif state is _State.BLOCK and self._block_committed:
            self._run_ws = ""
        elif state is not _State.CONTENT and state is not _State.PLAIN:
            self._emit_content("".join(self._raw or ()) + self._buf[self._pos:])
            self._raw = None
            self._call = self._param = None
            self._state = _State.CONTENT


def parse_output(text: str, tools: Sequence[Mapping[str, Any]] | None = None, mode: Mode = "split",
                 prompt_tail: str = "") -> ParsedOutput:
    """Non-streaming parse of a whole generation with the same machine (docs/parsers.md §3).

    Returns reasoning / content (None when empty) and the closed, declared tool calls with their
    P17 arguments strings. Raises ValueError only for an unknown ``mode``.
    """
    parser = StreamingParser(tools, mode, prompt_tail)
    first = parser.feed(text)
    last = parser.finish()
    reasoning = first.reasoning + last.reasoning
    content = first.content + last.content
    return ParsedOutput(reasoning or None, content or None, list(parser.tool_calls),
                        parser.rejected_tool_calls, parser.parser_error)
