"""Speculative decoding (issue 34, docs/serving.md §13): the config, the n-gram proposer, the two
acceptance rules, the KV tail trim, and the engine on the toy model (tests/engine/conftest.py).

References: the proposer, acceptance and rejection-rule cases are derived by hand in the comments;
the engine runs are compared with plain decoding of the same requests and seeds (speculation off),
whose own correctness tests/engine/test_core.py checks against whole-sequence recomputation.
"""

from __future__ import annotations

import random

import pytest
import torch

from m2serve.config.engine_args import (
    DEFAULT_PROMPT_LOOKUP,
    MAX_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
    EngineArgs,
    SpeculativeConfig,
    parse_speculative_config,
)
from m2serve.engine.core import LLMEngine
from m2serve.engine.kv_cache import KVCacheManager
from m2serve.engine.sampling import SamplingParams
from m2serve.engine.speculative import NgramIndex, accepted_length, propose_ngram, rejection_sample

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ---- config ---------------------------------------------------------------------------------------
def test_config_shapes_and_defaults():
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert c == SpeculativeConfig("ngram", 3, *DEFAULT_PROMPT_LOOKUP)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 5}) == SpeculativeConfig("ngram", 2, 5, 5)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 3}) == SpeculativeConfig("ngram", 2, 3, 3)
    assert parse_speculative_config(c) == c   # a SpeculativeConfig passes its own check
    assert c.describe() == "ngram k=3 lookup 2..4"


@pytest.mark.parametrize("value, field", [
    ('{"method": "medusa", "num_speculative_tokens": 3}', "speculative_config.method"),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "speculative_config.model"),
    ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 33}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
     "speculative_config.prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "speculative_config.prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "speculative_config.model"),
    ('{"method": ', "speculative_config"),
    ("[1]", "speculative_config"),
    # a SpeculativeConfig built directly is checked too (K = 33 would outgrow the constraint's
    # rollback history, text/constraint.py)
    (SpeculativeConfig("ngram", MAX_SPECULATIVE_TOKENS + 1, 2, 4),
     "speculative_config.num_speculative_tokens"),
    (SpeculativeConfig("ngram", 4, 3, 2), "speculative_config.prompt_lookup_min"),
    (SpeculativeConfig("ngram", 4, 2, MAX_PROMPT_LOOKUP + 1), "speculative_config.prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 33}',
     "speculative_config.prompt_lookup_min"),
])
def test_config_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_speculative_config(value)


def test_engine_refuses_a_bad_config_before_loading():
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLMEngine.from_args(EngineArgs(model="/nonexistent", speculative_config={"method": "x"}))


# ---- proposer -------------------------------------------------------------------------------------
def test_propose_ngram_hand_derived():
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    # suffix [1, 2, 3] (n = 3) occurs at 0..2, followed by 4 5 9 1 ...
    assert propose_ngram(seq, 3, 1, 3) == [4, 5, 9]
    assert propose_ngram(seq, 10, 1, 3) == [4, 5, 9, 1, 2, 3]  # stops where the sequence ends
    # the most recent earlier occurrence wins: [7, 8] at 0 (-> 1) and at 3 (-> 2)
    assert propose_ngram([7, 8, 1, 7, 8, 2, 7, 8], 2, 2, 2) == [2, 7]
    # the longest n wins over a more recent shorter match: [5, 6] matches at 0 (-> 1), [6] alone at 4 (-> 3)
    assert propose_ngram([5, 6, 1, 0, 6, 3, 5, 6], 1, 1, 2) == [1]
    assert propose_ngram([5, 6, 1, 0, 6, 3, 5, 6], 1, 1, 1) == [3]
    # n below prompt_lookup_min never matches
    assert propose_ngram([5, 6, 1, 0, 6, 3, 9, 6], 1, 2, 3) == []
    # an occurrence overlapping the suffix counts: [4, 4, 4] -> suffix [4, 4] at 0..1, next 4
    assert propose_ngram([4, 4, 4], 5, 1, 2) == [4]
    assert propose_ngram([1, 2, 3], 4, 1, 3) == [] and propose_ngram([1], 4, 1, 3) == []
    assert propose_ngram(seq, 0, 1, 3) == []


@pytest.mark.parametrize("vocab,min_n,max_n,k", [(2, 1, 3, 4), (3, 2, 4, 4), (5, 1, 1, 2), (4, 3, 6, 3),
                                                 (50, 2, 4, 5)])
def test_ngram_index_equals_the_scan_step_by_step(vocab, min_n, max_n, k):
    """The engine's incremental index against the scanning oracle, after every appended token (and
    after several at once, as an accepted draft appends them) on random sequences with repeats: a
    small vocabulary repeats n-grams constantly, copied spans repeat long ones."""
    g = torch.Generator().manual_seed(vocab * 100 + min_n * 10 + max_n)
    for trial in range(6):
        seq = torch.randint(vocab, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        idx = NgramIndex(min_n, max_n)
        matched = 0
        while len(seq) < 260:
            kk = int(torch.randint(0, k + 1, (1,), generator=g))
            want = propose_ngram(seq, kk, min_n, max_n)
            assert idx.propose(seq, kk) == want, (trial, len(seq))
            matched += bool(want)
            r = float(torch.rand(1, generator=g))
            if r < 0.3 and len(seq) > 8:   # copy an earlier span (what prompt lookup finds)
                a = int(torch.randint(len(seq) - 8, (1,), generator=g))
                seq += seq[a:a + int(torch.randint(1, 8, (1,), generator=g))]
            else:
                m = int(torch.randint(1, 4, (1,), generator=g))
                seq += torch.randint(vocab, (m,), generator=g).tolist()
        assert matched > 10   # the comparison covered drafts, not only empty ones
    # a list that does not continue the indexed one is re-indexed
    idx = NgramIndex(1, 2)
    assert idx.propose([1, 2, 3, 1, 2, 3], 2) == [1, 2]   # [2, 3] at 1..2, then 1 2
    assert idx.propose([7, 8, 7], 2) == propose_ngram([7, 8, 7], 2, 1, 2) == [8, 7]
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)


def test_accepted_length():
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1   # stops at the first mismatch
    assert accepted_length([5, 6, 7], [1, 6, 7, 8]) == 0
    assert accepted_length([], [3]) == 0
    with pytest.raises(ValueError, match="K \\+ 1"):
        accepted_length([1, 2], [1, 2])


# ---- the standard rule (Leviathan et al.) ---------------------------------------------------------
def test_rejection_sample_hand_derived():
    # V = 3. Draft x0 = 0 with q0 = (0.5, 0.25, 0.25), target p0 = (0.25, 0.5, 0.25): p/q = 0.5.
    q = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.6, 0.2]])
    p = torch.tensor([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    # u = 0.4 < 0.5: accepted. Draft x1 = 1: p/q = 0.3 / 0.6 = 0.5, u = 0.7: rejected; residual
    # max(0, p1 - q1) = (0, 0, 0.3) -> token 2 whatever the uniform.
    assert rejection_sample([0, 1], q, p, [0.4, 0.7], [0.0, 0.99, 0.5]) == [0, 2]
    # u0 = 0.6 >= 0.5: rejected at 0; residual (0, 0.25, 0) -> token 1.
    assert rejection_sample([0, 1], q, p, [0.6, 0.0], [0.3, 0.0, 0.0]) == [1]
    # both accepted (0.1 < 0.5, 0.2 < 0.5): bonus from p2 = (0.1, 0.1, 0.8) by inverse CDF:
    # u = 0.15 -> cumulative 0.1, 0.2 -> token 1; u = 0.05 -> token 0; u = 0.5 -> token 2.
    assert rejection_sample([0, 1], q, p, [0.1, 0.2], [0.0, 0.0, 0.15]) == [0, 1, 1]
    assert rejection_sample([0, 1], q, p, [0.1, 0.2], [0.0, 0.0, 0.05]) == [0, 1, 0]
    assert rejection_sample([0, 1], q, p, [0.1, 0.2], [0.0, 0.0, 0.5]) == [0, 1, 2]
    # p >= q at the drafted token: always accepted (ratio >= 1 > any u)
    assert rejection_sample([1], q[:1], p[:2], [0.999], [0.0, 0.05]) == [1, 0]
    with pytest.raises(ValueError, match="K \\+ 1"):
        rejection_sample([0], q[:1], p[:1], [0.1], [0.1, 0.1])


def test_rejection_sample_output_is_distributed_as_the_target():
    # Leviathan et al. Theorem 1: with uniform u's the first emitted token ~ p0, whatever q0.
    # Exact expectation over a grid of the two uniforms (V = 3, K = 1).
    q = torch.tensor([[0.7, 0.2, 0.1]])
    p = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    counts = torch.zeros(3)
    G = 80
    grid = [(i + 0.5) / G for i in range(G)]
    for x, qx in enumerate(q[0].tolist()):   # the draft's own token, drawn with probability q(x)
        for ua in grid:
            for ur in grid:
                counts[rejection_sample([x], q, p, [ua], [ur, 0.0])[0]] += qx
    assert torch.allclose(counts / G ** 2, p[0], atol=0.02)   # grid resolution 1/G


# ---- KV tail trim ---------------------------------------------------------------------------------
def test_kv_trim_releases_the_tail_only():
    kv = KVCacheManager(num_pages=8, page_size=4)
    assert kv.allocate("a", 13)                     # 4 pages
    table = list(kv.block_table("a"))
    kv.trim("a", 9)                                 # 9 tokens need 3 pages
    assert kv.block_table("a") == table[:3] and kv.num_free_pages == 5
    kv.trim("a", 12)                                # never grows
    assert kv.block_table("a") == table[:3]
    assert next(iter(kv.free_queue)) == table[3]    # no hash: reused first
    kv.trim("missing", 1)


# ---- the engine on the toy model ------------------------------------------------------------------
def _engine(model, config, spec, **kw) -> LLMEngine:
    args = dict(dtype="float32", kv_cache_format="float32", kv_cache_page_size=4, num_kv_pages=256,
                speculative_config=spec)
    args.update(kw)
    return LLMEngine.from_model(model, config, EngineArgs(**args))


def _run(engine: LLMEngine, requests) -> tuple[dict, dict, dict]:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    toks, lps, reasons = {}, {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_logprobs is not None:
                lps.setdefault(o.request_id, []).extend(o.new_logprobs)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return toks, lps, reasons


def _requests(params_of, n=6, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(64) for _ in range(5)]
        prompt = (motif * 6)[:rng.randrange(12, 30)] + [rng.randrange(64) for _ in range(3)]
        out.append((f"r{i}", prompt, params_of(i)))
    return out


PARAMS = {
    "greedy": lambda i: SamplingParams(temperature=0.0, max_tokens=40),
    "t1": lambda i: SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=40, seed=100 + i),
    "t07-topk-topp-minp": lambda i: SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05,
                                                   max_tokens=40, seed=i),
    "penalties": lambda i: SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                                          frequency_penalty=0.4, max_tokens=40),
    "penalties-t1": lambda i: SamplingParams(temperature=1.0, frequency_penalty=0.8, max_tokens=40, seed=i),
    "bias-min-stop": lambda i: SamplingParams(temperature=0.0, logit_bias={3: 4.0, 7: -100}, min_tokens=6,
                                              stop_token_ids=(3, 11), max_tokens=30),
    "logprobs": lambda i: SamplingParams(temperature=1.0, logprobs=3, max_tokens=20, seed=i),
    "thinking": lambda i: SamplingParams(temperature=1.0, thinking_temperature=0.0, start_in_reasoning=True,
                                         reasoning_end_token_ids=(5, 9), max_tokens=40, seed=i),
    "max_tokens_1": lambda i: SamplingParams(temperature=0.0, max_tokens=1),
}


@pytest.mark.parametrize("kind", list(PARAMS))
def test_speculative_equals_plain_on_the_toy_model(toy_model, toy_config, kind):
    reqs = _requests(PARAMS[kind])
    plain = _run(_engine(toy_model, toy_config, None), reqs)
    eng = _engine(toy_model, toy_config, NGRAM)
    spec = _run(eng, reqs)
    assert spec[0] == plain[0] and spec[2] == plain[2]
    for rid, entries in plain[1].items():
        for a, b in zip(entries, spec[1][rid], strict=True):
            assert a.token_id == b.token_id and a.rank == b.rank
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    st = eng.stats
    assert st.spec_accepted_tokens <= st.spec_draft_tokens
    assert st.spec_accepted_tokens == sum(st.spec_accepted_per_pos)
    assert st.generated_tokens == sum(len(t) for t in plain[0].values())
    assert st.kv_pages_used == 0   # every page came back, trimmed tails included
    if kind not in ("max_tokens_1",):
        assert st.spec_drafts > 0 and st.spec_accepted_tokens > 0, "the test must exercise acceptance"


def test_speculative_steps_are_fewer_and_verify_k_plus_1_rows(toy_model, toy_config):
    reqs = _requests(PARAMS["greedy"], n=1)
    plain_eng = _engine(toy_model, toy_config, None)
    _run(plain_eng, reqs)
    toy_model.calls.clear()
    eng = _engine(toy_model, toy_config, NGRAM)
    _run(eng, reqs)
    st = eng.stats
    assert st.steps == plain_eng.stats.steps - st.spec_accepted_tokens
    drafted = [b for b in toy_model.calls if b.host.logit_counts[0] > 1]
    assert drafted and all(b.host.query_lens[0] == b.host.logit_counts[0] for b in drafted)


def test_budget_and_preemption_with_drafts(toy_model, toy_config):
    # a tiny pool forces preemption; a small token budget caps the drafts; tokens stay the plain ones
    reqs = _requests(PARAMS["t1"], n=8, seed=3)
    kw = dict(num_kv_pages=24, max_batch_input_tokens=24)
    plain = _run(_engine(toy_model, toy_config, None, **kw), reqs)
    eng = _engine(toy_model, toy_config, NGRAM, **kw)
    spec = _run(eng, reqs)
    assert spec[0] == plain[0]
    assert eng.stats.preemptions > 0 and eng.stats.spec_accepted_tokens > 0
    assert eng.stats.kv_pages_used == 0


def test_engine_drafts_are_the_scans_and_the_index_goes_with_the_request(toy_model, toy_config, monkeypatch):
    # every draft the scheduler takes from a request's NgramIndex (across preemptions, with the
    # budget's caps) is what the scanning oracle drafts for the same tokens; finish drops the index
    calls, requests = [], set()
    propose = NgramIndex.propose

    def checked(self, token_ids, k):
        got = propose(self, token_ids, k)
        want = propose_ngram(token_ids, k, NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"])
        calls.append(got == want)
        return got

    monkeypatch.setattr(NgramIndex, "propose", checked)
    eng = _engine(toy_model, toy_config, NGRAM, num_kv_pages=24, max_batch_input_tokens=24)
    finish = type(eng.schedulers[0]).finish

    def finish_and_look(self, request, reason):
        finish(self, request, reason)
        requests.add(request.request_id)
        assert request.ngram_index is None

    monkeypatch.setattr(type(eng.schedulers[0]), "finish", finish_and_look)
    _run(eng, _requests(PARAMS["t1"], n=8, seed=3))
    assert len(calls) > 50 and all(calls) and len(requests) == 8
    assert eng.stats.preemptions > 0 and eng.stats.spec_accepted_tokens > 0


def test_prefix_cache_never_holds_a_draft(toy_model, toy_config):
    # the same prompt twice, one after the other: the second hits the first's pages, computed from
    # emitted tokens only, and decodes the same tokens
    prompt = [1, 2, 3, 4, 5] * 5
    eng = _engine(toy_model, toy_config, NGRAM)
    first = _run(eng, [("a", prompt, SamplingParams(temperature=0.0, max_tokens=30))])[0]["a"]
    second = _run(eng, [("b", prompt + first[:20], SamplingParams(temperature=0.0, max_tokens=10))])[0]["b"]
    plain = _run(_engine(toy_model, toy_config, None),
                 [("b", prompt + first[:20], SamplingParams(temperature=0.0, max_tokens=10))])[0]["b"]
    assert second == plain and eng.stats.prefix_cache_hits > 0


class _EvenOnly:
    """A toy constraint (engine/constraint.py protocol): only even tokens, then after 24 tokens only the
    end token 0; counts rollbacks."""

    def __init__(self):
        self.accepted: list[int] = []
        self.rollbacks = 0

    def fill_bitmask(self, bitmask, row):
        words = bitmask[row]
        if len(self.accepted) >= 24:
            words.zero_()
            words[0] = 1
        else:
            words.fill_(0x55555555)   # bits 0, 2, 4, ...: even ids
            words[0] &= ~1            # never 0 before the end

    def accept_token(self, token_id):
        self.accepted.append(token_id)

    def is_terminated(self):
        return bool(self.accepted) and self.accepted[-1] == 0

    def only_end_of_turn(self):
        return len(self.accepted) >= 24

    def rollback(self, n):
        self.rollbacks += 1
        del self.accepted[len(self.accepted) - n:]


def test_constraint_rows_and_rollback(toy_model, toy_config):
    prompt = [2, 4, 6, 8] * 6
    out = {}
    for name, spec in (("plain", None), ("spec", NGRAM)):
        eng = _engine(toy_model, toy_config, spec)
        c = _EvenOnly()
        eng.add_request("c", prompt, SamplingParams(temperature=0.0, max_tokens=40), constraint=c)
        out[name] = (_run(eng, [])[0]["c"], c.accepted, c.rollbacks, eng.stats.spec_accepted_tokens)
    assert out["spec"][0] == out["plain"][0] and out["spec"][1] == out["plain"][1]
    assert out["plain"][0][-1] == 0 and all(t % 2 == 0 for t in out["plain"][0])
    assert out["spec"][2] > 0 and out["spec"][3] > 0


def test_drafts_never_cost_a_later_request_its_decode_page():
    # Hand-derived (page size 4, 3 pages): after the prefills a = [1, 2, 1] + [2] (1 page, 3 computed)
    # and b = [7, 8, 9, 10] + [2] (1 page, 4 computed) leave one free page. a's decode fits its page;
    # its n-gram draft is [1, 2] (the bigram [1, 2] at 0 is followed by 1, 2) and would take the free
    # page for positions 4-5; b's decode (position 4) needs that page. Plain decoding preempts
    # nobody, so the drafts must be dropped rather than b preempted (docs/serving.md §13).
    from m2serve.config.model_config import GenerationDefaults
    from m2serve.engine.request import Request
    from m2serve.engine.sampling import SamplerOutput, SamplingState
    from m2serve.engine.scheduler import Scheduler

    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0).resolved(GenerationDefaults())
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    sched = Scheduler(KVCacheManager(num_pages=3, page_size=4), max_batch_input_tokens=16, max_batch_size=4,
                      speculative=spec)
    a = Request("a", [1, 2, 1], SamplingState.new(params), arrival=0, max_length=64)
    b = Request("b", [7, 8, 9, 10], SamplingState.new(params), arrival=1, max_length=64)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3), ("b", 4)]
    sched.update_from_output(out.scheduled, SamplerOutput([2, 2], [None, None]))
    out = sched.schedule()
    assert out.preempted == []
    assert [(s.request.request_id, s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == \
        [("a", 1, []), ("b", 1, [])]
