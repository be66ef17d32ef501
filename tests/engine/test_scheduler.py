"""Exact scheduling decisions, no model (vLLM tests/v1/core style): token budget, chunking,
preemption of the newest request by recompute, prefix hits at re-admission, and the post-model
update (``Scheduler.update_from_output``: tokens, penalty counts, reasoning state, constraint,
finish), driven directly.

Spec: docs/serving.md §8 (all tokens of a step, decodes included, within max_batch_input_tokens;
preemption frees pages and requeues), §7 (full pages only), §10 (stop conditions, penalties).
Expected values derived by hand below.
"""

from __future__ import annotations

import pytest
import torch

from m2serve.config.model_config import GenerationDefaults
from m2serve.engine.kv_cache import KVCacheManager
from m2serve.engine.request import Request, RequestStatus
from m2serve.engine.sampling import (
    PenaltyState,
    SamplerOutput,
    SamplingBatch,
    SamplingParams,
    SamplingState,
    sample,
)
from m2serve.engine.scheduler import Scheduler

PARAMS = SamplingParams(temperature=0.0, top_p=1.0, top_k=0)


def req(rid: str, prompt: list[int], arrival: int, params: SamplingParams = PARAMS, eos=(),
        max_length: int = 64, constraint=None) -> Request:
    state = SamplingState.new(params.resolved(GenerationDefaults()), eos)
    return Request(rid, prompt, state, arrival=arrival, max_length=max_length, constraint=constraint)


def finish_step(sched: Scheduler, out, next_token: int = 9) -> list[Request]:
    """The post-model update with ``next_token`` drawn for every request whose chunk completed."""
    n = sum(s.completes for s in out.scheduled)
    return sched.update_from_output(out.scheduled, SamplerOutput([next_token] * n, [None] * n))


def plan(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_budget_counts_decodes_and_chunks_prompts():
    kv = KVCacheManager(num_pages=16, page_size=4)
    sched = Scheduler(kv, max_batch_input_tokens=8, max_batch_size=4)
    a, b, c = req("a", list(range(10)), 0), req("b", list(range(20, 26)), 1), req("c", [40, 41, 42], 2)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert plan(out) == [("a", 8)]                       # a's prompt chunked: 8 of 10
    finish_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 2), ("b", 6)]             # a finishes its prompt, b fills the budget
    finish_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1), ("c", 3)]   # two decodes + c's whole prompt
    assert sched.stats.chunked_prefill_steps == 1
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]


def test_max_batch_size_caps_running_requests():
    kv = KVCacheManager(num_pages=16, page_size=4)
    sched = Scheduler(kv, max_batch_input_tokens=64, max_batch_size=2)
    for i in range(3):
        sched.add(req(f"r{i}", [i, i + 1], i))
    out = sched.schedule()
    assert plan(out) == [("r0", 2), ("r1", 2)]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_preempts_newest_then_readmits_with_its_cached_first_page():
    kv = KVCacheManager(num_pages=4, page_size=4)         # 16 token slots
    sched = Scheduler(kv, max_batch_input_tokens=16, max_batch_size=4)
    a, b = req("a", list(range(7)), 0), req("b", list(range(100, 107)), 1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 7), ("b", 7)]
    assert kv.block_table("a") == [0, 1] and kv.block_table("b") == [2, 3]
    finish_step(sched, out)                              # 8 tokens each, 7 computed
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]             # 8 tokens still fit in 2 pages
    finish_step(sched, out)                              # 9 tokens each; pages 0-3 full and cached
    out = sched.schedule()
    # a needs a third page, none free: the newest running request (b) is preempted by recompute.
    assert plan(out) == [("a", 1)] and [r.request_id for r in out.preempted] == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_tokens == 9
    # b's pages were freed tail first (3 then 2, both hashed -> queue tail); a took page 3.
    assert kv.block_table("a") == [0, 1, 3] and list(kv.free_queue) == [2]
    assert sched.stats.preemptions == 1
    finish_step(sched, out)
    out = sched.schedule()
    # b would hit its first page (page 2) but needs 2 more pages: it keeps waiting.
    assert plan(out) == [("a", 1)] and [r.request_id for r in sched.waiting] == ["b"]
    finish_step(sched, out)
    sched.finish(a, "abort")
    assert kv.num_free_pages == 4
    out = sched.schedule()
    # Re-admitted: 4 tokens from the prefix cache (its own page 2), 5 recomputed.
    assert plan(out) == [("b", 5)] and b.num_computed_tokens == 4
    assert kv.block_table("b")[0] == 2
    assert kv.stats.hits == 4


# --- the post-model update: Scheduler.update_from_output ---------------------------------------

def drive(sched: Scheduler, logits: torch.Tensor, steps: int) -> None:
    """``steps`` engine steps without a model: every completing request samples from ``logits`` [V]."""
    for _ in range(steps):
        out = sched.schedule()
        done = [s.request for s in out.scheduled if s.completes]
        batch = SamplingBatch.build([r.state for r in done], [r.num_output_tokens for r in done],
                                    logits.shape[0])
        sched.update_from_output(out.scheduled, sample(logits.repeat(len(done), 1), batch, sched.penalties))


def test_update_advances_caches_pages_and_appends_to_the_one_token_list():
    kv = KVCacheManager(num_pages=8, page_size=4)
    sched = Scheduler(kv, max_batch_input_tokens=6, max_batch_size=4)
    a = req("a", list(range(10)), 0)
    sched.add(a)
    out = sched.schedule()
    assert finish_step(sched, out) == []            # chunk of 6: nothing sampled
    assert a.num_computed_tokens == 6 and len(kv.cached) == 1 and a.num_tokens == 10
    out = sched.schedule()
    assert finish_step(sched, out, next_token=42) == [a]
    assert a.num_computed_tokens == 10 and len(kv.cached) == 2
    assert a.all_token_ids == list(range(10)) + [42] and a.output_token_ids == [42]
    with pytest.raises(ValueError, match="2 sampled tokens for 1 requests"):
        sched.update_from_output(sched.schedule().scheduled, SamplerOutput([1, 2], [None, None]))


@pytest.mark.parametrize("kw, tokens, want", [
    (dict(), [1, 7], "stop"),                                    # eos
    (dict(stop_token_ids=[5]), [5], "stop"),                     # a stop id
    (dict(ignore_eos=True, stop_token_ids=[5], max_tokens=3), [7, 5], "stop"),  # eos ignored, stop id not
    (dict(ignore_eos=True, max_tokens=3), [7, 2, 2], "length"),  # max_tokens
    (dict(max_tokens=50), [1, 2, 3, 4, 5], "length"),           # the max context: 3 + 5 = 8
])
def test_finish_reasons_decided_once_and_the_request_freed(kw, tokens, want):
    kv = KVCacheManager(num_pages=8, page_size=4)
    sched = Scheduler(kv, max_batch_input_tokens=16, max_batch_size=4)
    r = req("r", [0, 1, 2], 0, SamplingParams(**kw), eos=(7,), max_length=8)
    sched.add(r)
    for t in tokens:
        assert r.finish_reason is None
        finish_step(sched, sched.schedule(), next_token=t)
    assert r.is_finished and r.finish_reason == want and r.output_token_ids == tokens
    assert sched.running == [] and kv.num_free_pages == 8


def test_penalty_counts_follow_drawn_tokens():
    # greedy with a strong frequency penalty must alternate between two equal-ish tokens; the
    # counts live in the scheduler's PenaltyState, appended by update_from_output
    kv = KVCacheManager(num_pages=8, page_size=4)
    sched = Scheduler(kv, max_batch_input_tokens=16, max_batch_size=4, penalties=PenaltyState(3))
    r = req("r", [2], 0, SamplingParams(temperature=0, frequency_penalty=2.0, max_tokens=4))
    sched.add(r)
    row = r.state.penalty_row
    drive(sched, torch.tensor([1.0, 0.9, -5.0]), 3)
    assert r.output_token_ids == [0, 1, 0]  # 1.0 > .9; then -1.0 < .9; then -1.0 > -1.1
    assert sched.penalties.counts[row].tolist() == [2, 1, 0] and sched.penalties.prompt[row].tolist() == [
        False, False, True]
    drive(sched, torch.tensor([1.0, 0.9, -5.0]), 1)
    assert r.output_token_ids == [0, 1, 0, 1] and r.finish_reason == "length"  # -3.0 < -1.1
    assert row in sched.penalties.free_rows and r.state.penalty_row == 0


def test_penalties_need_a_penalty_state():
    sched = Scheduler(KVCacheManager(num_pages=2, page_size=4), 8, 2)
    with pytest.raises(ValueError, match="penalties=PenaltyState"):
        sched.add(req("r", [1], 0, SamplingParams(presence_penalty=0.5)))


def test_reasoning_state_is_computed_in_the_update():
    # docs/parsers.md P1: reasoning until an end id (counted); the temperature follows
    kv = KVCacheManager(num_pages=8, page_size=4)
    sched = Scheduler(kv, max_batch_input_tokens=16, max_batch_size=4)
    p = SamplingParams(temperature=0.5, thinking_temperature=0.0, start_in_reasoning=True,
                       reasoning_end_token_ids=[3])
    r = req("r", [0], 0, p)
    sched.add(r)
    assert r.state.temperature == 0.0
    finish_step(sched, sched.schedule(), next_token=1)
    finish_step(sched, sched.schedule(), next_token=3)
    assert r.state.num_reasoning_tokens == 2 and not r.state.in_reasoning
    assert r.state.temperature == 0.5
    finish_step(sched, sched.schedule(), next_token=1)
    assert r.state.num_reasoning_tokens == 2


# --- data-parallel replica admission: choose_replica ---------------------------------------------

def test_replica_admission_counts_a_prefix_held_by_running_requests_as_no_new_pages():
    """A hot prefix held by a running request costs a new request no free page (the pages are shared,
    KVCacheManager.allocate), so the replica that holds it admits the request although its free
    pages are fewer than the prefix's pages (docs/serving.md §8: free pages for the uncached rest)."""
    from m2serve.engine.scheduler import choose_replica

    hot = list(range(100, 124))                            # 24 tokens: 6 full pages of 4
    r0 = Scheduler(KVCacheManager(num_pages=8, page_size=4), max_batch_input_tokens=64, max_batch_size=4)
    r1 = Scheduler(KVCacheManager(num_pages=8, page_size=4), max_batch_input_tokens=64, max_batch_size=4)
    a = req("a", hot + [1, 2], 0)                         # 26 tokens: 7 pages, 6 of them the hot prefix
    r0.add(a)
    finish_step(r0, r0.schedule())
    assert r0.kv.num_free_pages == 1 and len(r0.cached_prefix_pages(req("x", hot + [3], 1))) == 6
    b = req("b", hot + [3], 1)                            # 25 tokens: the 6 shared pages + 1 new page
    assert r0.has_room_for(b, r0.cached_prefix_pages(b))
    assert choose_replica([r0, r1], b) == 0               # least load alone would say replica 1
    r0.add(b)
    out = r0.schedule()                                   # and replica 0 does admit it
    assert ("b", 1) in plan(out) and b.num_computed_tokens == 24
    c = req("c", hot + [4, 5, 6, 7, 8], 2)                # 29 tokens: 6 shared + 2 new, 0 free
    assert not r0.has_room_for(c, r0.cached_prefix_pages(c)) and choose_replica([r0, r1], c) == 1
