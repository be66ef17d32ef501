"""CUDA-graph decode by batch-size bucket (issue 29 item 3, docs/serving.md §6.3), proven on CPU
where it can be: the capture itself needs a GPU (benchmarks/gpu_check.py --part engine).

The static path runs eagerly here (``enable_graphs(..., capture=False)``), the same forward a
graph records. References: hand-derived buffer contents (slots = page * S + offset), the eager
engine's greedy tokens (unpadded and padded), and op names observed by a TorchDispatchMode,
independently of the code under test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import m2serve.kernels.triton  # noqa: F401  (before anything imports triton: docs/kernels.md §1)
from m2serve.config.engine_args import EngineArgs
from m2serve.config.parallel import ParallelismMode, ParallelState
from m2serve.engine.core import LLMEngine
from m2serve.engine.runner import graphs_off_reason
from m2serve.engine.sampling import SamplingParams
from m2serve.model.batch import KVStorage, ragged_batch
from m2serve.model.cuda_graphs import CUDAGraphRunner, StaticDecodeBuffers
from m2serve.model.load import load_model
from m2serve.parallel.worker import DistributedModel

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from test_step_sync import SyncAudit  # noqa: E402  (the sync audit of tests/model/test_step_sync.py)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

PROMPTS = [[5 + (i * 7) % 50, 9 + i % 11, 3 + (i * 5) % 13] for i in range(8)]
#: ops that make a tensor from host data or host values, or compute the RoPE table: none may run in
#: the static forward (its inputs are all views of the fixed buffers and tables). Fills of a
#: fixed size (the experts' offset counts) and the Triton interpreter's own copies are not these.
HOST_BUILT = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::_pin_memory", "aten::arange", "aten::full",
              "aten::scalar_tensor", "aten::cos", "aten::sin"}


class Ops(TorchDispatchMode):
    """Records every dispatched aten op: (name, dtype of its first tensor argument)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.ops.append((func.name(), first.dtype if first is not None else None))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def triton_model(tiny_random_dir):
    return load_model(tiny_random_dir, attention_backend="triton")


def _engine(model, mode: str) -> LLMEngine:
    args = EngineArgs(dtype="float32", kv_cache_format="float32", num_kv_pages=160, kv_cache_page_size=4,
                      max_batch_input_tokens=128, max_batch_size=8, seed=0, max_length=64)
    engine = LLMEngine.from_model(model, model.config, args)
    assert engine.runner.graphs_off == "CUDA only" and engine.runner.graphs is None  # CPU: eager
    if mode == "static":
        engine.runner.enable_graphs(8, engine.max_length, capture=False)
    elif mode == "padded":
        engine.runner.enable_decode_padding(8)
    return engine


def test_buffers_hold_hand_derived_rows_at_fixed_addresses():
    # bucket 4 with 3 then 4 rows, then bucket 8: every view keeps its address across steps and
    # batch sizes of a bucket; contents derived by hand (S = 4, padding page 9, width W = 3)
    buf = StaticDecodeBuffers([1, 2, 4, 8], max_pages=3, page_size=4, pad_page=9, device="cpu")
    fields = ("tokens", "positions", "slot_mapping", "context_lens", "block_tables", "query_starts")
    before = {n: getattr(buf.views[4], n).data_ptr() for n in fields}
    v = buf.load(4, [11, 12, 13], [5, 1, 12], [[2, 7], [3], [4, 5, 6]])
    assert v.tokens.tolist() == [11, 12, 13, 0] and v.positions.tolist() == [4, 0, 11, 0]
    # position 4 -> page 7 row 0 = 28; 0 -> page 3 row 0 = 12; 11 -> page 6 row 3 = 27; pad: page 9 row 0
    assert v.slot_mapping.tolist() == [28, 12, 27, 36]
    assert v.context_lens.tolist() == [5, 1, 12, 1] and v.context_lens.dtype == torch.int32
    assert v.block_tables.dtype == torch.int32 and v.block_tables.shape == (4, 3)
    used = [v.block_tables[i, :n].tolist() for i, n in enumerate((2, 1, 3, 1))]
    assert used == [[2, 7], [3], [4, 5, 6], [9]]
    assert v.query_starts.tolist() == [0, 1, 2, 3, 4]
    w = buf.load(4, [1, 2, 3, 4], [2, 3, 4, 5], [[0], [1], [2], [3, 8]])
    assert w is buf.views[4] and w.slot_mapping.tolist() == [1, 6, 11, 32]
    assert {n: getattr(w, n).data_ptr() for n in fields} == before
    assert buf.load(8, [5], [1], [[0]]).tokens.data_ptr() == buf.views[8].tokens.data_ptr()
    p = buf.load(2, [], [], [])  # padding rows only (what the capture records)
    assert p.tokens.tolist() == [0, 0] and p.slot_mapping.tolist() == [36, 36]
    assert p.positions.tolist() == [0, 0] and p.context_lens.tolist() == [1, 1]
    assert p.block_tables[:, 0].tolist() == [9, 9] and buf.loads == 4
    with pytest.raises(ValueError, match="row 0: context_lens=13 needs 4 pages of 4; .* static width is 3"):
        buf.load(4, [1], [13], [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="row 1: context_lens=5 needs 2 pages of 4; its block table has 1"):
        buf.load(2, [1, 2], [1, 5], [[0], [1]])
    with pytest.raises(ValueError, match="2 tokens, 1 context_lens, 2 block_tables: give one of each"):
        buf.load(2, [1, 2], [1], [[0], [1]])
    with pytest.raises(ValueError, match=r"bucket 4 \(of \[1, 2, 4, 8\]\) for 5 rows"):
        buf.load(4, [1] * 5, [1] * 5, [[0]] * 5)


def test_static_forward_builds_nothing_from_host_data(triton_model, tiny_random_dir):
    # the forward a graph records: inputs are views of the fixed buffers, RoPE rows come from the
    # fixed table; no tensor made from host data, no cast, no table computed. The same ops (names
    # and count) at 3 and 4 rows of bucket 4 and on the next step: the shapes are the bucket's.
    # No host read either (the sync audit). The audit can fail: the eager torch-backend forward
    # copies each request's page ids over.
    model = triton_model
    cfg = model.config
    kv = KVStorage.allocate(cfg.num_hidden_layers, 12, 4, cfg.num_key_value_heads, cfg.head_dim,
                            torch.float32)
    runner = CUDAGraphRunner(model, kv, [1, 2, 4], max_length=16, pad_page=11, capture=False)
    table_ptr = runner.cos.data_ptr()
    seen = []
    for rows in ([[1, 2], [3]], [[1, 2], [3], [4, 5]], [[1, 2], [3], [4, 5], [6]]):
        runner.buffers.load(4, [7] * len(rows), [2 * len(r) for r in rows], rows)
        audit, syncs = Ops(), SyncAudit()
        with audit, syncs:
            logits = runner.forward(4)
        assert syncs.syncs == [] and len(syncs.ops) > 100
        assert logits.shape == (4, cfg.vocab_size) and logits.dtype == torch.float32
        names = [n for n, _ in audit.ops]
        assert not set(names) & HOST_BUILT, sorted(set(names) & HOST_BUILT)
        seen.append(names)
    assert seen[0] == seen[1] == seen[2] and runner.cos.data_ptr() == table_ptr
    torch_model = load_model(tiny_random_dir, attention_backend="torch")
    batch = ragged_batch([[7], [7]], [4, 2], [[1, 2], [3]], [1, 1], 4)
    audit = Ops()
    with audit:
        torch_model(batch, kv)
    assert {"aten::lift_fresh", "aten::cos"} & {n for n, _ in audit.ops}


@pytest.mark.slow
def test_static_decode_gives_the_eager_engines_greedy_tokens(triton_model):
    # issue 29 item 3 on CPU: the static path (what a graph replays: 3 -> 4, 5 -> 8 rows, padding
    # rows into their own page) gives the tokens of the eager engine, unpadded and padded, reading
    # its inputs at fixed addresses
    sizes: list[int] = []
    real = triton_model.forward_decode

    addresses: dict[int, set[tuple[int, ...]]] = {}

    def forward_decode(inputs, kv, cos, sin, max_context_len):
        sizes.append(inputs.batch_size)
        addresses.setdefault(inputs.batch_size, set()).add(tuple(
            t.data_ptr() for t in (inputs.tokens, inputs.positions, inputs.slot_mapping, inputs.context_lens,
                                   inputs.block_tables, inputs.query_starts, kv.k[0], cos)))
        return real(inputs, kv, cos, sin, max_context_len)
    runs = {}
    for mode in ("eager", "padded", "static"):
        engine = _engine(triton_model, mode)
        if mode == "static":
            triton_model.forward_decode = forward_decode
        try:
            for i in range(5):
                engine.add_request(str(i), PROMPTS[i] * (1 + i % 2), SamplingParams(
                    temperature=0.0, max_tokens=3 + i, ignore_eos=True))
            out: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
        finally:
            vars(triton_model).pop("forward_decode", None)
        runs[mode] = out
        if mode == "static":
            # the prompts prefill in one eager step, then decodes of 5, 5, 4, 3, 2, 1 rows (max_tokens
            # 3..7) run at buckets 8, 8, 4, 4, 2, 1
            assert sizes == [8, 8, 4, 4, 2, 1] and engine.runner.graph_steps == 6, sizes
            # what a replay reads sits at one address per bucket, step after step (5 and 5 rows in
            # bucket 8, 4 and 3 in bucket 4)
            assert all(len(a) == 1 for a in addresses.values()), addresses
    assert runs["eager"] == runs["padded"] == runs["static"]
    assert sorted(len(t) for t in runs["eager"].values()) == [3, 4, 5, 6, 7]


class _Stub:
    def __init__(self, kernel):
        self.attention_kernel = kernel

    def forward_decode(self, *a):
        raise AssertionError


def test_graphs_off_reasons_and_refusals():
    triton_like = _Stub(kernel=object())
    assert graphs_off_reason(triton_like, "cuda:0", enforce_eager=False, replicas=1) is None
    assert graphs_off_reason(triton_like, "cuda:0", enforce_eager=True, replicas=1) == "--enforce-eager"
    assert graphs_off_reason(triton_like, "cpu", enforce_eager=False, replicas=1) == "CUDA only"
    torch_like = _Stub(None)
    assert graphs_off_reason(torch_like, "cuda", enforce_eager=False, replicas=1) == "torch attention backend"
    none = "no static decode path: data-parallel replicas and EP modes run eager"
    assert graphs_off_reason(object(), "cuda", enforce_eager=False, replicas=1) == none
    assert graphs_off_reason(object(), "cpu", enforce_eager=False, replicas=1) == none
    assert graphs_off_reason(triton_like, "cuda", enforce_eager=False, replicas=2) == none
    # multi-rank models (rank 0's DistributedModel, no worker needed to ask): TP_TP is on with the
    # triton backend on CUDA; every EP configuration says why not, before the device
    P = ParallelismMode
    tp = DistributedModel(triton_like, ParallelState(P.TP_TP, 2, 0, tp_size=2))
    assert graphs_off_reason(tp, "cuda:0", enforce_eager=False, replicas=1) is None
    assert graphs_off_reason(tp, "cpu", enforce_eager=False, replicas=1) == "CUDA only"
    assert graphs_off_reason(tp, "cuda:0", enforce_eager=True, replicas=1) == "--enforce-eager"
    tp_torch = DistributedModel(torch_like, ParallelState(P.TP_TP, 2, 0, tp_size=2))
    assert graphs_off_reason(tp_torch, "cuda:0", enforce_eager=False, replicas=1) == "torch attention backend"
    ep = {"TP_EP": ParallelState(P.TP_EP, 2, 0, tp_size=2, ep_size=2),
          "TP_EP_AR": ParallelState(P.TP_EP, 2, 0, tp_size=2, ep_size=2, ep_use_allreduce=True),
          "DP_EP": ParallelState(P.DP_EP, 2, 0, ep_size=2, data_parallel_degree=2),
          "DP": ParallelState(P.DP_EP, 2, 0, data_parallel_degree=2)}
    reasons = {k: graphs_off_reason(DistributedModel(triton_like, st), "cuda:0", False, 1)
               for k, st in ep.items()}
    assert reasons == {
        "TP_EP": "TP_EP runs eager: the EP exchange reads its counts on the host",
        "TP_EP_AR": "TP_EP runs eager: static decode is built for one rank and TP_TP, not TP_EP with "
                    "ep_use_allreduce",
        "DP_EP": "DP_EP runs eager: the EP exchange reads its counts on the host",
        "DP": "DP_EP runs eager: static decode is built for one rank and TP_TP, not data-parallel replicas"}
    kv = KVStorage.allocate(1, 4, 4, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="static decode: TP_EP runs eager: the EP exchange"):
        DistributedModel(triton_like, ep["TP_EP"]).static_decode(kv, [1], 16, 3, capture=False)
    with pytest.raises(ValueError, match="needs attention_backend='triton'"):  # refused before any send
        tp_torch.static_decode(kv, [1], 16, 3, capture=False)
    with pytest.raises(ValueError, match="needs attention_backend='triton'"):
        CUDAGraphRunner(_Stub(None), kv, [1], 16, 3, capture=False)
    with pytest.raises(ValueError, match="capture=True: CUDA graphs need a CUDA device, the KV pool is on"):
        CUDAGraphRunner(triton_like, kv, [1], 16, 3, capture=True)


def test_llm_arguments_and_banner_say_why_decode_runs_eager(tiny_random_dir):
    # LLM(enforce_eager=..., attention_backend=...) reach the engine; the banner names the reason
    from m2serve.serve.cli import banner
    from m2serve.serve.llm import LLM

    small = {"dtype": "float32", "kv_cache_memory_gib": 0.01, "max_length": 256}
    llm = LLM(str(tiny_random_dir), enforce_eager=True, attention_backend="torch", **small)
    assert llm.engine.runner.graphs_off == "--enforce-eager" and llm.engine.runner.graphs is None
    line = banner(llm, {})
    assert "| attention torch | CUDA graphs off (--enforce-eager) |" in line, line
    llm = LLM(str(tiny_random_dir), **small)
    assert "CUDA graphs off (CUDA only)" in banner(llm, {})


def test_engine_sets_up_graphs_at_start_when_nothing_rules_them_out(triton_model, monkeypatch):
    # what LLMEngine.from_model does on one CUDA device, minus the capture (CUDA only): the pool is
    # allocated with the padding page (no regrowth), the runner gets the buckets of max_batch_size
    # and the width of max_length, and decode steps take the graph path
    import m2serve.engine.core as core
    import m2serve.engine.runner as runner_module

    made = []

    class NoCapture(CUDAGraphRunner):
        def __init__(self, model, kv, buckets, max_length, pad_page, capture):
            made.append((list(buckets), max_length, pad_page, capture, kv.num_pages))
            super().__init__(model, kv, buckets, max_length, pad_page, capture=False)
    monkeypatch.setattr(core, "graphs_off_reason", lambda *a: None)
    monkeypatch.setattr(runner_module, "CUDAGraphRunner", NoCapture)
    args = EngineArgs(dtype="float32", kv_cache_format="float32", num_kv_pages=40, kv_cache_page_size=4,
                      max_batch_input_tokens=64, max_batch_size=20, seed=0, max_length=64)
    engine = LLMEngine.from_model(triton_model, triton_model.config, args)
    assert made == [([1, 2, 4, 8, 16, 20], 64, 40, True, 41)]
    assert engine.runner.graphs_off is None and engine.runner.graphs.buffers.width == 16
    assert engine.stats.kv_pages_total == 40
    for i in range(3):
        engine.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.graph_steps == 1  # the prefill step eager, the one decode step static
