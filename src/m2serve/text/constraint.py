"""Constrained decoding for MiniMax-M2 output: grammars compiled with llguidance, one matcher per choice.

A request that must produce structure (``tool_choice`` required / named / none, ``response_format``,
vLLM ``structured_outputs``) gets a ``GrammarConstraint``. The engine asks it for an allowed-token
bitmask before sampling (``fill_bitmask``) and tells it each sampled token (``accept_token``); the
engine's ``TokenConstraint`` protocol is satisfied by duck typing (text/ may not import engine/).

Output shape (docs/parsers.md §2-§3), S = the body below:

- reasoning ``inside`` (the prompt ends with ``<think>``, P1): ``REASONING </think> \\n\\n S``;
- reasoning ``may_open`` (chat prompt not ending in ``<think>``, P2):
  ``(<think> REASONING </think> \\n\\n)? S``;
- reasoning ``off`` (raw completions): ``S``.

REASONING is free text up to the ``</think>`` token; it may not spell ``</think>`` or
``<minimax:tool_call>`` with ordinary tokens, and no special token but ``</think>`` ends it. A reasoning
budget forces ``</think>`` after that many reasoning tokens (as soon as the text is valid UTF-8).

Bodies (``ConstraintSpec`` builders):

- ``tool_calls_spec`` (``tool_choice`` required / named): one ``<minimax:tool_call>\\n`` block (the
  template writes all calls in one; the parser would also read several) holding 1 to ``max_tool_calls``
  invokes ``<invoke name="NAME">\\n`` + parameters + ``</invoke>\\n``, then ``</minimax:tool_call>`` and
  end of turn. The cap: 1 with ``parallel_tool_calls`` false, else the request's ``max_tool_calls``,
  else 1 for a named tool and the number of declared tools for ``required`` (a forced turn must end).
  Parameters come in the order of ``properties``, every ``required`` one present, no undeclared name,
  each ``<parameter name="KEY">VALUE</parameter>\\n``. VALUE follows the parameter's JSON Schema as the
  parser reads it (§3.4): a parameter whose allowed types (P14) are ``{string}`` or ``{string, null}``
  is raw text (``minLength`` / ``maxLength`` / ``enum`` / ``const`` / ``pattern`` enforced; no leading
  or trailing newline, which P15 would strip; never ``</parameter>``, ``<parameter name=`` or
  ``</invoke>``, which end a value, P10); any other parameter is compact JSON (``json.dumps``
  separators) matching its schema.
- ``no_tool_call_spec`` (``tool_choice`` none): any text that contains no tool-call syntax under any
  tokenisation: the tag token, and ``minimax:tool_call``, ``<invoke``, ``</invoke``, ``<parameter``,
  ``</parameter`` spelt by ordinary tokens, are all excluded.
- ``json_spec`` (``response_format`` json_object / json_schema, ``structured_outputs.json``): compact JSON
  matching the schema (json_object: any object).
- ``regex_spec`` / ``choice_spec`` / ``lark_spec``: vLLM ``structured_outputs`` regex / choice / grammar.
- ``free_spec``: any tokens (a reasoning budget on an otherwise unconstrained request).

Supported JSON Schema subset: what llguidance compiles in strict mode (``lenient`` false), see
docs/constrained-decoding.md: ``type`` (and lists), ``enum``, ``const``, ``properties``, ``required``,
``additionalProperties``, ``items``, ``prefixItems``, ``minItems`` / ``maxItems``, ``minLength`` /
``maxLength``, ``pattern``, ``format`` (llguidance's list), ``minimum`` / ``maximum`` / ``exclusive*``,
``multipleOf``, ``anyOf`` / ``oneOf`` (as anyOf) / ``allOf``, ``$ref`` / ``$defs``. Anything else,
an invalid schema or a bad regex raises ValueError naming the request field and llguidance's message.
Raw-string tool parameters additionally reject ``format`` and types mixing string with anything but null.

End of turn: the tokenizer's stop ids (``Tokenizer.stop_token_ids``: generation_config eos + ``[e~[``)
are the grammar's EOS; they are allowed only where the grammar may end.
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import llguidance
import torch

from m2serve.config.engine_args import MAX_SPECULATIVE_TOKENS
from m2serve.text.schema import allowed_types, local_ref, resolve_refs
from m2serve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ReasoningStart = Literal["inside", "may_open", "off"]
_REASONING_STARTS = ("inside", "may_open", "off")

# JSON as the template writes it (tojson = json.dumps defaults), no free whitespace: a model trained on
# the template sees its own format, and random logits cannot loop on whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_TEXT = "/(?s:.*)/"
# Text a parameter value may never contain: each of these ends a value (P10), in a raw string as in a
# string or key inside a JSON value. Every one starts with "<" and holds no other "<" (the regex below
# relies on it).
_VALUE_END_TEXTS = ("</parameter>", "<parameter name=", "</invoke>")


def _rx_escape(text: str) -> str:
    """``text`` for a regex (Rust syntax, inside a Lark ``/.../`` or a JSON Schema ``pattern``, and in a
    character class): regex metacharacters, ``/`` and ``-`` backslashed; nothing else (Rust rejects
    ``\\`` before a space, which Python's ``re.escape`` writes)."""
    return "".join("\\" + ch if ch in "\\.^$*+?()[]{}|/-&~#" else ch for ch in text)


_VALUE_ENDS = "/(?s:.*)(" + "|".join(_rx_escape(t) for t in _VALUE_END_TEXTS) + ")(?s:.*)/"


def _without_regex(texts: Sequence[str]) -> str:
    """An anchored regex (JSON Schema ``pattern``, no lookaround) for the strings that contain none of
    ``texts``, each starting with ``<`` and holding no other ``<``. Such a string is a run of: a
    character other than ``<``; or ``<`` + a partial text (a proper prefix of a text's rest, as a nested
    optional group over the texts' trie) + a character that is neither ``<`` nor extends it; and it may
    end in ``<`` + partial-text runs. A character that breaks a partial match can begin no other match
    except a ``<`` (nothing else starts a text), so no state is lost."""
    rests = [t[1:] for t in texts]
    assert all(t.startswith("<") and "<" not in r for t, r in zip(texts, rests)), texts

    def kids(p: str) -> list[str]:
        return sorted({r[len(p)] for r in rests if r.startswith(p) and len(r) > len(p)})

    def inner(p: str) -> list[str]:  # the children that do not complete a text
        return [c for c in kids(p) if p + c not in rests]

    def partial(p: str) -> str:  # what may follow prefix p and still be a proper prefix (or nothing)
        alts = [_rx_escape(c) + partial(p + c) for c in inner(p)]
        return "(?:" + "|".join(alts) + ")?" if alts else ""

    def broken(p: str) -> str:  # what may follow prefix p up to and including the character that breaks it
        alts = ["[^<" + "".join(_rx_escape(c) for c in kids(p)) + "]"]
        alts += [_rx_escape(c) + broken(p + c) for c in inner(p)]
        return "(?:" + "|".join(alts) + ")"

    c, b = "<" + partial(""), "<" + broken("")
    return f"^(?:[^<]|(?:{c})*{b})*(?:{c})*$"


# Any JSON value whose strings and object keys contain no value end, at every depth (a string matches
# the pattern, an object's keys match it and its values are such values, so are an array's items).
# A JSON-valued parameter's schema is intersected with it (_json_value), so a forced call cannot close
# a parameter inside a JSON string (P10: "</invoke>" there ended the call and broke its value).
_SAFE_NAME = "m2serve_no_value_end"
_NO_VALUE_END = _without_regex(_VALUE_END_TEXTS)
_SAFE_VALUE = {"pattern": _NO_VALUE_END, "additionalProperties": False,
               "patternProperties": {_NO_VALUE_END: {"$ref": f"#/$defs/{_SAFE_NAME}"}},
               "items": {"$ref": f"#/$defs/{_SAFE_NAME}"}}
# Errors without the internal grammar text (which would name our rules, not the request's fields).
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_STRING_KEYWORDS = {"type", "minLength", "maxLength", "enum", "const", "pattern",
                    "description", "title", "default", "examples", "$comment", "deprecated", "readOnly",
                    "writeOnly", "format", "contentEncoding", "contentMediaType"}  # from "description"
# on: annotations, not enforced on a raw value (JSON Schema 2020-12 treats "format" as an annotation
# unless a validator opts in; Claude Code's WebFetch declares {"type": "string", "format": "uri"})

#: Text ``tool_choice`` none forbids in the answer (``no_tool_call_spec``): the pieces of MiniMax's
#: tool-call syntax (docs/parsers.md §3), so no call leaks as text under any tokenisation.
NO_TOOL_CALL_TEXT = ("minimax:tool_call", "<invoke", "</invoke", "<parameter", "</parameter")

#: Grammar cost limits (docs/constrained-decoding.md, "Limits"): a ``choice`` list or a JSON Schema
#: ``enum`` holds at most MAX_GRAMMAR_CHOICES strings, and a grammar's text (the Lark the request's
#: schema, regex, grammar, choices or tools become) is at most MAX_GRAMMAR_BYTES; beyond them the
#: request is refused before llguidance compiles anything (100,000 choices cost tens of seconds of
#: CPU and ended in a Rust panic). GRAMMAR_CACHE_BYTES bounds the compiled-grammar cache by the bytes of
#: grammar text it holds, next to its entry count (``GrammarCompiler.max_cached``).
MAX_GRAMMAR_CHOICES = 1024
MAX_GRAMMAR_BYTES = 256 * 1024
GRAMMAR_CACHE_BYTES = 16 * 2**20

#: Bits per int32 word of llguidance's token bitmask (the engine's TokenConstraint layout,
#: engine/constraint.py BITMASK_WORD_BITS; text/ cannot import engine/).
_WORD_BITS = 32


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """What a request constrains, before compilation. ``key`` identifies it in the grammar cache;
    ``field`` is the request field named in errors; ``body`` is the Lark text of the body rule ``body``
    (plus helper rules); ``subgrammars`` are (name, Lark text) referenced as ``@name``; ``parts`` are
    (field, standalone Lark grammar) checked one by one when the whole does not compile, so the error
    names the part at fault (the tool); ``free_answer``: only the reasoning is constrained, the matcher
    is not consulted once the answer starts (``free_spec``); ``exempt_bytes``: bytes of text m2serve
    added on its own account (the value-end exclusion of forced calls), not counted against
    MAX_GRAMMAR_BYTES; ``fallback``: the spec compiled instead when this one does not compile (the
    same calls without that exclusion)."""

    key: str
    field: str
    body: str
    subgrammars: tuple[tuple[str, str], ...] = ()
    parts: tuple[tuple[str, str], ...] = ()
    free_answer: bool = False
    exempt_bytes: int = 0
    fallback: ConstraintSpec | None = None


def _lark_str(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    """``text`` as a Lark /regex/ matching it literally."""
    out = []
    for ch in text:
        if ch.isalnum() or ch in " _-,:;=@'\"<>%&!~`#":
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        else:
            out.append(f"\\u{{{ord(ch):x}}}" if ord(ch) > 0x7F else f"\\x{ord(ch):02x}")
    return "/" + "".join(out) + "/"


def _with_defs(schema: Mapping[str, Any], root: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with the definitions of the tool's ``root`` schema its local references may name:
    ``$defs`` / ``definitions`` of both, the schema's own winning a name both define."""
    doc = dict(schema)
    for key in ("$defs", "definitions"):
        found = {**(_mapping(root.get(key))), **(_mapping(schema.get(key)))}
        if found:
            doc[key] = found
    return doc


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _json_schema(schema: Mapping[str, Any]) -> str:
    """``%json`` text for ``schema`` with the template's JSON style."""
    doc = dict(schema)
    doc["x-guidance"] = {**_JSON_OPTIONS, **(doc.get("x-guidance") or {})}
    return "%json " + json.dumps(doc, ensure_ascii=False)


def _intersectable(schema: Mapping[str, Any], root: Mapping[str, Any]) -> bool:
    """False for the schemas llguidance cannot intersect with _SAFE_VALUE, found without compiling:
    ``patternProperties`` anywhere in the schema or the definitions it reaches, or a cycle of local
    references (a recursive schema exceeds llguidance's intersection depth). Walked without recursion."""
    state: dict[tuple[str, str], int] = {}  # definition -> 1 on the current path, 2 done

    def refs_and_flags(node: Any) -> tuple[list[tuple[str, str]], bool]:
        refs, pattern_props, todo = [], False, [node]
        while todo:
            item = todo.pop()
            if isinstance(item, Mapping):
                pattern_props |= "patternProperties" in item
                where = local_ref(item.get("$ref"))
                if where is not None or item.get("$ref") == "#":
                    refs.append(where or ("", "#"))
                todo += [v for k, v in item.items() if k not in ("$defs", "definitions")]
            elif isinstance(item, list):
                todo += item
        return refs, pattern_props

    refs, bad = refs_and_flags(schema)
    stack: list[tuple[Any, Any]] = [(None, iter(refs))]  # depth-first: (definition, references left)
    while stack and not bad:
        node, left = stack[-1]
        nxt = next(left, None)
        if nxt is None:
            if node is not None:
                state[node] = 2
            stack.pop()
            continue
        if nxt[1] == "#" or state.get(nxt) == 1:
            return False  # the root itself, or a definition on the current path: recursive
        if state.get(nxt) == 2:
            continue
        state[nxt] = 1
        defs = root.get(nxt[0]) if isinstance(root.get(nxt[0]), Mapping) else {}
        inner, flag = refs_and_flags(defs.get(nxt[1], {}))
        bad |= flag
        stack.append((nxt, iter(inner)))
    return not bad


def _json_value(schema: Mapping[str, Any], root: Mapping[str, Any], exclude: bool) -> tuple[str, int]:
    """``%json`` text for a JSON-valued tool parameter, and the bytes the exclusion added: ``schema``
    (with the tool's ``$defs`` / ``definitions`` from ``root``), with ``exclude`` intersected with
    _SAFE_VALUE so that no string or key inside it holds a value end (P10). A parameter that can hold
    no string (integer, number, boolean, null) needs no exclusion."""
    full = _with_defs(schema, root)
    plain = _json_schema(full)
    if not exclude or not allowed_types(schema) & {"object", "array", "string"}:
        return plain, 0
    if not _intersectable(schema, full):  # this parameter as written; the others keep the exclusion
        log.info("a tool parameter schema kept without the value-end exclusion (recursive, or with "
                 "patternProperties: llguidance cannot intersect it)")
        return plain, 0
    inner = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    doc = {k: v for k, v in full.items() if k in ("$defs", "definitions")}
    doc["$defs"] = {**doc.get("$defs", {}), _SAFE_NAME: _SAFE_VALUE}
    doc["allOf"] = [inner, {"$ref": f"#/$defs/{_SAFE_NAME}"}]
    text = _json_schema(doc)
    return text, max(len(text.encode()) - len(plain.encode()), 0)


def json_spec(schema: Mapping[str, Any] | None, field: str = "response_format") -> ConstraintSpec:
    """Body = one JSON value matching ``schema`` (None: json_object, any JSON object)."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, Mapping):
        raise ValueError(f"{field}: the JSON schema must be an object, got {type(schema).__name__}")
    _check_enums(schema, field)
    text = json.dumps(schema, ensure_ascii=False)  # key order kept: it is the generation order
    return ConstraintSpec(f"json:{text}", field, f"body: {_json_schema(schema)}\n")


def _check_enums(schema: Any, field: str) -> None:
    """ValueError naming ``field`` when an ``enum`` anywhere in ``schema`` (walked without recursion)
    lists more than MAX_GRAMMAR_CHOICES values."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, Mapping):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_GRAMMAR_CHOICES:
                raise ValueError(f"{field}: an enum of {len(enum)} values, more than the limit of "
                                 f"{MAX_GRAMMAR_CHOICES}")
            todo += list(node.values())
        elif isinstance(node, list):
            todo += node


def spec_bytes(spec: ConstraintSpec) -> int:
    """UTF-8 bytes of a spec's grammar text (body and sub-grammars): what MAX_GRAMMAR_BYTES and the
    cache's GRAMMAR_CACHE_BYTES count."""
    return len(spec.body.encode()) + sum(len(g.encode()) for _, g in spec.subgrammars)


def regex_spec(pattern: str, field: str = "structured_outputs.regex") -> ConstraintSpec:
    """Body = text fully matching ``pattern`` (Rust regex syntax; ``\\d``/``\\w``/``\\s`` ASCII)."""
    if not isinstance(pattern, str):
        raise ValueError(f"{field}: expected a regex string, got {type(pattern).__name__}")
    if len(pattern.encode()) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{field}: the pattern is {len(pattern.encode())} bytes, more than the limit of "
                         f"{MAX_GRAMMAR_BYTES} bytes")
    try:
        lark = llguidance.regex_to_lark(pattern, "dws")
    except (ValueError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a Rust panic (pyo3's PanicException) or alike
        log.error("llguidance failed converting %s (%s)", field, type(e).__name__)
        raise ValueError(f"{field}: {_clean_error('panicked')}") from None
    return ConstraintSpec(f"regex:{pattern}", field, f"body: BODY_RE\nBODY_RE: /{lark}/\n")


def choice_spec(choices: Sequence[str], field: str = "structured_outputs.choice") -> ConstraintSpec:
    """Body = exactly one of ``choices``."""
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{field}: expected a non-empty list of strings")
    if len(choices) > MAX_GRAMMAR_CHOICES:
        raise ValueError(f"{field}: {len(choices)} choices, more than the limit of {MAX_GRAMMAR_CHOICES}")
    alts = " | ".join(_lark_str(c) for c in choices)
    return ConstraintSpec("choice:" + json.dumps(list(choices)), field, f"body: {alts}\n")


def lark_spec(grammar: str, field: str = "structured_outputs.grammar") -> ConstraintSpec:
    """Body = a sentence of the user's Lark grammar (llguidance dialect, rule ``start``)."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError(f"{field}: expected a non-empty Lark grammar string")
    if re.search(r"^\s*[\w-]+\s*::=", grammar, re.M):
        raise ValueError(f"{field}: this looks like GBNF / EBNF (`rule ::= ...`); write it in Lark syntax "
                         "(`rule: ...`, the start rule named `start`; docs/constrained-decoding.md)")
    return ConstraintSpec(f"lark:{grammar}", field, "body: @user\n", (("user", grammar),))


def no_tool_call_spec() -> ConstraintSpec:
    """Body = any text without the tool-call syntax: no ``<minimax:tool_call>`` (its token is excluded
    with every special token, since text terminals never match special tokens) and none of
    ``NO_TOOL_CALL_TEXT`` spelt with ordinary tokens. Forbidding the tag alone was not enough: a model
    that wants to call a tool then writes the call's body as text (``>\n<invoke name="get_weather">``)."""
    banned = "|".join(_rx_escape(t) for t in NO_TOOL_CALL_TEXT)
    return ConstraintSpec("none", "tool_choice",
                          f"body: FREE_TEXT\nFREE_TEXT: {_ANY_TEXT} & ~/(?s:.*)({banned})(?s:.*)/\n")


def free_spec() -> ConstraintSpec:
    """No structure after the reasoning (a reasoning budget alone: only the reasoning is bounded; the
    answer, from the first token after ``</think>``, is not masked at all)."""
    return ConstraintSpec("free", "thinking.budget_tokens", "body: <[ANY]>*\n", free_answer=True)


def _function(tool: Any, index: int) -> tuple[str, Mapping[str, Any]]:
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tools[{index}]: a function tool needs a non-empty function.name")
    if ">" in name:
        raise ValueError(f"tools[{index}]: function name {name!r} contains '>', which the MiniMax tool-call "
                         "format cannot express (docs/parsers.md §3.7)")
    params = fn.get("parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"tool {name!r}: function.parameters must be a JSON Schema object")
    return name, params


def _string_branch(schema: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The sub-schema whose string constraints a raw-string value obeys (the top level, or the one
    anyOf/oneOf branch that allows string)."""
    for combo in ("anyOf", "oneOf"):
        branches = schema.get(combo)
        if isinstance(branches, list):
            strings = [b for b in branches if isinstance(b, Mapping) and "string" in allowed_types(b)]
            if len(strings) != 1:
                raise ValueError(f"{where}: {combo} with {len(strings)} string branches is not supported for "
                                 "a raw-string parameter; use one string branch")
            return strings[0]
    return schema


def _raw_string_terminal(schema: Mapping[str, Any], where: str) -> str:
    """Lark terminal body for a raw-string parameter value (P15: strings are written raw)."""
    branch = _string_branch(schema, where)
    unsupported = sorted(set(branch) - _STRING_KEYWORDS)
    if unsupported:
        raise ValueError(f"{where}: keyword(s) {unsupported} are not supported on a raw-string tool "
                         "parameter; supported: minLength, maxLength, enum, const, pattern (format and "
                         "other annotations are accepted, not enforced)")
    parts = []
    values = ([branch["const"]] if "const" in branch else branch.get("enum"))
    if values is not None:
        strings = [v for v in values if isinstance(v, str)]
        if not strings:
            raise ValueError(f"{where}: enum/const has no string value")
        parts.append("(" + " | ".join(_regex_literal(v) for v in strings) + ")")
    lo, hi = branch.get("minLength", 0), branch.get("maxLength")
    for name, bound in (("minLength", lo), ("maxLength", hi)):
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
            raise ValueError(f"{where}: {name}={bound!r} must be a non-negative integer")
    if lo or hi is not None:
        parts.append(f"/(?s:.){{{lo},{'' if hi is None else hi}}}/")
    if "pattern" in branch:
        pattern = branch["pattern"]
        if not isinstance(pattern, str):
            raise ValueError(f"{where}: pattern must be a string")
        start, end = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
        core = pattern[1 if start else 0: len(pattern) - 1 if end else len(pattern)]
        core = "(" + core + ")"  # JSON Schema patterns search; unanchored ends match anything
        regex = ("" if start else "(?s:.*)") + core + ("" if end else "(?s:.*)")
        parts.append("/" + llguidance.regex_to_lark(regex, "dw") + "/")
    if not parts:
        parts.append(_ANY_TEXT)
    parts += [f"~{_VALUE_ENDS}", r"~/\n(?s:.*)/", r"~/(?s:.*)\n/"]
    return " & ".join(parts)


def _invoke_rules(name: str, params: Mapping[str, Any], tag: str, exclude: bool = True
                  ) -> tuple[list[str], list[tuple[str, str]], int]:
    """Lark rules for one ``<invoke>`` of tool ``name`` (rule ``inv_{tag}``), a standalone grammar per
    parameter (field, Lark) to name the parameter at fault in errors, and the bytes the value-end
    exclusion added (``exclude``, :func:`_json_value`)."""
    props = params.get("properties") or {}
    if not isinstance(props, Mapping):
        raise ValueError(f"tool {name!r}: parameters.properties must be an object")
    required = params.get("required") or []
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ValueError(f"tool {name!r}: parameters.required must list declared properties, "
                         f"got {required!r}")
    rules, seq, parts, added = [], [], [], 0
    for j, (key, schema) in enumerate(props.items()):
        if ">" in key:
            raise ValueError(f"tool {name!r}: parameter name {key!r} contains '>', which the MiniMax "
                             "tool-call format cannot express (docs/parsers.md §3.7)")
        schema = resolve_refs(schema, params) if isinstance(schema, Mapping) else {}
        where = f"tool {name!r} parameter {key!r}"
        types = allowed_types(schema)
        head = _lark_str(f'<parameter name="{key}">')
        close = _lark_str("</parameter>\n")
        if "string" in types:
            if types - {"string", "null"}:
                raise ValueError(f"{where}: allowed types {sorted(types)} mix string with other types; "
                                 "the raw value would be re-typed by the parser (§3.4). Use one type, "
                                 "or string + null")
            # lazy (suffix): the value ends at the first </parameter>. A greedy lexeme would extend
            # over "</parameter" (a valid value prefix) and then refuse the ">", so a tokenizer that
            # spells the tag with ordinary tokens ("</", "parameter", ">") could never close the value.
            rules.append(f"p_{tag}_{j}: {head} v_{tag}_{j}")
            rules.append(f"v_{tag}_{j}[suffix={close}]: V_{tag}_{j}")
            rules.append(f"V_{tag}_{j}: {_raw_string_terminal(schema, where)}")
        else:
            value, extra = _json_value(schema, params, exclude)
            rules.append(f"p_{tag}_{j}: {head} {value} {close}")
            added += extra
        own = [r for r in rules if r.startswith((f"p_{tag}_{j}:", f"v_{tag}_{j}[", f"V_{tag}_{j}:"))]
        parts.append((where, f"start: p_{tag}_{j}\n" + "\n".join(own) + "\n"))
        seq.append(f"p_{tag}_{j}" + ("" if key in required else "?"))
    open_tag, close_tag = _lark_str(f'<invoke name="{name}">\n'), _lark_str("</invoke>\n")
    rules.insert(0, f"inv_{tag}: {open_tag} {' '.join(seq)} {close_tag}")
    return rules, parts, added


def max_tool_calls(n_tools: int, name: str | None = None, parallel_tool_calls: bool = True,
                   max_calls: int | None = None) -> int:
    """The most invokes a forced turn may hold (docs/constrained-decoding.md, "Tool-call cap"): 1 with
    ``parallel_tool_calls`` false; else ``max_calls`` when the request gives one (Responses
    ``max_tool_calls``); else 1 for a named tool (one call, as vLLM and SGLang force a named tool) and
    ``n_tools`` (one call per declared tool) for ``required``. The grammar, not the model, decides
    when a forced turn may end, so without a cap random or degenerate logits open invokes until
    ``max_tokens`` and the turn never finishes with its calls. Raises ValueError naming
    ``max_tool_calls`` for a ``max_calls`` that is not a positive integer."""
    if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(max_calls, int)
                                  or max_calls < 1):
        raise ValueError(f"max_tool_calls: {max_calls!r} must be a positive integer when a tool call "
                         "is forced")
    if not parallel_tool_calls:
        return 1
    if max_calls is not None:
        return max_calls
    return 1 if name is not None else n_tools


def tool_calls_spec(tools: Sequence[Any], name: str | None = None, parallel_tool_calls: bool = True,
                    max_calls: int | None = None) -> ConstraintSpec:
    """Body = one tool-call block of 1 to ``max_tool_calls(...)`` invokes of the declared tools
    (``name``: only that one), then end of turn.

    ``tools`` are the request's OpenAI tools (``{"type": "function", "function": {...}}`` or the bare
    function objects); ``max_calls`` is the request's own cap (Responses ``max_tool_calls``), if any.
    Raises ValueError naming the tool for an unsupported parameter schema, naming ``tool_choice`` for
    a ``name`` that is not declared, and naming ``max_tool_calls`` for a bad cap.
    """
    if not tools:
        raise ValueError("tool_choice: a required or named tool choice needs a non-empty tools list")
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    for i, (_, params) in enumerate(functions):
        _check_enums(params, f"tools[{i}]")
    cap = max_tool_calls(len(functions), name, parallel_tool_calls, max_calls)
    if name is not None:
        functions = [f for f in functions if f[0] == name]
        if not functions:
            raise ValueError(f"tool_choice: function {name!r} is not one of the request's tools")
        functions = functions[:1]
    key = json.dumps([name, cap, [[f, p] for f, p in functions]], ensure_ascii=False)
    field = "tool_choice" if name else "tools"
    invoke = " | ".join(f"inv_{i}" for i in range(len(functions)))
    head = f"body: \"\\n\"? <[TC]> \"\\n\" invoke{{1,{cap}}} <[TC_END]>\ninvoke: {invoke}\n"
    texts, plain_parts, added = [], [], 0
    for exclude in (False, True):
        rules = []
        for i, (fname, params) in enumerate(functions):
            tool_rules, param_parts, extra = _invoke_rules(fname, params, str(i), exclude)
            rules += tool_rules
            if exclude:
                added += extra
            else:
                plain_parts += param_parts   # errors name the request's own schema, not the exclusion
        texts.append(head + "\n".join(rules) + "\n")
    plain = ConstraintSpec(f"tools-plain:{key}", field, texts[0], parts=tuple(plain_parts))
    if not added:
        return replace(plain, key=f"tools:{key}")
    return ConstraintSpec(f"tools:{key}", field, texts[1], parts=tuple(plain_parts), exempt_bytes=added,
                          fallback=plain)


def _clean_error(message: str) -> str:
    """llguidance's message without its position in, and listing of, our generated Lark text, and
    never a Rust panic's text or backtrace (which name llguidance's source files, not the request):
    a panic becomes one line saying so. At most 500 characters."""
    if "panicked" in message or "backtrace" in message.lower():
        return "llguidance failed on this grammar (an internal error); simplify it"
    message = re.sub(r"^at \d+\(\d+\): ", "", message)
    lines = message.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*\d+ \| ", line):
            lines = lines[:i]
            break
    text = "\n".join(lines).strip()
    return text if len(text) <= 500 else text[:497] + "..."


class GrammarCompiler:
    """Compiles ``ConstraintSpec`` s for one tokenizer and caches them by (spec, reasoning start).

    ``tokenizer_json`` is the checkpoint's ``tokenizer.json`` text; ``vocab_size`` is the logits width
    V (the embedding may be padded past the tokenizer; padded ids are never allowed). Bitmasks are
    int32 ``[B, ceil(V/32)]``, bit ``t % 32`` of word ``t // 32`` set iff token t is allowed (llguidance
    layout). The cache holds at most ``max_cached`` grammars and ``max_cached_bytes`` of grammar text
    (``spec_bytes``; oldest entry dropped first; a grammar larger than the whole budget is compiled
    but not kept).
    """

    def __init__(self, tokenizer: Tokenizer, tokenizer_json: str, vocab_size: int, max_cached: int = 256,
                 max_cached_bytes: int = GRAMMAR_CACHE_BYTES):
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer "
                             f"({tokenizer.vocab_size} tokens); pass the model's logits width")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(tokenizer.stop_token_ids)
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                   eos_token=list(self.eos_token_ids))
        self.words = -(-vocab_size // _WORD_BITS)
        self._max_cached, self._max_cached_bytes = max_cached, max_cached_bytes
        self._cache: dict[tuple[str, str], tuple[llguidance.LLMatcher, int]] = {}  # -> (matcher, bytes)
        self.cache_bytes = 0  # grammar text held by the cache
        # int32 [W] rows: what a forced </think> may be (plus tokens finishing a UTF-8 character), and
        # the end-of-turn ids (the row of a request whose grammar failed)
        self.force_think_end_mask = self._mask_of(self._continuation_ids() + [tokenizer.think_end_id])
        self.eos_mask = self._mask_of(self.eos_token_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path, vocab_size: int | None = None) -> GrammarCompiler:
        """For a checkpoint directory (``tokenizer.json``; V from ``vocab_size`` or config.json)."""
        d = Path(path)
        if vocab_size is None:
            vocab_size = json.loads((d / "config.json").read_text())["vocab_size"]
        return cls(Tokenizer.from_pretrained(d), (d / "tokenizer.json").read_text(encoding="utf-8"),
                   vocab_size)

    @property
    def cache_size(self) -> int:
        """Number of compiled grammars held."""
        return len(self._cache)

    def _continuation_ids(self) -> list[int]:
        """Ids whose bytes are all UTF-8 continuation bytes: they may still be needed to finish a
        character before a forced ``</think>``."""
        out = []
        for tid in range(self.tokenizer.vocab_size):
            raw = self.tokenizer.token_bytes(tid)
            if raw and all(0x80 <= b <= 0xBF for b in raw):
                out.append(tid)
        return out

    def _mask_of(self, ids: Sequence[int]) -> torch.Tensor:
        """int32 [W] row with exactly ``ids`` allowed."""
        words = [0] * self.words
        for tid in ids:
            words[tid // _WORD_BITS] |= 1 << (tid % _WORD_BITS)
        # bit 31 is the int32 sign bit, as in the llguidance layout
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def _grammar(self, spec: ConstraintSpec, reasoning: ReasoningStart) -> str:
        tok = self.tokenizer
        think_text = f"THINK_TEXT: {_ANY_TEXT} & ~/(?s:.*)(<\\/think>|<minimax:tool_call>)(?s:.*)/\n"
        after = f"THINK_TEXT <[{tok.think_end_id}]> \"\\n\\n\""
        if reasoning == "inside":
            start = f"start: {after} body\n" + think_text
        elif reasoning == "may_open":
            start = f"start: (<[{tok.think_id}]> {after})? body\n" + think_text
        else:
            start = "start: body\n"
        body = spec.body.replace("<[TC]>", f"<[{tok.tool_call_id}]>").replace(
            "<[TC_END]>", f"<[{tok.tool_call_end_id}]>").replace("<[ANY]>", f"<[0-{tok.vocab_size - 1}]>")
        lark = start + body
        if not spec.subgrammars:
            return llguidance.LLMatcher.grammar_from_lark(lark)
        grammars = [{"lark_grammar": lark}] + [{"name": n, "lark_grammar": g} for n, g in spec.subgrammars]
        return json.dumps({"grammars": grammars})

    def compile(self, spec: ConstraintSpec, reasoning: ReasoningStart = "inside") -> llguidance.LLMatcher:
        """A fresh matcher at the start of the grammar (a deep copy of the cached compiled one).

        Raises ValueError ``"{spec.field}: ..."`` with llguidance's message for a grammar that does not
        compile (invalid or unsupported schema, bad regex, bad Lark), for a grammar text larger than
        MAX_GRAMMAR_BYTES (before compiling), and for an unknown ``reasoning``.
        """
        if reasoning not in _REASONING_STARTS:
            raise ValueError(f"reasoning={reasoning!r}: expected one of {_REASONING_STARTS}")
        size = spec_bytes(spec)
        if size - spec.exempt_bytes > MAX_GRAMMAR_BYTES:
            raise ValueError(f"{spec.field}: the grammar is {size - spec.exempt_bytes} bytes, more than the "
                             f"limit of {MAX_GRAMMAR_BYTES} bytes")
        key = (spec.key, reasoning)
        cached = self._cache.get(key)
        matcher = cached[0] if cached is not None else None
        if matcher is None:
            try:
                matcher = self._compile_with_fallback(spec, reasoning)
            except (ValueError, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - a Rust panic (pyo3's PanicException) or alike
                log.error("llguidance failed compiling %s (%s); refused as an internal error", spec.field,
                          type(e).__name__)
                raise ValueError(f"{spec.field}: {_clean_error('panicked')}") from None
            if size <= self._max_cached_bytes:
                while self._cache and (len(self._cache) >= self._max_cached
                                       or self.cache_bytes + size > self._max_cached_bytes):
                    self.cache_bytes -= self._cache.pop(next(iter(self._cache)))[1]
                self._cache[key] = (matcher, size)
                self.cache_bytes += size
        return matcher.deep_copy()

    def _compile_with_fallback(self, spec: ConstraintSpec, reasoning: ReasoningStart) -> llguidance.LLMatcher:
        """:meth:`_compile_new`, then ``spec.fallback`` when ``spec`` does not compile (llguidance cannot
        intersect every schema with the value-end exclusion: a recursive one exceeds its intersection
        depth); the fallback's error, naming the request's own schema, when neither does."""
        try:
            return self._compile_new(spec, reasoning)
        except ValueError as e:
            if spec.fallback is None:
                raise
            log.info("%s: compiled without the value-end exclusion (%s)", spec.field, str(e)[:200])
            return self._compile_new(spec.fallback, reasoning)

    def _compile_new(self, spec: ConstraintSpec, reasoning: ReasoningStart) -> llguidance.LLMatcher:
        """Check and compile ``spec`` (ValueError naming the field, or its part, at fault)."""
        grammar = self._grammar(spec, reasoning)
        error = self._check(grammar)
        if error:
            for field, lark in spec.parts:
                part_error = self._check(llguidance.LLMatcher.grammar_from_lark(lark))
                if part_error:
                    raise ValueError(f"{field}: {part_error}")
            raise ValueError(f"{spec.field}: {error}")
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise ValueError(f"{spec.field}: grammar does not compile: {_clean_error(matcher.get_error())}")
        return matcher

    def _check(self, grammar: str) -> str:
        """'' if ``grammar`` compiles for this tokenizer, else llguidance's message."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer, limits=_LIMITS)
        if not is_error:
            return ""
        return "grammar does not compile: " + _clean_error(messages[0] if messages else "unknown error")

    def constraint(self, spec: ConstraintSpec, reasoning: ReasoningStart = "inside",
                   reasoning_budget: int | None = None) -> GrammarConstraint:
        """A new per-choice constraint (compile errors as in ``compile``)."""
        if reasoning_budget is not None and (isinstance(reasoning_budget, bool) or
                                             not isinstance(reasoning_budget, int) or reasoning_budget < 0):
            raise ValueError(f"reasoning_budget={reasoning_budget!r} must be a non-negative integer or None")
        return GrammarConstraint(self, self.compile(spec, reasoning), reasoning, reasoning_budget,
                                 spec.free_answer, spec.field)


class GrammarConstraint:
    """The per-choice matcher: fills its bitmask row, advances with every sampled token.

    Satisfies the engine's ``TokenConstraint`` protocol (``fill_bitmask``, ``accept_token``,
    ``is_terminated``) and adds ``only_end_of_turn`` (the grammar allows nothing but the stop ids:
    ``min_tokens`` / ``ignore_eos`` must yield) and ``error`` (None, or why the grammar allows nothing;
    then the row allows only the stop ids, so the request ends with ``stop``, never with NaN logits).

    Reasoning: while ``in_reasoning``, tokens are counted; once ``reasoning_budget`` of them were
    accepted the row is narrowed to ``</think>`` (plus UTF-8 continuation tokens while a character is
    incomplete).
    """

    def __init__(self, compiler: GrammarCompiler, matcher: llguidance.LLMatcher, reasoning: ReasoningStart,
                 reasoning_budget: int | None, free_answer: bool = False, field: str = "grammar") -> None:
        self._compiler = compiler
        self.field = field
        self._matcher = matcher
        self._reasoning_budget = reasoning_budget
        self._free_answer = free_answer
        self._phase = {"inside": "reasoning", "may_open": "start", "off": "answer"}[reasoning]
        self.reasoning_tokens = 0
        self.error: str | None = None
        self._ended = False
        # per accepted token: the state before it and whether the matcher consumed it (rollback)
        self._history: deque[tuple[str, int, str | None, bool, bool]] = deque(
            maxlen=MAX_SPECULATIVE_TOKENS + 1)

    @property
    def in_reasoning(self) -> bool:
        """True while the output is inside ``<think>`` … ``</think>``."""
        return self._phase == "reasoning"

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into ``bitmask[row]`` (int32 ``[B, ceil(V/32)]``, CPU, contiguous)."""
        words = bitmask[row]
        if words.numel() != self._compiler.words or bitmask.dtype != torch.int32 or not words.is_contiguous():
            raise ValueError(f"bitmask row must be int32 contiguous with {self._compiler.words} words, got "
                             f"{tuple(bitmask.shape)} {bitmask.dtype}")
        if self._phase == "answer" and self._free_answer and self.error is None:
            words.fill_(-1)
            return
        if self.error is None:
            self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            if self._matcher.is_error():
                self._fail(self._matcher.get_error())
            elif self._phase == "reasoning" and self._reasoning_budget is not None \
                    and self.reasoning_tokens >= self._reasoning_budget:
                forced = words & self._compiler.force_think_end_mask
                if bool(forced.any()):
                    words.copy_(forced)
            if self.error is None and not bool(words.any()):
                self._fail("the grammar allows no token")
        if self.error is not None:
            words.copy_(self._compiler.eos_mask)

    def accept_token(self, token_id: int) -> None:
        """Advance with the sampled token (an id outside the mask puts the constraint in error)."""
        before = (self._phase, self.reasoning_tokens, self.error, self._ended)
        consumed = self._accept(token_id)
        self._history.append((*before, consumed))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` :meth:`accept_token` calls (speculative decoding's drafts,
        docs/serving.md §13): the phase, reasoning count, error and end state return to what they
        were and the matcher rolls back the tokens it consumed. ValueError past the kept history
        (MAX_SPECULATIVE_TOKENS + 1 tokens)."""
        if num_tokens > len(self._history):
            raise ValueError(f"rollback({num_tokens}): only {len(self._history)} accepted tokens are kept")
        consumed = 0
        for _ in range(num_tokens):
            self._phase, self.reasoning_tokens, self.error, self._ended, used = self._history.pop()
            consumed += used
        if consumed:
            self._matcher.rollback(consumed)

    def _accept(self, token_id: int) -> bool:
        """:meth:`accept_token`'s work; True when the matcher consumed the token."""
        if self.error is not None or self._ended:
            return False
        if token_id in self._compiler.eos_token_ids:
            self._ended = True
            if not (self._phase == "answer" and self._free_answer) and not self._matcher.is_accepting():
                self._fail(f"end of turn (id {token_id}) before the grammar was complete")
            return False
        if self._phase == "answer" and self._free_answer:
            return False
        if not self._matcher.consume_token(token_id):
            self._fail(self._matcher.get_error() or f"token {token_id} is not allowed by the grammar")
            return False
        tok = self._compiler.tokenizer
        if self._phase == "start":
            self._phase = "reasoning" if token_id == tok.think_id else "answer"
        elif self._phase == "reasoning":
            if token_id == tok.think_end_id:
                self._phase = "answer"
            else:
                self.reasoning_tokens += 1
        return True

    def failure(self) -> str | None:
        """None, or the grammar error as the request's 400 says it: ``"<field>: the grammar failed
        during decoding (<llguidance's reason>)"`` (a grammar that compiled but cannot go on: llguidance's
        lexer or parser limits, a rule that can never end)."""
        if self.error is None:
            return None
        reason = _clean_error(self.error.splitlines()[0] if self.error.strip() else "unknown error")
        return f"{self.field}: the grammar failed during decoding ({reason}); simplify it"

    def is_terminated(self) -> bool:
        """True once an end-of-turn id was accepted, or the grammar is in error."""
        return self._ended or self.error is not None

    def only_end_of_turn(self) -> bool:
        """True when nothing but an end-of-turn id may follow (the grammar is complete, or in error)."""
        if self._phase == "answer" and self._free_answer:
            return self.error is not None
        return self.error is not None or self._matcher.is_stopped()

    def _fail(self, message: str) -> None:
        self.error = message
        log.warning("constrained decoding: grammar error (%s)", message.splitlines()[0] if message else "?")
