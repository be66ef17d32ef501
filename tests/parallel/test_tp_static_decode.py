"""TP_TP decode on the static path on every rank (issue 29 item 3, docs/serving.md §6.3), on
``--devices cpu:2`` (gloo) where the capture cannot run: ``enable_graphs(..., capture=False)`` runs
on every rank the same static forward a graph records, at the bucket rank 0 chose.

References: the one-rank engine's greedy tokens (eager, the same triton backend) and the same
TP_TP engine's own eager tokens before the static path was switched on; a rank whose bucket or
padding differed from rank 0's would send all-reduces of another shape (gloo fails the step), and
a rank whose block tables drifted would read other pages (other tokens). The engine's start-up
path on TP_TP CUDA ranks runs too, with only the capture switched off (rank 0 tells every rank
capture=False). The banners are the real ``m2serve`` start-up lines of TP_TP deployments (on
CPU; on that start-up path) and of a TP_EP one.

The scenario runs in a child process: the engine process joins the process group as rank 0,
which the pytest process should not do.
"""

from __future__ import annotations

import traceback

import pytest
from rank_helpers import spawn_scenario

pytestmark = pytest.mark.slow  # starts rank processes (30-60 s on 2 busy cores)

PROMPTS = [[5 + (i * 7) % 50, 9 + i % 11, 3 + (i * 5) % 13] * (1 + i % 2) for i in range(5)]
SMALL = {"dtype": "float32", "kv_cache_format": "float32", "num_kv_pages": 48, "kv_cache_page_size": 4,
         "max_batch_size": 8, "max_length": 64, "attention_backend": "triton"}


def _generate(engine, tag: str, buckets: list | None = None) -> list[list[int]]:
    """Greedy tokens of the 5 prompts (max_tokens 3..7: decodes of 5, 5, 4, 3, 2, 1 rows); each
    step message's bucket appended to ``buckets`` (a multi-rank engine's)."""
    from m2serve.engine.sampling import SamplingParams

    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if buckets is not None:
            buckets.append(engine.runner.model.last_message[0].bucket)
    return [out[f"{tag}{i}"] for i in range(len(PROMPTS))]


def _scenario(ckpt: str, results) -> None:
    try:
        import m2serve.kernels.triton  # noqa: F401  (before anything imports triton: docs/kernels.md §1)
        from m2serve.serve.cli import banner
        from m2serve.serve.llm import LLM

        one = LLM(ckpt, **SMALL)
        ref = _generate(one.engine, "r")
        tp = LLM(ckpt, devices="cpu:2", **SMALL)
        engine = tp.engine
        runner, model = engine.runner, engine.runner.model
        tp_banner = banner(tp, {})
        eager = _generate(engine, "e")
        pages_before = runner.kv_storage.num_pages
        # the static path on both ranks, after eager steps: rank 0 appends the padding page, rank 1
        # grows its pool to match (the pages written so far kept: the prefix cache hits them)
        runner.enable_graphs(8, engine.max_length, capture=False)
        buckets: list[int | None] = []
        static = _generate(engine, "s", buckets)
        static_again = _generate(engine, "t", buckets)   # finished ids of the previous round reach rank 1
        res = {"ref": ref, "eager": eager, "static": static, "static_again": static_again, "buckets": buckets,
               "graph_steps": runner.graph_steps, "pages": (pages_before, runner.kv_storage.num_pages),
               "tp_banner": tp_banner, "off": runner.graphs_off}
        model.shutdown()
        # what LLMEngine.from_model does on TP_TP CUDA ranks, minus the capture (rank 0 tells every
        # rank capture=False): the pools allocated with the padding page, the path built at start-up
        import m2serve.engine.core as core
        from m2serve.parallel.worker import DistributedModel

        real_reason, real_static = core.graphs_off_reason, DistributedModel.static_decode
        core.graphs_off_reason = lambda *a: None
        DistributedModel.static_decode = lambda self, kv, b, n, pad, capture: real_static(self, kv, b, n, pad,
                                                                                          False)
        try:
            started = LLM(ckpt, devices="cpu:2", **SMALL)
        finally:
            core.graphs_off_reason, DistributedModel.static_decode = real_reason, real_static
        r = started.engine.runner
        res["started"] = {"tokens": _generate(started.engine, "u"), "graph_steps": r.graph_steps,
                          "off": r.graphs_off, "banner": banner(started, {}),
                          "pages": (started.engine.stats.kv_pages_total, r.kv_storage.num_pages)}
        r.model.shutdown()
        ep = LLM(ckpt, devices="cpu:2", ep_size=2, **SMALL)
        res["ep_banner"] = banner(ep, {})
        ep.engine.runner.model.shutdown()
        results.put(res)
    except BaseException:
        results.put({"crash": traceback.format_exc()})


def test_tp_tp_static_decode_on_cpu2_gives_one_ranks_greedy_tokens(tiny_random_dir):
    res = spawn_scenario(_scenario, (str(tiny_random_dir),), 400)
    assert [len(t) for t in res["ref"]] == [3, 4, 5, 6, 7]
    assert res["eager"] == res["ref"]
    assert res["static"] == res["ref"] and res["static_again"] == res["ref"]
    # per round: one eager prefill step (bucket None), then decodes of 5, 5, 4, 3, 2, 1 rows at
    # buckets 8, 8, 4, 4, 2, 1 chosen by rank 0 and run by both ranks
    assert res["buckets"] == [None, 8, 8, 4, 4, 2, 1] * 2, res["buckets"]
    assert res["graph_steps"] == 12
    assert res["pages"] == (48, 49)   # the padding page, outside the allocator
    assert res["off"] == "static decode path run eagerly (no capture)"
    # TP_TP is no longer ruled out by its mode: on CPU the device is the reason; TP_EP names its own
    assert "| devices cpu:2 mode TP_TP |" in res["tp_banner"]
    assert "| CUDA graphs off (CUDA only) |" in res["tp_banner"], res["tp_banner"]
    started = res["started"]
    assert started["tokens"] == res["ref"] and started["graph_steps"] == 6 and started["off"] is None
    assert started["pages"] == (48, 49)
    assert "| devices cpu:2 mode TP_TP |" in started["banner"]
    assert "| CUDA graphs: decode buckets 1..8 (4) |" in started["banner"], started["banner"]
    assert "mode TP_EP" in res["ep_banner"]
    assert ("| CUDA graphs off (TP_EP runs eager: the EP exchange reads its counts on the host) |"
            in res["ep_banner"]), res["ep_banner"]
