"""Exact scheduling decisions, no model (vLLM tests/v1/core style): token budget, chunking,
preemption of the newest request by recompute, prefix hits at re-admission.

Spec: serving.md §8 (all tokens of a step, decodes included, within max_batch_input_tokens;
preemption frees pages and requeues), §7 (full pages only). Expected values derived by hand below.
"""

from __future__ import annotations

from m2serve.engine.kv_cache import KVCacheManager
from m2serve.engine.request import Request, RequestStatus
from m2serve.engine.sampling import SamplingParams, SamplingState
from m2serve.engine.scheduler import Scheduler

PARAMS = SamplingParams(temperature=0.0, top_p=1.0, top_k=0)


def req(rid: str, prompt: list[int], arrival: int) -> Request:
    return Request(rid, prompt, SamplingState.new(PARAMS, prompt), arrival=arrival, max_length=64)


def finish_step(sched: Scheduler, out, next_token: int = 9) -> None:
    """What the engine does after the model: advance num_computed, cache full pages, and append a
    token to every request whose chunk completed its sequence."""
    for s in out.scheduled:
        r = s.request
        done = s.completes
        r.num_computed_tokens += s.num_new_tokens
        sched.kv.cache_full_pages(r.request_id, r.all_token_ids, r.num_computed_tokens)
        if done:
            r.state.output_token_ids.append(next_token)
            r.all_token_ids.append(next_token)


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
