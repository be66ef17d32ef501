"""Start-up probe: can the tool parser read the tool calls the chat template writes?

A ``--chat-template`` asking the model for another tool-call format (MiniMax-M1's
``<tool_calls>`` JSON, say) with the ``minimax_m2`` parser serves every call as plain content with
``finish_reason: stop``, silently. :func:`probe_tool_format` renders a conversation holding one
assistant tool call through the template and parses the assistant turn back with the parser of
docs/parsers.md §3; :func:`check_tool_format` turns the verdict into a warning, or an
error under ``--strict-tool-format``. Skipped with ``--tool-parser none``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal

from m2serve.text.parser import parse_output
from m2serve.text.template import ChatTemplate, TemplateError

log = logging.getLogger(__name__)

_MARK = "m2serve tool-format probe"
_NAME = "m2serve_probe_weather"
_ARGS = {"city": "Paris", "days": 3}
_TOOLS = [{"type": "function", "function": {
    "name": _NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}]
_MESSAGES = [
    {"role": "user", "content": _MARK},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function",
         "function": {"name": _NAME, "arguments": json.dumps(_ARGS)}}]},
]

Status = Literal["ok", "mismatch", "no_tool_call", "render_error"]


@dataclass(frozen=True, slots=True)
class ToolFormatVerdict:
    """The probe's result. ``status``: ``ok`` (the parser reads the call back, same name and
    arguments), ``mismatch`` (the template writes the call in a form the parser does not read),
    ``no_tool_call`` (the template renders no tool call at all) or ``render_error`` (the template
    raised on the probe). ``rendered``: the assistant turn as the template wrote it (for the message)."""

    status: Status
    rendered: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def probe_tool_format(template: ChatTemplate) -> ToolFormatVerdict:
    """Render a user turn and an assistant turn calling one declared tool
    (``{"city": "Paris", "days": 3}``), cut the text after the user turn and parse it as model
    output (start in CONTENT, the probe's tools declared). Pure: no logging, no I/O."""
    try:
        text = template.render(_MESSAGES, _TOOLS, add_generation_prompt=False)
    except TemplateError as exc:
        return ToolFormatVerdict("render_error", "", str(exc))
    turn = text[text.rfind(_MARK) + len(_MARK):] if _MARK in text else text
    if _NAME not in turn:
        return ToolFormatVerdict("no_tool_call", turn, "the template wrote no tool call for an "
                                 "assistant message with tool_calls")
    parsed = parse_output(turn, _TOOLS)
    calls = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    if calls != [(_NAME, _ARGS)]:
        return ToolFormatVerdict("mismatch", turn, f"the parser read {calls or 'no tool call'}, "
                                 f"expected [({_NAME!r}, {_ARGS})]")
    return ToolFormatVerdict("ok", turn)


def check_tool_format(template: ChatTemplate, tool_parser: str,
                      strict: bool = False) -> ToolFormatVerdict | None:
    """Run the probe unless ``tool_parser`` is ``"none"`` (returns None then). A failed probe logs
    one loud warning naming the template, what it rendered and the fix; with ``strict``
    (``--strict-tool-format``) it raises ValueError with the same text instead."""
    if tool_parser == "none":
        return None
    verdict = probe_tool_format(template)
    if verdict.ok:
        return verdict
    message = (f"chat template {template.origin} and --tool-parser {tool_parser} disagree "
               f"({verdict.status}): {verdict.detail}. The template renders an assistant tool call as "
               f"{verdict.rendered.strip()[:300]!r}; the {tool_parser} parser reads "
               "<minimax:tool_call><invoke name=...><parameter name=...>...</parameter></invoke>"
               "</minimax:tool_call>, so such calls would come back as plain content with "
               "finish_reason 'stop'. Use the checkpoint's own template, or --tool-parser none to "
               "return tool calls as text")
    if strict:
        raise ValueError(message + " (refused: --strict-tool-format)")
    log.warning("%s (pass --strict-tool-format to refuse to start)", message)
    return verdict
