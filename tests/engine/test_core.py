"""Engine plumbing on the toy paged-attention model (tests/engine/conftest.py).

Reference: the same toy model run on the whole sequence in one call with a fresh KV pool for every
token (no paging across steps, no batching, no cache reuse), so any wrong slot, position, block
table, chunk boundary or stale page in the engine changes the tokens. Spec: docs/serving.md §6 (batch
layout), §8 (token budget, chunked prefill, preemption), issue 4 items 1–3.
"""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch

from m2serve.config.engine_args import EngineArgs
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams
from m2serve.model.batch import ForwardBatch, KVStorage

GREEDY = dict(temperature=0.0)


def full_logits(model, config, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] of every position, one call, fresh pool, page size = len."""
    n = len(tokens)
    kv = KVStorage.allocate(1, 1, n, config.num_key_value_heads, config.head_dim, torch.float32)
    batch = ForwardBatch(
        tokens=torch.tensor(tokens), positions=torch.arange(n), input_row_offsets=torch.tensor([0, n]),
        slot_mapping=torch.arange(n), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32), return_n_logits=n)
    return model(batch, kv)


def reference_greedy(model, config, prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(int(full_logits(model, config, seq)[-1].argmax()))
    return seq[len(prompt):]


def make_engine(model, config, **kw) -> LLMEngine:
    args = EngineArgs(dtype="float32", kv_cache_format="float32", **kw)
    return LLMEngine.from_model(model, config, args)


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_batched_chunked_cached_preempted_equals_reference(toy_model, toy_config):
    rng = random.Random(0)
    shared = [rng.randrange(64) for _ in range(20)]
    prompts = {}
    for i in range(12):
        head = shared[:rng.randrange(5, 20)] if i % 2 else []
        prompts[f"r{i}"] = head + [rng.randrange(64) for _ in range(rng.randrange(3, 30))]
    # Tiny pool (10 pages x 4 tokens) and budget 16: chunking, prefix hits and preemption all occur.
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=10,
                      max_batch_input_tokens=16, max_batch_size=6)
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY))
    got = run_all(eng)
    sizes = [b.input_row_offsets.diff().tolist() for b in toy_model.calls]
    st = eng.stats
    assert st.chunked_prefill_steps > 0 and st.preemptions > 0 and st.prefix_cache_hits > 0
    for rid, p in prompts.items():
        assert got[rid] == reference_greedy(toy_model, toy_config, p, 6), rid
    # docs/serving.md §8: every step within the token budget and the batch-size cap; some step mixes a
    # prefill chunk with decodes.
    assert max(sum(s) for s in sizes) <= 16 and max(len(s) for s in sizes) <= 6
    assert any(1 in s and max(s) > 1 for s in sizes)
    # No leaks: every page back in the free queue.
    assert st.kv_pages_free == st.kv_pages_total == 10 and st.kv_pages_used == 0


def test_abort_frees_pages_at_once(toy_model, toy_config):
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=16)
    eng.add_request("a", list(range(10)), SamplingParams(max_tokens=50, ignore_eos=True, **GREEDY))
    eng.add_request("b", list(range(5)), SamplingParams(max_tokens=50, ignore_eos=True, **GREEDY))
    eng.step()
    eng.step()
    assert eng.stats.kv_pages_used == 3 + 2       # 11 and 6 tokens in pages of 4
    eng.abort_request("a")
    outs = eng.step()
    a = [o for o in outs if o.request_id == "a"]
    assert len(a) == 1 and a[0].finished and a[0].finish_reason == "abort"
    assert eng.stats.kv_pages_used == 2 and eng.stats.running == 1
    eng.abort_request("b")
    eng.abort_request("unknown")                  # ignored
    eng.step()
    assert not eng.has_unfinished_requests()
    assert eng.stats.kv_pages_free == 16


def test_too_long_prompt_rejected_with_both_numbers(toy_model, toy_config):
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=8)   # 32 tokens
    assert eng.max_length == 32
    with pytest.raises(ValueError, match=r"33 tokens.*max context of 32"):
        eng.add_request("x", [1] * 33)
    # the one prompt-length rule (engine/request.py, also what every API checks): prompt + 1 <= max context
    with pytest.raises(ValueError, match=r"32 tokens.*max context of 32"):
        eng.add_request("full", [1] * 32)
    eng.add_request("fits", [1] * 31, SamplingParams(max_tokens=1))
    eng.abort_request("fits")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("y", [64])
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("z", [])
    with pytest.raises(ValueError, match="n=2"):
        eng.add_request("n", [1], SamplingParams(n=2))
    eng.add_request("w", [1] * 31, SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("w", [1])
    out = run_all(eng)
    assert len(out["w"]) == 1                     # the context (31 + 1 = 32) is full after one token
    with pytest.raises(ValueError, match="max_length=40 does not fit"):
        make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=8, max_length=40)


def test_stop_token_and_max_tokens(toy_model, toy_config):
    prompt = [3, 1, 4, 1, 5]
    ref = reference_greedy(toy_model, toy_config, prompt, 8)
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=16)
    eng.add_request("s", prompt, SamplingParams(stop_token_ids=[ref[3]], max_tokens=8, **GREEDY))
    eng.add_request("m", prompt, SamplingParams(max_tokens=2, ignore_eos=True, **GREEDY))
    finals = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            finals.setdefault(o.request_id, []).append(o)
    s_tokens = [t for o in finals["s"] for t in o.new_token_ids]
    assert s_tokens == ref[:ref.index(ref[3]) + 1] and finals["s"][-1].finish_reason == "stop"
    assert [t for o in finals["m"] for t in o.new_token_ids] == ref[:2]
    assert finals["m"][-1].finish_reason == "length"


def test_prompt_logprobs_match_full_forward(toy_model, toy_config):
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    lp = torch.log_softmax(full_logits(toy_model, toy_config, prompt), -1)
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=16, max_batch_input_tokens=4)
    eng.add_request("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2, logprobs=1, **GREEDY))
    outs = [o for _ in range(10) for o in eng.step()]
    first = outs[0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        e = first.prompt_logprobs[i]
        assert e.token_id == prompt[i]
        assert e.logprob == pytest.approx(float(lp[i - 1, prompt[i]]), abs=1e-5)
        assert [t for t, _ in e.top] == lp[i - 1].topk(2).indices.tolist()
    assert first.new_logprobs[0].token_id == first.new_token_ids[0] == int(lp[-1].argmax())


def test_add_and_abort_from_other_threads(toy_model, toy_config):
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=64)
    finished: dict[str, str] = {}
    stop = threading.Event()

    def drive():
        while not stop.is_set() or eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    finished[o.request_id] = o.finish_reason

    t = threading.Thread(target=drive)
    t.start()
    for i in range(20):
        # the requests aborted below are long, so that the driving thread cannot finish one between
        # its add and its abort (a 4-token one did once, under load: finish reason "length")
        n = 200 if i % 3 == 0 else 4
        eng.add_request(f"t{i}", [i + 1] * 5, SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY))
        if i % 3 == 0:
            eng.abort_request(f"t{i}")
    stop.set()
    t.join(timeout=30)
    assert not t.is_alive()
    assert sorted(finished) == sorted(f"t{i}" for i in range(20))
    assert all(r == "abort" for k, r in finished.items() if int(k[1:]) % 3 == 0)
    assert eng.stats.kv_pages_free == 64


def test_pool_pages_are_zero_from_the_start(toy_model, toy_config):
    # engine/runner.py zeroed_kv_storage: the whole pool is zero-filled when the engine is built (it
    # is resident from the start; tests/serve/test_cpu_kv_pool.py checks the RSS), so garbage is
    # never readable, and a step leaves pages it did not write at zero.
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=8)
    assert all(not bool(t.any()) for t in (*eng.runner.kv_storage.k, *eng.runner.kv_storage.v))
    eng.add_request("z", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True, **GREEDY))
    eng.step()
    k = eng.runner.kv_storage.k[0]
    assert eng.scheduler.kv.block_table("z") == [0, 1]
    assert bool(k[0].any())                            # written by the prefill
    assert (k[1, 1:] == 0).all()                       # slots 5..7 not written yet: zero
    assert (k[2:] == 0).all()                          # never handed out: zero


def test_multi_rank_model_sets_kv_heads_and_dp_gets_a_pool_per_replica(toy_model, toy_config):
    # parallel/worker.py DistributedModel: rank 0's pool holds Hkv / tp heads; DP replicas each get a
    # scheduler over their own pool of num_kv_pages pages, prefix caching on (docs/serving.md §8)
    toy_model.num_kv_heads = 1
    toy_model.data_parallel_degree = 2
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=4)
    assert eng.runner.kv_storage.k[0].shape == (4, 4, 1, toy_config.head_dim)
    assert len(eng.schedulers) == 2 and eng.schedulers[0].kv is not eng.schedulers[1].kv
    assert all(s.kv.enable_prefix_caching and s.kv.num_pages == 4 for s in eng.schedulers)
    assert eng.stats.kv_pages_total == 8 and [r.kv_pages_total for r in eng.stats.replicas] == [4, 4]


@pytest.mark.parametrize("max_length", [0, -3])
def test_non_positive_max_length_is_refused(toy_model, toy_config, max_length):
    # adversarial: `--max-length -3 --num-kv-pages N` skips the planner; the engine itself must refuse
    # it rather than serve with a negative context (docs/serving.md §7, bad input names the field)
    with pytest.raises(ValueError, match=f"max_length={max_length} must be a positive integer"):
        make_engine(toy_model, toy_config, num_kv_pages=8, kv_cache_page_size=4, max_length=max_length)


def splitmix64_uniform(seed: int, position: int) -> float:
    """Reference uniform: output position + 1 of SplitMix64 (Steele, Lea, Flood 2014) seeded with
    ``seed``, top 24 bits / 2**24 (the sampler's documented stream), in Python ints."""
    M = 2 ** 64 - 1
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return ((z ^ (z >> 31)) >> 40) / 2 ** 24


def reference_seeded(model, config, prompt: list[int], seed: int, n: int, top_k: int) -> list[int]:
    """Full-forward reference of a seeded top-k draw (docs/serving.md §10): keep the k largest logits,
    take the first token id whose cumulative probability exceeds u(seed, output position)."""
    seq = list(prompt)
    for i in range(n):
        row = full_logits(model, config, seq)[-1].tolist()
        kth = sorted(row, reverse=True)[top_k - 1]
        w = [math.exp(x - max(row)) if x >= kth else 0.0 for x in row]
        u, acc = splitmix64_uniform(seed, i) * sum(w), 0.0
        seq.append(next(t for t, x in enumerate(w) if (acc := acc + x) > u))
    return seq[len(prompt):]


def test_seeded_request_same_tokens_alone_and_in_a_mixed_batch(toy_model, toy_config):
    prompt = [5, 9, 2, 7, 1, 3]
    target = SamplingParams(seed=1234, top_k=20, max_tokens=8, ignore_eos=True)
    alone = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=32)
    alone.add_request("t", prompt, target)
    got_alone = run_all(alone)["t"]
    assert got_alone == reference_seeded(toy_model, toy_config, prompt, 1234, 8, 20)
    # crowd: prefill chunks next to decodes, penalties, greedy, unseeded and other-seed rows, and
    # a late arrival, under a budget that splits prompts
    mixed = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=32,
                        max_batch_input_tokens=12)
    mixed.add_request("long", list(range(20)), SamplingParams(max_tokens=6, ignore_eos=True, seed=1))
    mixed.add_request("g", [4, 4, 4], SamplingParams(max_tokens=9, ignore_eos=True, **GREEDY))
    mixed.add_request("t", prompt, target)
    mixed.add_request("pen", [1, 2, 3, 4], SamplingParams(max_tokens=7, ignore_eos=True, presence_penalty=1.5,
                                                          frequency_penalty=0.5, repetition_penalty=1.3))
    got: dict[str, list[int]] = {}
    for o in mixed.step():
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
    mixed.add_request("late", list(range(30, 41)), SamplingParams(max_tokens=5, ignore_eos=True, top_p=0.5))
    for rid, toks in run_all(mixed).items():
        got.setdefault(rid, []).extend(toks)
    assert mixed.stats.chunked_prefill_steps > 0
    assert got["t"] == got_alone


def run_outputs(eng) -> dict[str, list]:
    """Step to completion; request id -> its RequestOutputs."""
    finals: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            finals.setdefault(o.request_id, []).append(o)
    return finals


class OnlyThenEos:
    """A hand-written constraint (engine/constraint.py): tokens from ``allowed`` for ``n`` draws,
    then only ``eos``; terminated once eos was accepted. Records what it accepted."""

    def __init__(self, allowed: set[int], n: int, eos: int):
        self.allowed, self.n, self.eos = allowed, n, eos
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        ok = self.allowed if len(self.accepted) < self.n else {self.eos}
        words = [0] * bitmask.shape[1]
        for t in ok:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([w - 2 ** 32 if w >= 2 ** 31 else w for w in words], dtype=torch.int32)

    def accept_token(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == self.eos

    def only_end_of_turn(self) -> bool:
        return len(self.accepted) >= self.n


def test_constraint_masks_draws_and_finishes_the_request(toy_model, toy_config):
    prompt = [3, 1, 4, 1, 5]
    free = reference_greedy(toy_model, toy_config, prompt, 4)
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=16)
    c = OnlyThenEos({3, 5}, 2, eos=63)
    eng.add_request("c", prompt, SamplingParams(max_tokens=10, logprobs=5, **GREEDY), constraint=c)
    eng.add_request("free", prompt, SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY))
    finals: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            finals.setdefault(o.request_id, []).append(o)
    toks = [t for o in finals["c"] for t in o.new_token_ids]
    # greedy within {3, 5}: the larger of the two full-forward logits, twice; then eos (63)
    seq = list(prompt)
    for _ in range(2):
        row = full_logits(toy_model, toy_config, seq)[-1]
        seq.append(3 if row[3] >= row[5] else 5)
    assert toks == seq[len(prompt):] + [63] and c.accepted == toks
    assert finals["c"][-1].finish_reason == "stop"
    lps = [lp for o in finals["c"] for lp in o.new_logprobs]
    assert {t for t, _ in lps[0].top} <= {3, 5} and lps[2].logprob == 0.0   # constrained distribution
    assert [t for o in finals["free"] for t in o.new_token_ids] == free   # its neighbour is unconstrained


@pytest.mark.parametrize("extra", [dict(min_tokens=8), dict(ignore_eos=True),
                                   dict(min_tokens=8, ignore_eos=True)])
def test_min_tokens_and_ignore_eos_yield_to_a_constraint_that_allows_only_end_of_turn(toy_model, toy_config,
                                                                                       extra):
    # issue 20: once the grammar allows only end of turn, the min_tokens eos mask yields (else the row
    # would be all -inf) and ignore_eos does not keep the request going: it finishes with "stop"
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=16)
    c = OnlyThenEos({3, 5}, 2, eos=63)
    eng.add_request("c", [3, 1, 4], SamplingParams(max_tokens=10, stop_token_ids=[63], temperature=1.0,
                                                   seed=7, logprobs=1, **extra), constraint=c)
    finals = run_outputs(eng)["c"]
    toks = [t for o in finals for t in o.new_token_ids]
    assert toks[:2] and set(toks[:2]) <= {3, 5} and toks[2:] == [63]
    assert finals[-1].finish_reason == "stop"
    lps = [lp for o in finals for lp in o.new_logprobs]
    assert all(math.isfinite(lp.logprob) for lp in lps) and lps[2].logprob == 0.0  # the only allowed token


class FailsAfter(OnlyThenEos):
    """A constraint whose grammar fails (allows nothing) after ``n`` tokens: as GrammarConstraint does,
    it then allows only end of turn and reports itself terminated once that token is accepted."""

    def is_terminated(self) -> bool:
        return len(self.accepted) > self.n


def test_a_failed_constraint_finishes_with_stop_not_nan(toy_model, toy_config):
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=16)
    c = FailsAfter({7}, 1, eos=63)
    eng.add_request("c", [3, 1, 4], SamplingParams(max_tokens=10, min_tokens=5, logprobs=1, temperature=1.0,
                                                   stop_token_ids=[63],
                                                   seed=1), constraint=c)
    finals = run_outputs(eng)["c"]
    assert [t for o in finals for t in o.new_token_ids] == [7, 63]
    assert finals[-1].finish_reason == "stop"
    assert all(math.isfinite(lp.logprob) for o in finals for lp in o.new_logprobs)


@pytest.mark.parametrize("params", [
    dict(temperature=5.0, top_k=0, top_p=1.0, logit_bias={9: 100.0, 11: 100.0}),
    dict(temperature=1.0, top_k=1, logit_bias={9: 100.0}, repetition_penalty=0.05),
    dict(temperature=0.0, logit_bias={11: 100.0}, presence_penalty=-2.0, frequency_penalty=-2.0),
    dict(temperature=1.0, top_p=0.01, min_p=0.9, logit_bias={9: 100.0}),
])
def test_forbidden_tokens_are_never_drawn_whatever_the_sampling_parameters(toy_model, toy_config, params):
    # issue 20: the mask comes after logit_bias and penalties and before temperature / top-k / top-p /
    # min-p, so a token the constraint forbids (9, 11 boosted by +100) is never drawn
    eng = make_engine(toy_model, toy_config, kv_cache_page_size=4, num_kv_pages=64)
    cs = [OnlyThenEos({3, 5, 7}, 12, eos=63) for _ in range(6)]
    for i, c in enumerate(cs):
        eng.add_request(f"c{i}", [9, 11, 9], SamplingParams(max_tokens=20, seed=i, stop_token_ids=[63],
                                                            **params), constraint=c)
    outs = run_outputs(eng)
    for i, c in enumerate(cs):
        toks = [t for o in outs[f"c{i}"] for t in o.new_token_ids]
        assert set(toks[:12]) <= {3, 5, 7} and toks[12:] == [63] and c.accepted == toks


def test_metrics_have_one_labelled_series_per_replica(toy_model, toy_config):
    # /metrics (serve/metrics.py): KV usage, running and waiting per replica, labelled
    from m2serve.serve.metrics import ServerMetrics

    toy_model.data_parallel_degree = 2
    engine = make_engine(toy_model, toy_config, num_kv_pages=8, kv_cache_page_size=4)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    m = ServerMetrics()
    m.set_engine(engine.stats)
    text = m.render().decode()
    assert [engine.requests[r].replica for r in ("a", "b")] == [0, 1]
    for replica, used in (("0", 2), ("1", 1)):   # pages of 4 tokens: 5 + 1 and 2 + 1 tokens
        assert f'm2serve_replica_kv_pages_used{{replica="{replica}"}} {used:.1f}' in text
        assert f'm2serve_replica_kv_pages_free{{replica="{replica}"}} {8 - used:.1f}' in text
        assert f'm2serve_replica_num_requests_running{{replica="{replica}"}} 1.0' in text
        assert f'm2serve_replica_num_requests_waiting{{replica="{replica}"}} 0.0' in text
    assert "m2serve_kv_pages_used 3.0" in text
