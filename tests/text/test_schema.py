"""Value typing from the JSON schema, docs/parsers.md §3.4 (P14–P16); expected values
derived by hand from the rules."""

from __future__ import annotations

import pytest

from m2serve.text.schema import (
    MAX_REF_HOPS,
    allowed_types,
    coerce_value,
    resolve_ref,
    resolve_refs,
    string_rule,
)


@pytest.mark.parametrize("schema, want", [
    (None, {"string"}), ({}, {"string"}), ({"description": "x"}, {"string"}),
    ({"type": "int"}, {"integer"}), ({"type": "LONG"}, {"integer"}), ({"type": "double"}, {"number"}),
    ({"type": "bool"}, {"boolean"}), ({"type": "dict"}, {"object"}), ({"type": "arr"}, {"array"}),
    ({"type": "text"}, {"string"}), ({"type": ["integer", "null"]}, {"integer", "null"}),
    ({"enum": ["a", 1, 2.5, True, None]}, {"string", "integer", "number", "boolean", "null"}),
    ({"anyOf": [{"type": "object"}, {"oneOf": [{"type": "null"}, {"allOf": [{"type": "array"}]}]}]},
     {"object", "null", "array"}),
    ({"type": "mystery"}, {"string"}),
])
def test_allowed_types(schema, want):  # P14
    assert allowed_types(schema) == want


def test_resolve_ref_follows_local_refs_only():  # P14: a $ref parameter types as its target
    loc = {"type": "object", "properties": {"city": {"type": "string"}}}
    root = {"$defs": {"Loc": loc, "a/b": {"type": "integer"}, "Alias": {"$ref": "#/$defs/Loc"},
                      "Self": {"$ref": "#/$defs/Self"}},
            "definitions": {"N": {"type": "number"}}}
    assert resolve_ref({"$ref": "#/$defs/Loc"}, root) == loc
    aliased = resolve_ref({"$ref": "#/$defs/Alias", "description": "where"}, root)
    assert aliased == {**loc, "description": "where"}
    assert resolve_ref({"$ref": "#/$defs/a~1b"}, root) == {"type": "integer"}  # JSON Pointer escape
    assert resolve_ref({"$ref": "#/definitions/N"}, root) == {"type": "number"}
    for unresolved in ({"$ref": "#/$defs/Missing"}, {"$ref": "https://example.com/s.json"},
                       {"$ref": "#/$defs/Self"}, {"type": "string"}, None):
        out = resolve_ref(unresolved, root)
        assert (out == unresolved) or out == {"$ref": "#/$defs/Self"}, unresolved
    assert allowed_types(resolve_ref({"$ref": "#/$defs/Loc"}, root)) == {"object"}
    assert allowed_types({"$ref": "#/$defs/Loc"}) == {"string"}  # unresolved: no type, P14's default
    for hops, resolved in ((MAX_REF_HOPS, True), (MAX_REF_HOPS + 1, False)):  # a chain of `hops` refs
        chain = {"$defs": {f"D{i}": {"$ref": f"#/$defs/D{i + 1}"} for i in range(hops - 1)}}
        chain["$defs"][f"D{hops - 1}"] = {"type": "integer"}
        out = resolve_ref({"$ref": "#/$defs/D0"}, chain)
        assert (out == {"type": "integer"}) is resolved and ("$ref" in out) is not resolved, hops
    # the branches of a union too (pydantic's Optional[Model]); properties inside are left as written
    opt = {"anyOf": [{"$ref": "#/$defs/Loc"}, {"type": "null"}], "description": "d"}
    assert resolve_refs(opt, root) == {"anyOf": [loc, {"type": "null"}], "description": "d"}
    assert allowed_types(resolve_refs(opt, root)) == {"object", "null"}
    assert allowed_types(opt) == {"null"}  # what the branch gave unresolved


def test_string_rule():  # P15
    assert string_rule("\n\n  x\n\n") == "\n  x\n"
    assert string_rule("\n") == "" and string_rule("  a  ") == "  a  "


INT, NUM, BOOL, OBJ = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "object"}
NESTED = {"anyOf": [{"type": "object", "properties": {"o": {"type": "object", "properties": {"k": NUM}}}},
                    {"type": "null"}]}


@pytest.mark.parametrize("raw, schema, want", [
    ("NULL", {"type": ["null", "string"]}, None),
    ("none", {"type": ["null", "string"]}, "none"),
    (" 42 ", INT, 42), ("+7", INT, 7), ("4.0", INT, "4.0"), ("9" * 5000, INT, "9" * 5000),
    ("1e3", NUM, 1000), ("2.5", NUM, 2.5), ("1_000", NUM, "1_000"),
    ("inf", NUM, "inf"), ("nan", NUM, "nan"), ("١٢", NUM, "١٢"),
    ("1", BOOL, True), ("False", BOOL, False), ("yes", BOOL, "yes"),
    ("5", {"type": ["boolean", "integer"]}, 5), ("1", {"type": ["boolean", "number"]}, 1),
    ('{"a": NaN}', OBJ, '{"a": NaN}'), ("[1]", OBJ, "[1]"),
    ('{"n": "5", "s": "5"}', {"type": "object", "properties": {"n": INT}}, {"n": 5, "s": "5"}),
    ('[{"n": "true"}]', {"type": "array", "items": {"type": "object", "properties": {"n": BOOL}}},
     [{"n": True}]),
    ('{"o": {"k": "1.5"}}', NESTED, {"o": {"k": 1.5}}),
    ("\nplain\n", {"type": "string"}, "plain"), ("\n 3 \n", INT, 3),
])
def test_coerce_value(raw, schema, want):  # P16
    got = coerce_value(raw, schema)
    assert got == want and type(got) is type(want)
