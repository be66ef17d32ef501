"""Data-parallel replicas owned by the engine (issue 27 "must show"), on two spawned gloo ranks
(DP_EP, dp 2, ep 2, tiny-random fp32):

- the engine holds one scheduler and one pool per replica: 2x the single-replica page count, a
  token budget per replica (a step runs more than ``max_batch_input_tokens`` in all, never more on
  one replica);
- admission: a request whose prefix sits in replica 1 is admitted there (least load would pick
  replica 0); a replica 0 with no room sends a request with its cached prefix to replica 1;
- the whole multi-rank step (rank 0's ``DistributedModel`` call and the worker's loop) reads
  nothing back besides the EP counts exchange (``ep_moe``: one bincount and two ``.tolist()`` per
  layer), patching ``Tensor.tolist`` / ``item`` (they dispatch no aten op) and counting
  ``bincount`` / ``_local_scalar_dense`` with a dispatch mode;
- a step in which replica 1 has no request still runs the EP exchange on its rank (3 all_to_all
  per layer, docs/parallelism.md §3);
- each replica draws its own rows: no logits gather runs, only the draws travel to rank 0.

Greedy token identity of every mode with one process (16 requests, preemption, prefix hits) is in
test_modes.py.
"""

from __future__ import annotations

import sys
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import m2serve.parallel.worker as worker_mod
from m2serve.config.engine_args import EngineArgs
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import validate_deployment
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams
from m2serve.model.load import load_model
from m2serve.parallel.launch import run_ranks
from m2serve.parallel.worker import DistributedModel, load_rank_model, worker_loop

S = 8                     # page size
PAGES = 32                # per replica
BUDGET = 16               # max_batch_input_tokens per replica
GREEDY = dict(temperature=0.0, ignore_eos=True)
P_PROMPT = list(range(100, 124))    # 3 pages: its prefix will sit in replica 1
Q_PROMPT = list(range(200, 224))    # 3 pages: its prefix will sit in replica 0
LONG = list(range(300, 340))        # 40 tokens: two of them exceed one replica's budget


class ReadBacks(TorchDispatchMode):
    """Counts ops that read a device value back; ``found`` = "op@ep_moe" or "op@<caller>"."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name in ("aten::bincount", "aten::_local_scalar_dense", "aten::nonzero") or "unique" in name:
            self.found.append(f"{name}@{_where()}")
        return func(*args, **(kwargs or {}))


def _where() -> str:
    """"ep_moe" when called (at any depth) from the EP counts exchange, "message" from the step
    message's receive (torch's ``broadcast_object_list``), else the direct caller."""
    f = sys._getframe(2)
    caller = f.f_code.co_name
    while f is not None:
        name = f.f_code.co_name
        if name == "ep_moe":
            return "ep_moe"
        if name in ("broadcast_object_list", "gather_object"):
            return "message"
        if name == "sample" and f.f_code.co_filename.endswith("engine/sampling.py"):
            return "sampler"
        f = f.f_back
    return caller


class audited:
    """Context: Tensor.tolist / item patched to record into ``audit.found``, and the audit mode on."""

    def __init__(self, audit: ReadBacks):
        self.audit = audit

    def __enter__(self):
        def rec(name, fn):
            def f(t, *a, **k):
                self.audit.found.append(f"{name}@{_where()}")
                return fn(t, *a, **k)
            return f
        self.patches = [mock.patch.object(torch.Tensor, "tolist", rec("tolist", torch.Tensor.tolist)),
                        mock.patch.object(torch.Tensor, "item", rec("item", torch.Tensor.item))]
        for p in self.patches:
            p.start()
        self.audit.__enter__()
        return self.audit

    def __exit__(self, *exc):
        self.audit.__exit__(*exc)
        for p in self.patches:
            p.stop()


def _args(ckpt: str, **kw) -> EngineArgs:
    return EngineArgs(model=ckpt, dtype="float32", kv_cache_format="float32", num_kv_pages=PAGES,
                      kv_cache_page_size=S, max_batch_input_tokens=BUDGET, max_batch_size=2, **kw)


def _drive(engine: LLMEngine, until: set[str]) -> None:
    done: set[str] = set()
    while not until <= done:
        done |= {o.request_id for o in engine.step() if o.finished}


def _rank0(dm: DistributedModel, cfg: MiniMaxM2Config, ckpt: str) -> dict:
    res: dict = {}
    engine = LLMEngine.from_model(dm, cfg, _args(ckpt))
    res["pages"] = (engine.stats.kv_pages_total, [r.kv_pages_total for r in engine.stats.replicas],
                    engine.runner.kv_storage.num_pages)
    steps: list[dict] = []
    real = engine.runner.model

    def recorded(batch, kv, *sampling):  # the multi-rank step, audited on rank 0
        audit = ReadBacks()
        h = batch.host
        with audited(audit):
            out = real(batch, kv, *sampling)
        steps.append({"splits": h.data_parallel_splits, "lens": h.query_lens, "reads": audit.found})
        return out
    recorded.samples_on_replicas = dm.samples_on_replicas
    engine.runner.model = recorded

    # replica 1 idle: its rank runs empty steps
    engine.add_request("solo", [1, 2, 3], SamplingParams(max_tokens=3, **GREEDY))
    _drive(engine, {"solo"})

    # per-replica budget: two 40-token prompts, one per replica (least load), chunked by 16 each
    engine.add_request("long0", LONG, SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request("long1", LONG[::-1], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    res["long_replicas"] = [engine.requests[r].replica for r in ("long0", "long1")]
    _drive(engine, {"long0", "long1"})

    # prefix in replica 1: a filler takes replica 0, so P lands on replica 1; then P + more goes
    # back to replica 1 although both replicas are idle (least load would say replica 0)
    engine.add_request("filler", Q_PROMPT, SamplingParams(max_tokens=3, **GREEDY))   # Q cached on 0
    engine.add_request("p", P_PROMPT, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    res["p_replicas"] = [engine.requests[r].replica for r in ("filler", "p")]
    _drive(engine, {"filler", "p"})
    engine.add_request("p-hit", P_PROMPT + [7, 8, 9], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    hit = engine.requests["p-hit"]
    res["p_hit"] = (hit.replica, hit.num_cached_tokens)
    _drive(engine, {"p-hit"})

    # full replica 0: Q's prefix is cached there; two requests fill it (max_batch_size 2), the
    # third with the same prefix goes to replica 1
    for i in range(3):
        engine.add_request(f"q{i}", Q_PROMPT + [10 + i], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    res["q_replicas"] = [engine.requests[f"q{i}"].replica for i in range(3)]
    res["q_cached"] = [engine.requests[f"q{i}"].num_cached_tokens for i in range(3)]
    _drive(engine, {"q0", "q1", "q2"})
    # fallback: a penalised row and a prompt-logprobs request gather their logit rows to rank 0
    res["fallback"] = _fallback(engine)
    res["steps"] = steps
    return res


FALLBACK = {"pen": ([4, 4, 9, 4, 2, 4], dict(temperature=0.8, seed=3, repetition_penalty=1.3,
                                              frequency_penalty=0.5)),
            "plp": ([30, 31, 32, 33, 34], dict(temperature=0.0, prompt_logprobs=1))}


def _fallback(engine: LLMEngine) -> dict:
    """Tokens and prompt-logprob token ids / values of FALLBACK's requests (6 tokens each)."""
    out: dict = {rid: [] for rid in FALLBACK}
    plp: dict = {}
    for rid, (prompt, kw) in FALLBACK.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=6, ignore_eos=True, **kw))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.prompt_logprobs:
                plp[o.request_id] = [(e.token_id, e.logprob) if e else None for e in o.prompt_logprobs]
    return {"tokens": out, "prompt_logprobs": plp}


def _scenario(rank: int, world: int, ckpt: str) -> dict:
    cfg = MiniMaxM2Config.from_pretrained(ckpt)
    state = validate_deployment(cfg, world, world, world, encoding="bf16").state(rank)
    model = load_rank_model(ckpt, state)
    L = cfg.num_hidden_layers
    if rank == 0:
        dm = DistributedModel(model, state)
        try:
            res = _rank0(dm, cfg, ckpt)
        finally:
            dm.stop()
        single = LLMEngine.from_model(load_model(ckpt), cfg, _args(ckpt))
        res["single_pages"] = single.stats.kv_pages_total
        res["fallback_ref"] = _fallback(single)
        res["layers"] = L
        return res
    # the worker: every step audited, with its replica's request count and its collectives
    steps: list[dict] = []
    real_step = worker_mod.run_rank_step
    calls: Counter = Counter()
    real_a2a, real_gather = dist.all_to_all_single, dist.gather

    def a2a(*a, **k):
        calls["all_to_all"] += 1
        return real_a2a(*a, **k)

    def gather(*a, **k):  # the logits gather: not run when the replicas draw their own rows
        calls["gather"] += 1
        return real_gather(*a, **k)

    def step(m, st, batch, kv, *sampling):
        s = batch.host.data_parallel_splits
        calls.clear()
        out = real_step(m, st, batch, kv, *sampling)
        steps.append({"requests": s[st.dp_rank + 1] - s[st.dp_rank], "all_to_all": calls["all_to_all"],
                      "logits_gathered": calls["gather"], "sampled_here": bool(sampling and sampling[0])})
        return out

    audit = ReadBacks()
    with mock.patch.object(worker_mod, "run_rank_step", step), \
            mock.patch.object(dist, "all_to_all_single", a2a), mock.patch.object(dist, "gather", gather), \
            audited(audit):
        worker_loop(model, state)
    return {"steps": steps, "reads": audit.found}


@pytest.fixture(scope="module")
def results(tiny_random_dir):
    return run_ranks(_scenario, 2, str(tiny_random_dir), timeout_s=60)


@pytest.mark.slow
def test_two_replicas_hold_two_pools_with_a_budget_each(results):
    r0 = results[0]
    total, per, rank_pool = r0["pages"]
    assert r0["single_pages"] == PAGES
    assert total == 2 * PAGES and per == [PAGES, PAGES] and rank_pool == PAGES
    assert r0["long_replicas"] == [0, 1]
    split_steps = [s for s in r0["steps"] if s["splits"] is not None]
    assert len(split_steps) == len(r0["steps"])
    for s in split_steps:
        a, b, c = s["splits"]
        assert sum(s["lens"][a:b]) <= BUDGET and sum(s["lens"][b:c]) <= BUDGET
    assert max(sum(s["lens"]) for s in split_steps) == 2 * BUDGET   # over one budget in all


def test_prefix_in_replica_1_is_admitted_there_and_a_full_replica_0_sends_to_1(results):
    r0 = results[0]
    assert r0["p_replicas"] == [0, 1]
    replica, cached = r0["p_hit"]
    assert replica == 1 and cached == 3 * S          # P's three full pages, from replica 1's cache
    assert r0["q_replicas"] == [0, 0, 1]
    assert r0["q_cached"] == [3 * S, 3 * S, 0]       # replica 1 has no copy of Q's pages


def _outside(reads: list[str]) -> Counter:
    """Reads outside the step message (torch's broadcast_object_list / gather_object read their
    size tensors on the receiving side: CPU tensors under gloo) and the sampler's one copy of the
    drawn token ids (engine/sampling.py ``sample``)."""
    kinds = {"item", "tolist", "aten::_local_scalar_dense"}
    assert {r.split("@")[0] for r in reads if r.endswith(("@message", "@sampler"))} <= kinds, reads
    return Counter(r for r in reads if not r.endswith(("@message", "@sampler")))


def test_multi_rank_step_reads_back_only_in_the_ep_counts_exchange(results):
    L = results[0]["layers"]
    per_step = Counter(["aten::bincount@ep_moe", "tolist@ep_moe", "tolist@ep_moe"] * L)
    for s in results[0]["steps"]:
        assert _outside(s["reads"]) == per_step, s["reads"]
    w = results[1]
    assert _outside(w["reads"]) == Counter({k: v * len(w["steps"]) for k, v in per_step.items()})


def test_an_empty_replica_still_joins_the_ep_exchange(results):
    L = results[0]["layers"]
    steps = results[1]["steps"]
    assert any(s["requests"] == 0 for s in steps) and any(s["requests"] > 0 for s in steps)
    assert all(s["all_to_all"] == 3 * L for s in steps), steps


def test_replicas_draw_their_rows_and_no_logits_travel(results):
    # issue 27 item 4: the steps without prompt logprobs or penalties drew on the replicas and the
    # worker joined no logits gather; the fallback steps gathered logit rows (one gather each)
    steps = results[1]["steps"]
    drawn = [s for s in steps if s["sampled_here"]]
    gathered = [s for s in steps if not s["sampled_here"]]
    assert drawn and gathered, steps
    assert all(s["logits_gathered"] == 0 for s in drawn) and all(s["logits_gathered"] == 1 for s in gathered)


def _token_ids(entries):
    return [e if e is None else e[0] for e in entries]


def test_fallback_with_penalties_and_prompt_logprobs_equals_one_process(results):
    got, ref = results[0]["fallback"], results[0]["fallback_ref"]
    assert got["tokens"] == ref["tokens"] and all(len(t) == 6 for t in got["tokens"].values())
    g, r = got["prompt_logprobs"]["plp"], ref["prompt_logprobs"]["plp"]
    assert _token_ids(g) == _token_ids(r) and len(g) == 5
    for a, b in zip(g[1:], r[1:], strict=True):
        assert a[1] == pytest.approx(b[1], abs=1e-5)

