"""Speculative decoding is exact on the tiny-chat checkpoint (issue 34 "must show", docs/serving.md §13).

For the same seeds, n-gram speculative decoding and plain decoding (speculation off: the reference,
whose own correctness tests/checkpoints/test_tiny_chat.py checks against transformers) give the same
tokens, text and finish reasons on held-out tiny-chat prompts of every kind of
benchmarks/tiny_chat_eval.py (tools/tiny_chat/data.py KINDS), through the whole chat pipeline (template,
engine, detokeniser with stop strings, parser), greedy and at temperature 1, batch 1 and 16, with one
prompt under a json_schema constraint and one with penalties, in fp32. The 200-prompt run is slow-marked;
a fast subset (one prompt per kind) runs by default. The tests also check that drafts were accepted,
so they cannot pass with speculation silently off.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.tiny_chat import data  # noqa: E402

from m2serve.engine.sampling import SamplingParams  # noqa: E402
from m2serve.serve import chat_pipeline as cp  # noqa: E402
from m2serve.serve.llm import LLM  # noqa: E402

CKPT = REPO / "src/m2serve/checkpoints/tiny-chat"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
MAX_TOKENS = 64
# the 200-prompt run, on a shared 2-core box: 22.5 min at 64 tokens (load 6), 8.1 min at 32 (load 7)
MAX_TOKENS_200 = 32


def _jobs(examples: list[data.Example], temperature: float, max_tokens: int = MAX_TOKENS) -> list[cp.ChatJob]:
    """One chat job per example: seed = index; job 0 under a json_schema constraint (reasoning closed
    after 8 tokens), job 1 with penalties, the last one with stop strings."""
    jobs = []
    for i, ex in enumerate(examples):
        kw = dict(temperature=temperature, max_tokens=max_tokens, seed=1000 + i)
        if i == 1:
            kw.update(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3)
        if i == len(examples) - 1:
            kw.update(stop=["the", "is"])
        output = cp.OutputFormat("json", SCHEMA, "response_format") if i == 0 else None
        jobs.append(cp.ChatJob(list(ex.prompt_messages), ex.tools or None, params=SamplingParams(**kw),
                               output=output, reasoning_budget=8 if output else None))
    return jobs


def _generate(llm: LLM, jobs: list[cp.ChatJob]) -> list[tuple]:
    ctx = cp.TextContext.of(llm)
    accs = {}
    for i, job in enumerate(jobs):
        prepared = cp.prepare_blocking(ctx, job)
        [r] = cp.engine_requests(ctx, f"q{i}", [prepared.ids], prepared.params, prepared.new_parser,
                                 new_constraint=prepared.new_constraint)
        llm.add_request(r.request_id, r.prompt_token_ids, r.params, r.processor, r.constraint)
        accs[r.request_id] = cp.ChoiceAccumulator(0)
    while llm.has_unfinished_requests():
        for d in llm.step():
            accs[d.request_id].add(d)
    results = [a.result() for a in accs.values()]
    return [(list(r.token_ids), r.text, r.finish_reason, r.content) for r in results]


def _llm(batch: int, spec) -> LLM:
    return LLM(str(CKPT), dtype="float32", kv_cache_format="float32", max_batch_size=batch,
               num_kv_pages=64, speculative_config=spec)


def _check_identity(examples: list[data.Example], temperature: float, batch: int,
                    max_tokens: int = MAX_TOKENS) -> None:
    plain = _generate(_llm(batch, None), _jobs(examples, temperature, max_tokens))
    llm = _llm(batch, SPEC)
    spec = _generate(llm, _jobs(examples, temperature, max_tokens))
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert a == b, f"prompt {i} ({examples[i].kind}): plain {a[1]!r} != speculative {b[1]!r}"
    stats = llm.engine.stats
    assert stats.spec_accepted_tokens > 0, "no draft was accepted: speculation did not run"
    assert plain[0][3].startswith('{"city": ')   # the constrained one


def _fast() -> list[data.Example]:
    return [ex for kind in data.KINDS for ex in data.eval_subset(kind, 1, seed=34)]


@pytest.mark.parametrize("temperature, batch", [(0.0, 1), (1.0, 16)])
def test_speculative_equals_plain_one_prompt_per_kind(temperature, batch):
    _check_identity(_fast(), temperature, batch)


def _held_out_200() -> list[data.Example]:
    per = -(-200 // len(data.KINDS))
    exs = [ex for kind in data.KINDS for ex in data.eval_subset(kind, per, seed=34)]
    return exs[:200]


@pytest.mark.slow  # 200 prompts x 4 settings, each decoded twice (up to 32 tokens)
@pytest.mark.parametrize("temperature, batch", [(0.0, 1), (0.0, 16), (1.0, 1), (1.0, 16)])
def test_speculative_equals_plain_on_200_held_out_prompts(temperature, batch):
    _check_identity(_held_out_200(), temperature, batch, MAX_TOKENS_200)
