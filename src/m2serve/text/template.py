"""Chat-template rendering in a transformers-compatible jinja2 sandbox (docs/parsers.md §2).

The checkpoint's own template is rendered (``chat_template.jinja``, else ``tokenizer_config.json``
``chat_template``); the format is never hard-coded here. Messages are normalised first (docs/parsers.md §2
"Message normalisation"): tool-call arguments given as JSON strings are parsed, each tool call gets
top-level ``name``/``arguments`` copies, reasoning aliases become ``reasoning_content``, null or
missing content becomes ``""`` (never the text ``None``), text-part lists are joined — except a tool
message's list when the template iterates over message content itself (the official template
renders one ``<response>`` per item), decided per template as vLLM does. Every error a request
can cause is a :class:`TemplateError` naming the message index where known; the server answers
it with 400.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from m2serve.text.tokenizer import token_text

# Variables render() sets itself; chat_template_kwargs may not replace them (serve/ imports this).
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                               "unk_token")
_REASONING_ALIASES = ("reasoning", "thinking")
# Stands in for the content of a message to be continued while its place in the rendering is found
# (ChatTemplate._continued): letters only, which no template strips or escapes.
_CONTINUE_MARK = "M2SERVEcontinueHEREq7Zx"


class TemplateError(ValueError):
    """A request the chat template cannot render (bad messages, ``raise_exception``, sandbox denial).

    ``message_index`` is the index in ``messages`` of the offending message, or None if unknown.
    """

    def __init__(self, message: str, message_index: int | None = None) -> None:
        super().__init__(message)
        self.message_index = message_index


class _RaisedByTemplate(Exception):
    """raise_exception(msg) called by the template."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: json.dumps with ensure_ascii=False by default, not HTML-escaped."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox of docs/parsers.md §2: trim_blocks, lstrip_blocks, loopcontrols, tojson, raise_exception,
    strftime_now (``namespace`` is a jinja2 built-in). Python internals are denied by the sandbox."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may use.

    ``render(messages, tools=None, add_generation_prompt=True, **chat_template_kwargs) -> str``.
    """

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 unk_token: str | None = None, origin: str = "<string>") -> None:
        env = make_environment()
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{origin}: chat template syntax error at line {exc.lineno}: "
                             f"{exc.message}") from exc
        self.iterates_content = iterates_over_content(env.parse(source))
        self.source = source
        self.origin = origin
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTemplate:
        """Load ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``.

        Raises FileNotFoundError when the checkpoint has neither (a startup error), ValueError for
        an unreadable ``tokenizer_config.json`` or a template syntax error.
        """
        d = Path(path)
        config_file = d / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"{config_file}: cannot read JSON ({exc})") from exc
        tokens = {k: token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token")}
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), origin=str(jinja_file), **tokens)
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            raise FileNotFoundError(f"{d}: no chat template (neither chat_template.jinja nor a "
                                    f"'chat_template' in tokenizer_config.json); pass one explicitly")
        return cls(source, origin=f"{config_file}:chat_template", **tokens)

    @classmethod
    def from_file(cls, path: str | Path, bos_token: str | None = None, eos_token: str | None = None,
                  unk_token: str | None = None) -> ChatTemplate:
        """Load a template file given by the user (overrides the checkpoint's)."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"chat template file {p} not found")
        return cls(p.read_text(encoding="utf-8"), bos_token, eos_token, unk_token, origin=str(p))

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               **chat_template_kwargs: Any) -> str:
        """Render a conversation to the prompt text (before tokenisation).

        messages: OpenAI-style dicts; tools: OpenAI tool dicts or None; chat_template_kwargs become
        template variables (they may not replace the reserved ones); continue_final_message: the last
        message is the assistant's, and the prompt ends right after its content, so that the reply
        continues it (vLLM's ``continue_final_message``, Anthropic's prefilled assistant turn;
        docs/parsers.md §2, "Continuing the final message"); ``add_generation_prompt`` is then
        ignored. Raises TemplateError.
        """
        bad = sorted(set(chat_template_kwargs) & set(RESERVED_TEMPLATE_VARIABLES))
        if bad:
            raise TemplateError(f"chat_template_kwargs may not set {', '.join(bad)} "
                                "(reserved template variables)")
        msgs = normalize_messages(messages, keep_tool_lists=self.iterates_content)
        tool_list = _normalize_tools(tools)
        variables = {**self.tokens, **chat_template_kwargs, "tools": tool_list}
        try:
            if continue_final_message:
                return self._continued(msgs, variables)
            return self._render(msgs, add_generation_prompt, variables)
        except TemplateError as exc:
            if exc.message_index is None:  # find the first message that makes the template fail
                exc.message_index = self._failing_index(msgs, variables)
                if exc.message_index is not None:
                    exc.args = (f"messages[{exc.message_index}]: {exc.args[0]}",)
            raise

    def _render(self, msgs: list[dict[str, Any]], generation_prompt: bool, variables: dict[str, Any]) -> str:
        try:
            return self._template.render(messages=msgs, add_generation_prompt=generation_prompt, **variables)
        except _RaisedByTemplate as exc:
            raise TemplateError(f"chat template: {exc}") from None
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"chat template denied by the sandbox: {exc}") from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template error: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TemplateError(f"chat template error: {type(exc).__name__}: {exc}") from None

    def _continued(self, msgs: list[dict[str, Any]], variables: dict[str, Any]) -> str:
        """The conversation rendered without a generation prompt and cut right after the final
        assistant message's content as the template writes it. Where that content ends is found by
        rendering once more with the content replaced by a marker: the text before the marker and the
        text after it must frame the real rendering (so an empty content, or one repeated earlier in
        the conversation, is placed right); the prompt is the real rendering less that suffix. A
        template that transforms the marker too (upper-cases the content) cannot be continued: a
        TemplateError naming the message."""
        n = len(msgs)
        last = msgs[-1] if msgs else {}
        if last.get("role") != "assistant":
            raise TemplateError(f"messages[{n - 1}]: only an assistant message can be continued "
                                f"(continue_final_message, or a prefilled assistant turn); this one is "
                                f"{last.get('role')!r}", n - 1)
        if last.get("tool_calls"):
            raise TemplateError(f"messages[{n - 1}]: an assistant message to be continued holds text only; "
                                "this one has tool calls", n - 1)
        real = self._render(msgs, False, variables)
        marked = self._render([*msgs[:-1], {**last, "content": _CONTINUE_MARK}], False, variables)
        at = marked.rfind(_CONTINUE_MARK)
        prefix, suffix = marked[:max(at, 0)], marked[at + len(_CONTINUE_MARK):]
        if at < 0 or len(real) < len(prefix) + len(suffix) or not (real.startswith(prefix)
                                                                     and real.endswith(suffix)):
            raise TemplateError(f"messages[{n - 1}]: the chat template does not write this assistant "
                                "message's content where a continuation could start", n - 1)
        return real[:len(real) - len(suffix)]

    def _failing_index(self, msgs: list[dict[str, Any]], variables: dict[str, Any]) -> int | None:
        """Index of the first message whose prefix fails to render (error path only), or None if the
        whole conversation renders without the generation prompt. Binary search over prefix lengths
        (a template that fails on a prefix fails on every longer one): O(log n) renders, so a long
        bad history cannot make the error path quadratic."""

        def fails(k: int) -> bool:
            try:
                self._render(msgs[:k], False, variables)
            except TemplateError:
                return True
            return False

        lo, hi = 1, len(msgs)
        if hi == 0 or not fails(hi):
            return None
        while lo < hi:  # invariant: prefix hi fails; every prefix shorter than lo renders
            mid = (lo + hi) // 2
            if fails(mid):
                hi = mid
            else:
                lo = mid + 1
        return hi - 1


def iterates_over_content(ast: nodes.Template) -> bool:
    """True when the template has a ``for`` loop directly over a message's content
    (``for x in message.content`` / ``message['content']``), as the official MiniMax-M2 template
    does for tool results: such a template is given a tool message's text-part list as a list.
    vLLM makes the same per-template decision (its "openai" vs "string" content format)."""
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return True
    return False


def normalize_messages(messages: Sequence[Mapping[str, Any]],
                       keep_tool_lists: bool = False) -> list[dict[str, Any]]:
    """Spec §2 message normalisation; returns new dicts (the input is not modified).

    Content that is null or missing becomes ``""``, as vLLM gives it to a string-content template
    (a template printing ``{{ content }}`` would otherwise write ``None``). Text-part lists are
    joined into one string, except a tool message's list when ``keep_tool_lists`` (the template
    iterates over content, :func:`iterates_over_content`): it stays a list of its (validated) parts.

    Raises TemplateError naming ``messages[i]...`` for: a message that is not an object or has no
    string ``role``; non-text content parts; tool-call ``arguments`` that are not a JSON object.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise TemplateError("messages must be a list of message objects")
    out = []
    for i, raw in enumerate(messages):
        if not isinstance(raw, Mapping):
            raise TemplateError(f"messages[{i}] must be an object, got {type(raw).__name__}", i)
        m = copy.deepcopy(dict(raw))
        if not isinstance(m.get("role"), str):
            raise TemplateError(f"messages[{i}].role must be a string", i)
        content = m.get("content")
        if keep_tool_lists and m["role"] == "tool" and isinstance(content, list):
            _join_text(content, i)  # validates: text parts only
            m["content"] = list(content)
        else:
            m["content"] = _join_text(content, i)
        if m["role"] == "assistant":
            _normalize_assistant(m, i)
        out.append(m)
    return out


def _join_text(content: Any, i: int) -> str:
    """Text-part lists joined into one string; None (null or missing) becomes ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise TemplateError(f"messages[{i}].content must be a string, null or a list of text parts", i)
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, Mapping) and part.get("type") == "text":
            raise TemplateError(f"messages[{i}].content[{j}].text must be a string, got "
                                f"{type(part.get('text')).__name__}", i)
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"messages[{i}].content[{j}]: part type {kind!r} is not supported; "
                                f"this model takes text parts only", i)
    return "".join(texts)


def _normalize_assistant(m: dict[str, Any], i: int) -> None:
    if m.get("reasoning_content") is None:
        for alias in _REASONING_ALIASES:
            if isinstance(m.get(alias), str):
                m["reasoning_content"] = m[alias]
                break
    content = m.get("content")
    if isinstance(m.get("reasoning_content"), str) and isinstance(content, str):
        start = content.find("<think>")
        end = content.find("</think>", start + 1) if start >= 0 else -1
        if end >= 0:  # a passthrough client echoed both: drop the inline block
            m["content"] = content[:start] + content[end + len("</think>"):]
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise TemplateError(f"messages[{i}].tool_calls must be a list", i)
    m["tool_calls"] = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise TemplateError(f"{where} must be an object", i)
        call = dict(call)
        m["tool_calls"].append(call)
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
        name, args = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str):
            raise TemplateError(f"{where}.function.name must be a string", i)
        if args is None:
            args = {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise TemplateError(f"{where}.function.arguments is not valid JSON ({exc})", i) from None
        if not isinstance(args, Mapping):
            raise TemplateError(f"{where}.function.arguments must be a JSON object, "
                                f"got {type(args).__name__}", i)
        args = dict(args)
        if isinstance(call.get("function"), Mapping):
            call["function"] = {**call["function"], "arguments": args}
        call["name"], call["arguments"] = name, args


def _normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise TemplateError("tools must be a list of tool objects")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TemplateError(f"tools[{k}] must be an object")
        out.append(copy.deepcopy(dict(tool)))
    return out


