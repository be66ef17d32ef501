"""vLLM ``structured_outputs`` regex / choice / grammar and ``json_object`` under random logits (issue 20).

Checked with independent readers: Python ``re.fullmatch`` for the regex and the grammar (whose language
is regular here), membership for the choice, ``json.loads`` for json_object. ``off`` is the raw
completions start (no reasoning); ``may_open`` lets the output open ``<think>`` first (spec P2).
"""

from __future__ import annotations

import json
import re

import pytest
from constraint_helpers import make_compiler, sample_batch

from m2serve.text.constraint import choice_spec, json_spec, lark_spec, regex_spec
from m2serve.text.parser import parse_output

N = 100


@pytest.fixture(scope="module")
def compiler():
    return make_compiler("tiny-random")


def _bodies(compiler, spec, reasoning, seed):
    outs = sample_batch(compiler, [compiler.constraint(spec, reasoning, 8) for _ in range(N)], 128, seed)
    assert all(o.error is None for o in outs)
    opened = sum(o.text.startswith("<think>") for o in outs)
    assert (0 < opened < N) if reasoning == "may_open" else opened == 0
    stopped = [o for o in outs if o.finish == "stop"]
    # the body after the reasoning, as the chat parser reads it (P2/P4)
    return len(stopped), [parse_output(o.text, None).content or "" for o in stopped]


@pytest.mark.parametrize("reasoning", ["off", "may_open"])
def test_regex(compiler, reasoning):
    pattern = r"(yes|no) [0-9]{1,3}(\.[0-9]{2})?"
    n, bodies = _bodies(compiler, regex_spec(pattern), reasoning, seed=7)
    assert n >= 0.99 * N
    assert all(re.fullmatch(pattern, b) for b in bodies)


def test_choice(compiler):
    choices = ["red", "green", "a longer answer, with punctuation!"]
    n, bodies = _bodies(compiler, choice_spec(choices), "off", seed=8)
    assert n == N and set(bodies) == set(choices)


def test_lark_grammar(compiler):
    grammar = 'start: pair ("," pair){0,2}\npair: KEY "=" VALUE\nKEY: /[a-z]{1,4}/\nVALUE: /[0-9]{1,2}/\n'
    n, bodies = _bodies(compiler, lark_spec(grammar), "off", seed=9)
    assert n >= 0.99 * N
    assert all(re.fullmatch(r"[a-z]{1,4}=[0-9]{1,2}(,[a-z]{1,4}=[0-9]{1,2}){0,2}", b) for b in bodies)


@pytest.mark.parametrize("grammar", ['root ::= "yes" | "no"', 'answer-rule ::= [a-z]+\nroot ::= answer-rule'])
def test_a_gbnf_grammar_is_named_as_such(grammar):
    # vLLM's docs show GBNF (`root ::= ...`); llguidance reads Lark and said "Expected token '_'"
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar: this looks like GBNF"):
        lark_spec(grammar)
    lark_spec('start: "a ::= b"')   # the text inside a Lark literal is not GBNF


def test_json_object(compiler):
    n, bodies = _bodies(compiler, json_spec(None), "off", seed=10)
    assert n >= 0.2 * N  # unbounded keys and values: many hit max_tokens with random logits
    assert all(isinstance(json.loads(b), dict) for b in bodies)
