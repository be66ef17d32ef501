"""Typing of tool-call parameter values from the request's JSON schema.

The model writes every argument as raw text between ``<parameter name=KEY>`` and ``</parameter>``;
this module turns that text into a JSON value using ``tools[i].function.parameters.properties[KEY]``
(docs/parsers.md §3.4, rules P14–P16). Pure functions, no state.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

# P14 type-name aliases.
_ALIASES = {
    "str": "string", "text": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "long": "integer",
    "float": "number", "double": "number",
    "bool": "boolean",
    "dict": "object",
    "list": "array", "arr": "array",
}
_JSON_TYPES = {"null", "integer", "number", "boolean", "object", "array", "string"}
# P16 priority order.
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_INT_RE = re.compile(r"[+-]?[0-9]+")
_STRING_ONLY = frozenset({"string"})
#: P16: the deepest object / array value converted; a deeper one stays text (the call is kept).
MAX_VALUE_DEPTH = 128


def _json_type_of(value: Any) -> str:
    """JSON type name of a Python value from ``json.loads`` (used for ``enum`` members)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


def _collect_types(schema: Any, out: set[str]) -> None:
    if not isinstance(schema, dict):
        return
    declared = schema.get("type")
    names = declared if isinstance(declared, list) else [declared] if declared is not None else []
    for name in names:
        if isinstance(name, str):
            name = _ALIASES.get(name.strip().lower(), name.strip().lower())
            if name in _JSON_TYPES:
                out.add(name)
    enum = schema.get("enum")
    if isinstance(enum, list):
        out.update(_json_type_of(v) for v in enum)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                _collect_types(branch, out)


#: Local ``$ref`` hops followed to find a parameter's schema; a longer chain (or a cycle) stays as written.
MAX_REF_HOPS = 8
_LOCAL_REF = re.compile(r"#/(\$defs|definitions)/([^/]+)")


def local_ref(ref: Any) -> tuple[str, str] | None:
    """(``$defs`` or ``definitions``, NAME) of a local reference ``#/$defs/NAME`` (JSON Pointer
    escapes ``~1`` / ``~0`` undone), else None (a remote reference, ``#``, a deeper pointer, not a
    string)."""
    match = _LOCAL_REF.fullmatch(ref) if isinstance(ref, str) else None
    return (match.group(1), match.group(2).replace("~1", "/").replace("~0", "~")) if match else None


def resolve_ref(schema: Any, root: Any) -> Any:
    """A parameter's schema with a local ``$ref`` followed (docs/parsers.md P14): ``#/$defs/NAME`` or
    ``#/definitions/NAME`` looked up in ``root`` (the tool's ``parameters``; ``~1`` / ``~0`` are JSON
    Pointer escapes), its target's keys updated by the reference's other keys (a ``description``
    beside the ``$ref``), up to MAX_REF_HOPS times. pydantic writes a nested model's field as
    ``{"$ref": "#/$defs/Model"}``, which has no ``type`` and would otherwise type as string. Anything
    else (no ``$ref``, a remote or missing target, too many hops) comes back unchanged."""
    for _ in range(MAX_REF_HOPS):
        where = local_ref(schema.get("$ref")) if isinstance(schema, Mapping) else None
        defs = root.get(where[0]) if where and isinstance(root, Mapping) else None
        target = defs.get(where[1]) if isinstance(defs, Mapping) else None
        if not isinstance(target, Mapping):
            return schema
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


#: Nesting of anyOf / oneOf / allOf through which :func:`resolve_refs` follows references.
MAX_REF_DEPTH = 8


def resolve_refs(schema: Any, root: Any, depth: int = 0) -> Any:
    """:func:`resolve_ref` on a parameter's schema and, recursively, on the branches of its ``anyOf`` /
    ``oneOf`` / ``allOf`` (pydantic writes ``x: Model | None`` as ``anyOf: [{"$ref": ...}, {"type":
    "null"}]``), to MAX_REF_DEPTH levels: what P14 types the value by. Properties and items inside are
    left as written."""
    schema = resolve_ref(schema, root)
    if not isinstance(schema, Mapping) or depth >= MAX_REF_DEPTH:
        return schema
    out = dict(schema)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [resolve_refs(b, root, depth + 1) for b in out[key]]
    return out


def allowed_types(schema: Any) -> frozenset[str]:
    """P14: the set of JSON type names a parameter schema allows.

    Union of ``type`` (a string or a list, aliases such as ``int``/``float``/``dict`` mapped), the JSON
    types of ``enum`` values, and the same collected recursively from ``anyOf``/``oneOf``/``allOf``.
    A missing or non-dict schema, or one that names no known type, gives ``{"string"}``.
    """
    out: set[str] = set()
    _collect_types(schema, out)
    return frozenset(out) if out else _STRING_ONLY


def is_string_only(schema: Any) -> bool:
    """True if the allowed types are exactly ``{"string"}`` (such values stream per character, P24)."""
    return allowed_types(schema) == _STRING_ONLY


def string_rule(raw: str) -> str:
    """P15 string rule: drop at most one leading and at most one trailing ``\\n``; keep all else."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name}")


def _sub_schemas(schema: Any, field: str, key: str | None) -> list[Any]:
    """``properties[key]`` (key given) or ``items`` (key None) of a schema and its anyOf/oneOf/allOf."""
    if not isinstance(schema, dict):
        return []
    found: list[Any] = []
    if key is None:
        if isinstance(schema.get("items"), dict):
            found.append(schema["items"])
    else:
        props = schema.get("properties")
        if isinstance(props, dict) and key in props:
            found.append(props[key])
    for combo in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(combo)
        if isinstance(branches, list):
            for branch in branches:
                found.extend(_sub_schemas(branch, field, key))
    return found


def _merge(schemas: list[Any]) -> Any:
    """One schema standing for several candidates (their union as anyOf), or None."""
    if not schemas:
        return None
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _coerce_nested(value: Any, schema: Any) -> Any:
    """P16 object/array: convert nested strings whose schema does not allow string; recurse."""
    if isinstance(value, dict):
        return {k: _coerce_nested(v, _merge(_sub_schemas(schema, "properties", k))) for k, v in value.items()}
    if isinstance(value, list):
        item_schema = _merge(_sub_schemas(schema, "items", None))
        return [_coerce_nested(v, item_schema) for v in value]
    if isinstance(value, str) and schema is not None and "string" not in allowed_types(schema):
        return _convert(value, value, allowed_types(schema), schema)
    return value


def nesting_depth(value: Any) -> int:
    """Levels of dict/list nesting of a ``json.loads`` value (a scalar: 0), counted without recursion."""
    depth, level = 0, [(value, 1)]
    while level:
        item, d = level.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            depth = max(depth, d)
            level += [(v, d + 1) for v in item]
    return depth


def _convert(raw: str, string_value: str, allowed: frozenset[str], schema: Any) -> Any:
    text = raw.strip()
    for kind in _PRIORITY:
        if kind not in allowed:
            continue
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer" and _INT_RE.fullmatch(text):
            try:
                return int(text)
            except ValueError:  # beyond sys.get_int_max_str_digits()
                continue
        if kind == "number" and text.isascii() and "_" not in text:
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
        if kind == "boolean" and text.lower() in ("true", "1", "false", "0"):
            return text.lower() in ("true", "1")
        if kind in ("object", "array"):
            try:
                parsed = json.loads(text, parse_constant=_reject_constant)
            except (ValueError, RecursionError):
                continue
            if nesting_depth(parsed) > MAX_VALUE_DEPTH:  # P16: kept as text, the call survives
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return _coerce_nested(parsed, schema)
        if kind == "string":
            return string_value
    return string_value


def coerce_value(raw: str, schema: Any) -> Any:
    """Type one raw parameter value (the text between the parameter tags) by its schema, P14–P16.

    Candidates are tried in the order null > integer > number > boolean > object > array > string,
    restricted to ``allowed_types(schema)``; non-string candidates read the value stripped of
    surrounding whitespace, the string candidate uses ``string_rule(raw)``. If nothing matches the
    string-rule value is returned. Never raises.
    """
    value = string_rule(raw)
    allowed = allowed_types(schema)
    if allowed == _STRING_ONLY:
        return value
    return _convert(raw, value, allowed, schema)
