"""Grammar cost limits and leaks (issue 26 items 5 and 6; docs/constrained-decoding.md "Limits"): oversized
choice / enum / grammar inputs are refused before llguidance compiles them, no Rust panic text reaches the
message, the compiled-grammar cache is bounded in bytes, and ``tool_choice`` none forbids the call syntax
spelt with ordinary tokens."""

from __future__ import annotations

import time

import pytest
import torch
from constraint_helpers import make_compiler, unpack_bitmask

from m2serve.text import constraint as C
from m2serve.text.constraint import (
    choice_spec,
    json_spec,
    lark_spec,
    no_tool_call_spec,
    regex_spec,
    tool_calls_spec,
)


@pytest.fixture(scope="module")
def compiler():
    return make_compiler("tiny-chat")


def test_choice_and_enum_counts_are_refused_fast():
    t0 = time.process_time()
    with pytest.raises(ValueError) as e:
        choice_spec([f"option {i}" for i in range(100_000)])
    assert str(e.value) == "structured_outputs.choice: 100000 choices, more than the limit of 1024"
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": list(range(2000))}}}}
    with pytest.raises(ValueError, match=r"^response_format: an enum of 2000 values, more than the limit "
                                         r"of 1024$"):
        json_spec(schema)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(ValueError, match=r"^tools\[0\]: an enum of 2000 values"):
        tool_calls_spec([tool], "f")
    assert time.process_time() - t0 < 5  # refused, not compiled (100,000 choices took 28-80 s)
    choice_spec([str(i) for i in range(1024)])  # at the limit: accepted


def test_grammar_bytes_are_refused_before_compiling(compiler, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled an oversized grammar")

    monkeypatch.setattr(compiler, "_compile_new", no_compile)
    big = "start: " + " | ".join(f'"word{i:06d}"' for i in range(30_000))  # > 256 KiB of Lark
    with pytest.raises(ValueError) as e:
        compiler.compile(lark_spec(big), "inside")
    assert str(e.value).startswith("structured_outputs.grammar: the grammar is ")
    assert str(e.value).endswith(f"bytes, more than the limit of {256 * 1024} bytes")
    with pytest.raises(ValueError, match=r"^structured_outputs.regex: the pattern is \d+ bytes, more than"):
        regex_spec("a" * (256 * 1024 + 1))


class PanicException(BaseException):
    """What pyo3 raises for a Rust panic (a BaseException, not an Exception)."""


PANIC = ("thread '<unnamed>' panicked at src/earley/parser.rs:1234:9:\nassertion failed: x < y\n"
         "stack backtrace:\n   0: rust_begin_unwind\n   1: core::panicking::panic_fmt")


def test_a_panic_never_reaches_the_message(compiler, monkeypatch):
    def panic(*args, **kwargs):
        raise PanicException(PANIC)

    monkeypatch.setattr(compiler, "_compile_new", panic)
    with pytest.raises(ValueError) as e:
        compiler.compile(json_spec({"type": "object", "properties": {"zz": {"type": "integer"}}}), "inside")
    msg = str(e.value)
    assert msg.startswith("response_format: llguidance failed on this grammar (an internal error)")
    assert "panicked" not in msg and "backtrace" not in msg and ".rs" not in msg
    # llguidance's own error text with a panic inside is cut the same way
    monkeypatch.undo()  # the real _compile_new, whose validator now reports a panic
    monkeypatch.setattr(C.llguidance.LLMatcher, "validate_grammar_with_warnings",
                        staticmethod(lambda *a, **k: (True, [PANIC])))
    with pytest.raises(ValueError) as e:
        compiler.compile(json_spec({"type": "object", "properties": {"yy": {"type": "integer"}}}), "inside")
    assert "backtrace" not in str(e.value) and "panicked" not in str(e.value)


def test_grammar_cache_is_bounded_in_bytes():
    compiler = make_compiler("tiny-chat")
    specs = [json_spec({"type": "object", "properties": {f"k{i}_" + "x" * 400: {"type": "integer"}}})
             for i in range(6)]
    size = C.spec_bytes(specs[0])
    compiler._max_cached_bytes = 3 * size + size // 2  # room for three
    for spec in specs:
        compiler.compile(spec, "inside")
        assert compiler.cache_bytes <= compiler._max_cached_bytes
    assert compiler.cache_size == 3 and compiler.cache_bytes == sum(C.spec_bytes(s) for s in specs[3:])
    huge = json_spec({"type": "object", "properties": {"k" + "y" * (4 * size): {"type": "integer"}}})
    compiler.compile(huge, "inside")  # larger than the whole budget: compiled, not kept
    assert compiler.cache_size == 3 and compiler.cache_bytes <= compiler._max_cached_bytes


@pytest.mark.parametrize("syntax", ["<invoke", "</invoke", "<parameter", "</parameter", "minimax:tool_call"])
def test_tool_choice_none_forbids_the_call_syntax_as_text(compiler, syntax):
    """After all but the last character of a piece of the call syntax, spelt one character per token in
    the answer, no allowed token completes it: checked against every token's bytes (issue 26 item 5)."""
    tok = compiler.tokenizer
    constraint = compiler.constraint(no_tool_call_spec(), "inside")
    for token in [tok.token_to_id("x"), tok.think_end_id, *tok.encode("\n\n>\n")]:
        constraint.accept_token(token)
    prefix = syntax[:-1]
    for ch in prefix:
        constraint.accept_token(tok.token_to_id(ch))
    bitmask = torch.zeros(1, compiler.words, dtype=torch.int32)
    constraint.fill_bitmask(bitmask, 0)
    allowed = set(unpack_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist())
    assert allowed and constraint.error is None
    for token in allowed - set(tok.stop_token_ids):
        assert syntax not in prefix + tok.token_bytes(token).decode("utf-8", "replace"), tok.decode([token])
