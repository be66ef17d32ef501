"""GrammarConstraint units: compile errors name the request field, end of turn, grammar errors, budget,
and ``tool_choice`` none under any tokenisation (issue 20; docs/parsers.md §1, §3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from constraint_helpers import TOKENIZERS, make_compiler, unpack_bitmask

from m2serve.text.constraint import (
    choice_spec,
    json_spec,
    lark_spec,
    max_tool_calls,
    no_tool_call_spec,
    regex_spec,
    tool_calls_spec,
)


@pytest.fixture(scope="module", params=TOKENIZERS)
def compiler(request):
    return make_compiler(request.param)


def _allowed(compiler, constraint) -> set[int]:
    bitmask = torch.zeros(1, compiler.words, dtype=torch.int32)
    constraint.fill_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist())


def _tool(name, properties, required=()):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


@pytest.mark.parametrize("make, field, reason", [
    (lambda: json_spec({"type": "object", "properties": {"a": {"type": "strin"}}}), "response_format",
     "Invalid type"),
    (lambda: json_spec({"type": "string", "pattern": "[a-"}), "response_format", "unclosed character class"),
    (lambda: json_spec({"type": "array", "uniqueItems": True}), "response_format", "uniqueItems"),
    (lambda: json_spec({"type": "string", "format": "nope"}), "response_format", "Unknown format"),
    (lambda: regex_spec("(ab"), "structured_outputs.regex", "unclosed group"),
    (lambda: lark_spec("start: missing_rule"), "structured_outputs.grammar", "missing_rule"),
    (lambda: tool_calls_spec([_tool("ok", {"x": {"type": "integer"}}),
                              _tool("bad", {"n": {"type": "integer", "minimum": "a"}})]),
     "tool 'bad' parameter 'n'", "minimum"),
    (lambda: tool_calls_spec([_tool("rx", {"s": {"type": "string", "pattern": "(("}})]),
     "tool 'rx' parameter 's'", "unclosed group"),
])
def test_uncompilable_grammar_names_the_field(compiler, make, field, reason):
    with pytest.raises(ValueError) as info:
        compiler.compile(make())
    message = str(info.value)
    assert message.startswith(field + ": ") and reason in message
    assert "| " not in message  # no listing of the generated Lark text


@pytest.mark.parametrize("make, field", [
    (lambda: tool_calls_spec([_tool("f", {"x": {"type": ["string", "integer"]}})]), "tool 'f' parameter 'x'"),
    (lambda: tool_calls_spec([_tool("f", {"d": {"$ref": "#/$defs/Missing"}})]),  # types as string
     "tool 'f' parameter 'd'"),
    (lambda: tool_calls_spec([_tool("f", {})], name="g"), "tool_choice"),
    (lambda: tool_calls_spec([_tool("a>b", {})]), "tools[0]"),
    (lambda: tool_calls_spec([]), "tool_choice"),
    (lambda: choice_spec([]), "structured_outputs.choice"),
    (lambda: json_spec(["not", "a", "schema"]), "response_format"),
    (lambda: tool_calls_spec([_tool("f", {})], max_calls=0), "max_tool_calls"),
    (lambda: tool_calls_spec([_tool("f", {})], max_calls=True), "max_tool_calls"),
])
def test_unsupported_request_names_the_field(make, field):
    with pytest.raises(ValueError, match="^" + field.replace("[", r"\[").replace("]", r"\]")):
        make()


@pytest.mark.parametrize("kw, cap", [
    ({}, 2),                                   # required: one call per declared tool
    ({"name": "g"}, 1),                        # named: one call, as vLLM / SGLang
    ({"parallel_tool_calls": False}, 1),
    ({"parallel_tool_calls": False, "max_calls": 3}, 1),
    ({"max_calls": 3}, 3),                     # Responses max_tool_calls
    ({"name": "g", "max_calls": 3}, 3),
])
def test_forced_calls_are_capped(compiler, kw, cap):
    """After ``cap`` complete invokes the only allowed token closes the block (then end of turn);
    before it, another invoke may open. Tokens from the tokenizer's own encoding of the text."""
    tok = compiler.tokenizer
    assert max_tool_calls(2, kw.get("name"), kw.get("parallel_tool_calls", True), kw.get("max_calls")) == cap
    spec = tool_calls_spec([_tool("f", {}), _tool("g", {})], **kw)
    constraint = compiler.constraint(spec, "off")
    for token in [tok.tool_call_id] + tok.encode("\n"):
        constraint.accept_token(token)
    invoke = tok.encode('<invoke name="g">\n</invoke>\n')
    for k in range(1, cap + 1):
        for token in invoke:
            assert token in _allowed(compiler, constraint)
            constraint.accept_token(token)
        allowed = _allowed(compiler, constraint)
        assert tok.tool_call_end_id in allowed
        assert (invoke[0] in allowed) == (k < cap), k
    assert _allowed(compiler, constraint) == {tok.tool_call_end_id}
    constraint.accept_token(tok.tool_call_end_id)
    assert constraint.only_end_of_turn() and constraint.error is None


def test_a_bad_request_leaves_the_compiler_usable(compiler):
    with pytest.raises(ValueError):
        compiler.compile(regex_spec("[z-a]"))
    assert compiler.compile(regex_spec("[a-z]")) is not None


def test_only_end_of_turn_after_a_complete_choice(compiler):
    """choice "yes": once consumed, the row allows exactly the stop ids and says so."""
    tok = compiler.tokenizer
    constraint = compiler.constraint(choice_spec(["yes"]), "off")
    assert not constraint.only_end_of_turn()
    for token in tok.encode("yes"):
        assert token in _allowed(compiler, constraint)
        constraint.accept_token(token)
    assert constraint.only_end_of_turn() and not constraint.is_terminated()
    assert _allowed(compiler, constraint) == set(compiler.eos_token_ids) == {tok.eos_token_id}
    constraint.accept_token(tok.eos_token_id)
    assert constraint.is_terminated() and constraint.error is None


def test_forbidden_token_is_a_grammar_error_and_the_row_allows_only_end_of_turn(compiler):
    tok = compiler.tokenizer
    constraint = compiler.constraint(regex_spec("[0-9]+"), "off")
    letter = tok.encode("x")[0]
    assert letter not in _allowed(compiler, constraint)
    constraint.accept_token(letter)
    assert constraint.error and constraint.is_terminated() and constraint.only_end_of_turn()
    assert _allowed(compiler, constraint) == {tok.eos_token_id}


def test_a_failure_names_the_field_and_the_reason(compiler):
    constraint = compiler.constraint(regex_spec("[0-9]+"), "off")
    assert constraint.failure() is None
    constraint.accept_token(compiler.tokenizer.encode("x")[0])
    failure = constraint.failure()
    assert failure.startswith("structured_outputs.regex: the grammar failed during decoding (")
    assert "| " not in failure  # no listing of the generated Lark text


def test_end_of_turn_before_the_grammar_is_complete_is_an_error(compiler):
    constraint = compiler.constraint(regex_spec("[0-9]+"), "off")
    constraint.accept_token(compiler.tokenizer.eos_token_id)
    assert constraint.is_terminated() and "before the grammar was complete" in constraint.error


def test_reasoning_budget_forces_think_end_then_constrains(compiler):
    tok = compiler.tokenizer
    constraint = compiler.constraint(choice_spec(["ok"]), "inside", reasoning_budget=2)
    free = _allowed(compiler, constraint)
    complete_chars = set()  # ordinary tokens that are whole UTF-8 text: reasoning is free to use them
    for token in range(tok.vocab_size):
        try:
            tok.token_bytes(token).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not tok.is_skipped(token) and token not in tok.special_ids.values():
            complete_chars.add(token)
    assert complete_chars <= free and tok.think_end_id in free
    assert tok.tool_call_id not in free and tok.eos_token_id not in free
    for ch in "ab":
        constraint.accept_token(tok.token_to_id(ch))
    assert constraint.in_reasoning and constraint.reasoning_tokens == 2
    assert _allowed(compiler, constraint) == {tok.think_end_id}
    constraint.accept_token(tok.think_end_id)
    assert not constraint.in_reasoning
    for token in tok.encode("\n\nok"):
        assert token in _allowed(compiler, constraint)
        constraint.accept_token(token)
    assert constraint.only_end_of_turn() and constraint.error is None


def test_may_open_reasoning_only_at_the_start(compiler):
    tok = compiler.tokenizer
    first = compiler.constraint(choice_spec(["ok"]), "may_open")
    assert tok.think_id in _allowed(compiler, first)
    first.accept_token(tok.think_id)
    assert first.in_reasoning
    direct = compiler.constraint(choice_spec(["ok"]), "may_open")
    direct.accept_token(tok.encode("o")[0])
    assert not direct.in_reasoning and tok.think_id not in _allowed(compiler, direct)


def test_tool_choice_none_blocks_the_tag_under_any_tokenisation(compiler):
    """After ``<minimax:tool_cal`` spelt one character per token (in reasoning and in the answer), no
    allowed token completes the tag: checked against every token's bytes, independently of llguidance."""
    tok = compiler.tokenizer
    constraint = compiler.constraint(no_tool_call_spec(), "inside")
    prefix = "<minimax:tool_cal"
    char_ids = [tok.token_to_id(ch) for ch in prefix]
    assert None not in char_ids

    def check():
        allowed = _allowed(compiler, constraint)
        assert tok.tool_call_id not in allowed
        for token in allowed - {tok.think_end_id, tok.eos_token_id}:
            assert "<minimax:tool_call>" not in prefix + tok.token_bytes(token).decode("utf-8", "replace")

    for token in char_ids:
        constraint.accept_token(token)
    check()
    constraint.accept_token(tok.token_to_id("x"))
    constraint.accept_token(tok.think_end_id)
    for token in tok.encode("\n\n") + char_ids:
        constraint.accept_token(token)
    check()
    assert constraint.error is None


@pytest.mark.parametrize("value", ["Paris", "New York", "a<b", "</para"])
def test_forced_call_accepts_the_calls_text_as_the_tokenizer_spells_it(compiler, value):
    """The call the template would write, encoded by the checkpoint's own tokenizer (tiny-chat spells
    ``</parameter>`` as ``</`` ``parameter`` ``>``), is accepted token by token and then allows end of
    turn: a raw-string value must end at its ``</parameter>`` whatever the tokenisation."""
    tok = compiler.tokenizer
    weather = _tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"])
    constraint = compiler.constraint(tool_calls_spec([weather]), "off")
    text = (f'<invoke name="get_weather">\n<parameter name="city">{value}</parameter>\n'
            '<parameter name="days">3</parameter>\n</invoke>\n')
    ids = tok.encode("\n") + [tok.tool_call_id] + tok.encode("\n" + text) + [tok.tool_call_end_id]
    for token in ids:
        assert token in _allowed(compiler, constraint), (tok.decode([token]), tok.decode(ids))
        constraint.accept_token(token)
    assert constraint.error is None
    assert tok.eos_token_id in _allowed(compiler, constraint)


def _forced_call_ids(tok, text):
    return tok.encode("\n") + [tok.tool_call_id] + tok.encode("\n" + text) + [tok.tool_call_end_id]


def _accepts(compiler, constraint, ids) -> bool:
    for token in ids:
        if token not in _allowed(compiler, constraint):
            return False
        constraint.accept_token(token)
    return constraint.error is None and compiler.tokenizer.eos_token_id in _allowed(compiler, constraint)


def test_format_on_a_raw_string_parameter_is_an_annotation(compiler):
    """Claude Code's WebFetch declares ``{"type": "string", "format": "uri"}``: a forced call compiles
    (it was refused with 400 while ``tool_choice`` auto served the same tools) and the value is raw text,
    checked by nothing but the raw-string rules."""
    fetch = _tool("WebFetch", {"url": {"type": "string", "format": "uri"}}, ["url"])
    for value, ok in (("https://example.com/a", True), ("not a uri", True), ("a</parameter>b", False)):
        constraint = compiler.constraint(tool_calls_spec([fetch]), "off")
        text = f'<invoke name="WebFetch">\n<parameter name="url">{value}</parameter>\n</invoke>\n'
        assert _accepts(compiler, constraint, _forced_call_ids(compiler.tokenizer, text)) is ok, value


def test_a_ref_parameter_is_json_of_its_target(compiler):
    """pydantic writes a nested model's field as ``{"$ref": "#/$defs/Loc"}``: the forced call writes
    the target's JSON (an object with ``city``), not raw text, and the parser reads it back as an object
    (docs/parsers.md P14)."""
    from m2serve.text.parser import parse_output

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}},
        "type": "object", "properties": {"location": {"$ref": "#/$defs/Loc"}}, "required": ["location"]}}}
    call = '<invoke name="get_weather">\n<parameter name="location">{}</parameter>\n</invoke>\n'
    good, bad = call.format('{"city": "Paris"}'), call.format("Paris")
    for text, ok in ((good, True), (bad, False)):
        constraint = compiler.constraint(tool_calls_spec([tool]), "off")
        assert _accepts(compiler, constraint, _forced_call_ids(compiler.tokenizer, text)) is ok, text
    parsed = parse_output("<minimax:tool_call>\n" + good + "</minimax:tool_call>", tools=[tool])
    want = [("get_weather", '{"location": {"city": "Paris"}}')]
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == want


def test_no_value_end_regex_against_substring_search():
    """The exclusion pattern, read by Python's ``re`` (``\\/`` is ``/`` there too), against plain
    substring search over random strings of the value ends' own characters, and the edge cases."""
    import random
    import re

    from m2serve.text import constraint as constraint_mod

    words = ("</parameter>", "<parameter name=", "</invoke>")
    rx = re.compile(constraint_mod._NO_VALUE_END)
    cases = ["", "abc", "a<b", "</para", "</parameter", "</parameter >", "<<</invoke>", "</invokes>",
             "< /invoke>", "<parameter name", "x\n</invoke>\ny", "<parameter name=", "a</parameter>"]
    rnd = random.Random(0)
    alphabet = "<>/parmetr nai=vok\n"
    cases += ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 40))) for _ in range(5000)]
    for text in cases:
        assert bool(rx.fullmatch(text)) == (not any(w in text for w in words)), text


TODO = _tool("TodoWrite", {"todos": {"type": "array", "items": {
    "type": "object", "properties": {"content": {"type": "string", "minLength": 1},
                                     "status": {"type": "string", "enum": ["pending", "done"]}},
    "required": ["content", "status"], "additionalProperties": False}},
    "meta": {"type": "object"}}, ["todos"])


@pytest.mark.parametrize("todos, meta, ok", [
    ('[{"content": "a<b", "status": "done"}]', None, True),
    ('[{"content": "x</parameter>", "status": "done"}]', None, False),
    ('[{"content": "x</invoke>\n", "status": "done"}]', None, False),
    ('[{"content": "<parameter name=", "status": "done"}]', None, False),
    ('[{"content": "a", "status": "later"}]', None, False),  # the schema still holds
    ('[]', '{"k": [1, {"d": "ok"}]}', True),
    ('[]', '{"k": [1, {"d": "</invoke>"}]}', False),  # at any depth of a free value
    ('[]', '{"a</parameter>": 1}', False),  # and in a free object's keys
])
def test_a_json_parameter_cannot_hold_a_value_end(compiler, todos, meta, ok):
    """A forced call's JSON-valued parameter: strings and keys inside it never hold ``</parameter>``,
    ``<parameter name=`` or ``</invoke>`` (P10 would end the value there: a TodoWrite call came back
    with its array cut into a string)."""
    text = f'<invoke name="TodoWrite">\n<parameter name="todos">{todos}</parameter>\n'
    if meta is not None:
        text += f'<parameter name="meta">{meta}</parameter>\n'
    text += "</invoke>\n"
    constraint = compiler.constraint(tool_calls_spec([TODO]), "off")
    assert _accepts(compiler, constraint, _forced_call_ids(compiler.tokenizer, text)) is ok, text


def test_an_optional_model_parameter_is_json_with_the_exclusion(compiler):
    """pydantic's ``x: Model | None`` is ``anyOf: [{"$ref": ...}, {"type": "null"}]``: typed through the
    reference (P14), so the forced call writes JSON that cannot hold a value end, and the parser reads
    an object back (it was a string, and the exclusion was skipped as for a null-only parameter)."""
    from m2serve.text.parser import parse_output

    tool = {"type": "function", "function": {"name": "go", "parameters": {
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}},
        "type": "object", "properties": {"alt": {"anyOf": [{"$ref": "#/$defs/Loc"}, {"type": "null"}]}},
        "required": ["alt"]}}}
    call = '<invoke name="go">\n<parameter name="alt">{}</parameter>\n</invoke>\n'
    for value, ok in (('{"city": "Rome"}', True), ("null", True), ('{"city": "a</invoke>b"}', False)):
        constraint = compiler.constraint(tool_calls_spec([tool]), "off")
        text = call.format(value)
        assert _accepts(compiler, constraint, _forced_call_ids(compiler.tokenizer, text)) is ok, value
    parsed = parse_output("<minimax:tool_call>\n" + call.format('{"city": "Rome"}') + "</minimax:tool_call>",
                          tools=[tool])
    assert [c.arguments for c in parsed.tool_calls] == ['{"alt": {"city": "Rome"}}']


def test_the_exclusion_is_not_counted_in_the_grammar_limit():
    """100 tools of two object parameters each: within MAX_GRAMMAR_BYTES as the request wrote them, so
    a forced call is not refused for the text m2serve adds (about 2 KB per such parameter)."""
    from m2serve.text.constraint import MAX_GRAMMAR_BYTES, spec_bytes

    tools = [_tool(f"t{i}", {"a": {"type": "array", "items": {"type": "string"}}, "b": {"type": "object"}})
             for i in range(100)]
    spec = tool_calls_spec(tools)
    assert spec_bytes(spec) > MAX_GRAMMAR_BYTES >= spec_bytes(spec) - spec.exempt_bytes
    assert spec.exempt_bytes == spec_bytes(spec) - spec_bytes(spec.fallback)  # the exclusion's text only
    compiler = make_compiler("tiny-random")
    assert compiler.constraint(spec, "off") is not None  # not refused as too large


def test_only_the_parameter_llguidance_cannot_intersect_goes_without_the_exclusion(compiler):
    """A recursive schema (or one with patternProperties) is found without compiling and written as
    given; the other parameters of the same request keep the exclusion (a compile failure of the whole
    grammar would drop it for every parameter)."""
    from m2serve.text.constraint import _intersectable

    loc = {"type": "object", "properties": {"city": {"type": "string"}}}
    root = {"$defs": {
        "Loc": loc, "Twice": {"properties": {"a": {"$ref": "#/$defs/Loc"}, "b": {"$ref": "#/$defs/Loc"}}},
        "N": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/N"}}}},
        "A": {"properties": {"b": {"$ref": "#/$defs/B"}}}, "B": {"properties": {"a": {"$ref": "#/$defs/A"}}},
        "P": {"type": "object", "patternProperties": {"^x": {}}}}}
    for schema, ok in (({"$ref": "#/$defs/Loc"}, True), ({"$ref": "#/$defs/Twice"}, True),
                       ({"$ref": "#/$defs/N"}, False), ({"$ref": "#/$defs/A"}, False),
                       ({"$ref": "#/$defs/P"}, False), ({"properties": {"x": {"$ref": "#"}}}, False),
                       ({"type": "array", "items": {"type": "string"}}, True)):
        assert _intersectable(schema, root) is ok, schema
    tree = {"type": "function", "function": {"name": "t", "parameters": {
        "$defs": {"N": root["$defs"]["N"]}, "type": "object", "properties": {"root": {"$ref": "#/$defs/N"}}}}}
    spec = tool_calls_spec([tree, TODO])
    text = ('<invoke name="TodoWrite">\n<parameter name="todos">[{"content": "x</invoke>", "status": "done"}]'
            '</parameter>\n</invoke>\n')
    ids = _forced_call_ids(compiler.tokenizer, text)
    assert not _accepts(compiler, compiler.constraint(spec, "off"), ids)


def test_a_recursive_parameter_schema_still_compiles(compiler):
    """llguidance cannot intersect a recursive schema with the exclusion: it is used as given."""
    tree = {"type": "function", "function": {"name": "t", "parameters": {
        "$defs": {"N": {"type": "object",
                        "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/N"}}}}},
        "type": "object", "properties": {"root": {"$ref": "#/$defs/N"}}, "required": ["root"]}}}
    constraint = compiler.constraint(tool_calls_spec([tree]), "off")
    text = '<invoke name="t">\n<parameter name="root">{"c": [{"c": []}]}</parameter>\n</invoke>\n'
    assert _accepts(compiler, constraint, _forced_call_ids(compiler.tokenizer, text))


@pytest.mark.parametrize("own_extra", [{}, {"patternProperties": {"^x": {"type": "integer"}}}])
def test_a_parameter_with_its_own_defs_still_reaches_the_tools_defs(compiler, own_extra):
    """A parameter schema with its own ``$defs`` that also names one of the tool's: both sets are there
    when the value is written, with the exclusion and without it (patternProperties: as given). The
    plain path (the patternProperties case) used to drop the tool's ``$defs`` when the parameter had
    its own, so the reference did not resolve and every forced call of the request failed to compile."""
    tool = {"type": "function", "function": {"name": "t", "parameters": {
        "$defs": {"Unit": {"enum": ["c", "f"]}}, "type": "object", "required": ["p"], "properties": {"p": {
            "type": "object", "$defs": {"Own": {"type": "integer"}}, **own_extra, "required": ["n", "u"],
            "properties": {"n": {"$ref": "#/$defs/Own"}, "u": {"$ref": "#/$defs/Unit"}}}}}}}
    call = '<invoke name="t">\n<parameter name="p">{}</parameter>\n</invoke>\n'
    for value, ok in (('{"n": 3, "u": "c"}', True), ('{"n": 3, "u": "k"}', False),
                      ('{"n": "3", "u": "f"}', False)):
        constraint = compiler.constraint(tool_calls_spec([tool]), "off")
        ids = _forced_call_ids(compiler.tokenizer, call.format(value))
        assert _accepts(compiler, constraint, ids) is ok, value


def test_a_recursive_definition_in_the_parameters_own_defs_is_found():
    # the walk follows references into the parameter's own $defs as well as the tool's: a cycle there is
    # written as given (no exclusion added), as one in the tool's $defs is
    from m2serve.text.constraint import _json_value

    own = {"type": "object", "properties": {"c": {"$ref": "#/$defs/N"}},
           "$defs": {"N": {"type": "object", "properties": {"c": {"$ref": "#/$defs/N"}}}}}
    assert _json_value(own, {}, exclude=True)[1] == 0
    flat = {"type": "object", "properties": {"c": {"$ref": "#/$defs/L"}}, "$defs": {"L": {"type": "string"}}}
    assert _json_value(flat, {}, exclude=True)[1] > 0


def test_compiled_grammars_are_cached_per_spec(compiler):
    spec = json_spec({"type": "object", "properties": {"k": {"type": "integer"}}})
    compiler.compile(spec, "inside")
    size = compiler.cache_size
    compiler.compile(json_spec({"type": "object", "properties": {"k": {"type": "integer"}}}), "inside")
    assert compiler.cache_size == size  # an equal schema from another request: one entry
    compiler.compile(spec, "off")
    compiler.compile(json_spec({"properties": {"k": {"type": "integer"}}, "type": "object"}), "inside")
    assert compiler.cache_size == size + 2  # another reasoning start; key order = generation order


def test_mask_rows_use_the_llguidance_bit_layout(compiler):
    """Bit t % 32 of word t // 32, bit 31 being the int32 sign bit (ids 31 and 63 here)."""
    row = compiler._mask_of([0, 31, 63, compiler.vocab_size - 1])
    allowed = unpack_bitmask(row.unsqueeze(0), compiler.vocab_size)[0]
    assert allowed.nonzero().flatten().tolist() == [0, 31, 63, compiler.vocab_size - 1]
    assert row[0].item() == 1 - 2**31 and row[1].item() == -(2**31)


@pytest.mark.parametrize("make", [lambda: tool_calls_spec([_tool("a>b", {})]),
                                  lambda: tool_calls_spec([_tool("f", {"k>": {"type": "string"}})])])
def test_a_name_the_format_cannot_express_points_at_the_docs(make):
    # the message cited "spec §3.7", a document users do not have; the rule lives in docs/parsers.md §3.7
    with pytest.raises(ValueError) as info:
        make()
    assert "contains '>'" in str(info.value) and "(docs/parsers.md §3.7)" in str(info.value)
    docs = (Path(__file__).parents[2] / "docs/parsers.md").read_text(encoding="utf-8")
    section = docs.split("### §3.7")[1].split("\n#")[0]
    assert "Names and keys cannot contain `>`" in section


def test_rollback_restores_the_matcher_and_the_reasoning_state():
    # speculative decoding (docs/serving.md §13): accept_token over drafted tokens, then rollback(n)
    # undoes them; the reference is the same constraint before the accepts (its bitmask and state)
    compiler = make_compiler("tiny-chat")
    tok = compiler.tokenizer
    c = compiler.constraint(json_spec({"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"], "additionalProperties": False}), "inside")
    reasoning = tok.encode("ok") + [tok.think_end_id]
    answer = tok.encode('\n\n{"a": 12}')
    for t in reasoning:
        assert t in _allowed(compiler, c)
        c.accept_token(t)
    before = (_allowed(compiler, c), c.in_reasoning, c.reasoning_tokens)
    assert not before[1]
    for t in answer[:3]:
        assert t in _allowed(compiler, c)
        c.accept_token(t)
    assert _allowed(compiler, c) != before[0]
    c.rollback(3)
    assert (_allowed(compiler, c), c.in_reasoning, c.reasoning_tokens) == before
    # across the end of reasoning: the phase and the count come back too
    c.rollback(1)
    assert c.in_reasoning and c.reasoning_tokens == len(reasoning) - 1
    c.accept_token(tok.think_end_id)
    for t in answer:
        c.accept_token(t)
    assert c.error is None and tok.think_end_id not in answer
    with pytest.raises(ValueError, match="rollback"):
        c.rollback(10_000)
