"""A reasoning budget without other structure (Anthropic ``thinking.budget_tokens`` alone, issue 20):
``free_spec`` bounds the reasoning and leaves the answer untouched (docs/constrained-decoding.md)."""

from __future__ import annotations

import pytest
import torch
from constraint_helpers import TOKENIZERS, make_compiler, unpack_bitmask

from m2serve.text.constraint import free_spec


@pytest.fixture(scope="module", params=TOKENIZERS)
def compiler(request):
    return make_compiler(request.param)


def test_budget_forces_think_end_then_the_answer_is_free(compiler):
    tok = compiler.tokenizer
    c = compiler.constraint(free_spec(), "inside", 3)
    bitmask = torch.zeros(1, compiler.words, dtype=torch.int32)
    reasoning = tok.encode("hello world, again and again")[:3]  # ASCII: no character left open
    assert len(reasoning) == 3
    for t in reasoning:
        c.fill_bitmask(bitmask, 0)
        c.accept_token(t)
    c.fill_bitmask(bitmask, 0)
    assert unpack_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist() == [tok.think_end_id]
    c.accept_token(tok.think_end_id)
    assert not c.in_reasoning
    # the answer: every token allowed, whatever it is (three newlines, the tool-call tag ...)
    answer = tok.encode("\n\n\n<minimax:tool_call>\n<invoke name=\"f\">\n</invoke>\n</minimax:tool_call>")
    for t in answer:
        c.fill_bitmask(bitmask, 0)
        assert bool((bitmask == -1).all()) and not c.only_end_of_turn()
        c.accept_token(t)
    c.accept_token(compiler.eos_token_ids[0])
    assert c.is_terminated() and c.error is None and c.reasoning_tokens <= 3
