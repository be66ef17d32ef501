"""Constrained decoding inside the engine on the real model (tiny-random checkpoint, fp32): issue 20.

Random weights carry no structure, so every structure in the outputs comes from the constraint. The
outputs are checked with independent readers: ``json.loads`` + the ``jsonschema`` package, and
m2serve's output parser (docs/parsers.md §3) whose arguments are validated with
``jsonschema`` against each tool's parameters.

* the must-show batch: 300 samples per kind (three response_format schemas, tool_choice required,
  a named tool, tool_choice none), temperature 1.0, max_tokens 256 (128 for tool_choice none),
  reasoning closed by a budget of 16 tokens, ALL kinds in one engine batch (the wall time is printed,
  not asserted: measure it with ``pytest -s``; benchmarks/constrained_step.py times steps);
* preemption keeps the matcher: a constrained request preempted mid-JSON gives the tokens of an
  unpreempted run (greedy, fp32);
* batching invariance: constrained and unconstrained requests mixed in one batch give the tokens
  each gives alone (greedy, fp32).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from m2serve.config.engine_args import EngineArgs
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams
from m2serve.text.constraint import GrammarCompiler, json_spec, no_tool_call_spec, tool_calls_spec
from m2serve.text.parser import parse_output

sys.path.insert(0, str(Path(__file__).parents[1] / "text"))
from test_constraint_sampling import SCHEMAS, TOOLS  # noqa: E402  (the shared bounded schemas and tools)

PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPT = "]~b]user\nhi[e~[\n]~b]ai\n<think>\n"  # a generation prompt: the output starts inside reasoning
PROMPT_TAIL = "]~b]ai\n<think>\n"
N = 300
MAX_TOKENS = 256
# tool_choice none has no end but end of turn, which random logits almost never draw: every one of its
# outputs runs to max_tokens, at the longest contexts of the batch. 128 keeps 300 x 128 tokens drawn
# under the constraint and roughly halves the batch's decode work.
NONE_MAX_TOKENS = 128
BUDGET = 16


@pytest.fixture(scope="module")
def compiler(tiny_random_dir) -> GrammarCompiler:
    return GrammarCompiler.from_pretrained(tiny_random_dir)


def make_engine(model_dir, **kw) -> LLMEngine:
    args = dict(model=str(model_dir), dtype="float32", kv_cache_format="float32", kv_cache_page_size=16,
                num_kv_pages=512)
    args.update(kw)
    return LLMEngine.from_args(EngineArgs(**args))


def run(eng: LLMEngine) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step to completion: request id -> tokens, request id -> finish reason."""
    toks: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return toks, reasons


@pytest.mark.slow  # 1,800 constrained requests in one batch
def test_all_kinds_in_one_batch(tiny_random_dir, compiler):
    eng = make_engine(tiny_random_dir, num_kv_pages=8000, max_batch_size=2048,
                      max_batch_input_tokens=16384)
    ids = compiler.tokenizer.encode(PROMPT)
    kinds = {f"json-{name}": json_spec(schema) for name, schema in SCHEMAS.items()}
    kinds.update(required=tool_calls_spec(TOOLS), named=tool_calls_spec(TOOLS, name="book_table"),
                 none=no_tool_call_spec())
    start = time.perf_counter()
    constraints = {}
    for k, (kind, spec) in enumerate(kinds.items()):
        for i in range(N):
            rid = f"{kind}/{i}"
            constraints[rid] = compiler.constraint(spec, "inside", BUDGET)
            params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0,
                                    max_tokens=NONE_MAX_TOKENS if kind == "none" else MAX_TOKENS,
                                    seed=k * N + i)
            eng.add_request(rid, ids, params, constraint=constraints[rid])
    toks, reasons = run(eng)
    print(f"\n{len(toks)} constrained requests ({len(kinds)} kinds x {N}) in one batch: "
          f"{time.perf_counter() - start:.1f} s, {eng.stats.generated_tokens} tokens, "
          f"{eng.stats.steps} steps")
    errors = [c.error for c in constraints.values() if c.error]
    assert not errors, errors[:3]
    assert all(c.reasoning_tokens <= BUDGET + 3 for c in constraints.values())  # + a character's tail
    decode = compiler.tokenizer.decode
    for name, schema in SCHEMAS.items():
        rids = [f"json-{name}/{i}" for i in range(N)]
        stopped = [r for r in rids if reasons[r] == "stop"]
        assert len(stopped) >= 0.99 * N, name
        for r in stopped:
            parsed = parse_output(decode(toks[r]), None, prompt_tail=PROMPT_TAIL)
            jsonschema.validate(json.loads(parsed.content), schema)
    # every forced turn ends (the call cap bounds it within max_tokens) with valid calls only
    for kind, names, cap in (("required", set(PARAMETERS), 2), ("named", {"book_table"}, 1)):
        for r in (f"{kind}/{i}" for i in range(N)):
            assert reasons[r] == "stop", (r, decode(toks[r]))
            parsed = parse_output(decode(toks[r]), TOOLS, prompt_tail=PROMPT_TAIL)
            assert parsed.finish_reason() == "tool_calls" and 1 <= len(parsed.tool_calls) <= cap
            assert parsed.rejected_tool_calls == 0 and not parsed.parser_error and parsed.content is None
            for call in parsed.tool_calls:
                assert call.name in names
                jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    tag = compiler.tokenizer.tool_call_id
    for i in range(N):
        out = toks[f"none/{i}"]
        assert tag not in out and "<minimax:tool_call>" not in decode(out, skip_special_tokens=False)


LONG_JSON = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 60},
                                              "n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["text", "n"], "additionalProperties": False}


def test_preempted_constrained_request_matches_an_unpreempted_run(tiny_random_dir, compiler):
    ids = compiler.tokenizer.encode(PROMPT)
    greedy = dict(temperature=0.0, max_tokens=120)
    alone = make_engine(tiny_random_dir)
    spec = json_spec(LONG_JSON)
    alone.add_request("c", ids, SamplingParams(**greedy),
                      constraint=compiler.constraint(spec, "inside", BUDGET))
    want = run(alone)[0]["c"]

    # 12 pages of 16 tokens for 4 requests: the newest (the constrained one) is preempted as they grow
    eng = make_engine(tiny_random_dir, num_kv_pages=12)
    for k in range(3):
        eng.add_request(f"u{k}", ids + [100 + k], SamplingParams(temperature=0.0, max_tokens=40,
                                                                 ignore_eos=True))
    c = compiler.constraint(spec, "inside", BUDGET)
    eng.add_request("c", ids, SamplingParams(**greedy), constraint=c)
    toks: dict[str, list[int]] = {}
    preempted_at = None
    computed = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        r = eng.requests.get("c")
        # a preemption (recompute) sends the request back with num_computed_tokens = 0
        if preempted_at is None and r is not None and r.num_computed_tokens < computed:
            preempted_at = (r.num_output_tokens, c.in_reasoning)
        computed = r.num_computed_tokens if r is not None else computed
    assert preempted_at is not None and preempted_at[1] is False   # preempted after the reasoning: mid-JSON
    assert toks["c"] == want
    text = parse_output(compiler.tokenizer.decode(want), None, prompt_tail=PROMPT_TAIL).content
    jsonschema.validate(json.loads(text), LONG_JSON)


def test_constrained_and_unconstrained_batch_invariance(tiny_random_dir, compiler):
    ids = compiler.tokenizer.encode(PROMPT)
    kinds = {"json": json_spec(SCHEMAS["array_of_objects"]), "tools": tool_calls_spec(TOOLS),
             "none": no_tool_call_spec(), "free": None}

    def add(eng, kind, spec):
        c = compiler.constraint(spec, "inside", BUDGET) if spec is not None else None
        eng.add_request(kind, ids, SamplingParams(temperature=0.0, max_tokens=64), constraint=c)

    alone = {}
    for kind, spec in kinds.items():
        eng = make_engine(tiny_random_dir)
        add(eng, kind, spec)
        alone[kind] = run(eng)[0][kind]
    mixed = make_engine(tiny_random_dir)
    for kind, spec in kinds.items():
        add(mixed, kind, spec)
    together = run(mixed)[0]
    assert together == alone
    assert len({tuple(t) for t in alone.values()}) == len(kinds)  # the constraints did change the outputs
