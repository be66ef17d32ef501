"""The batch-invariant mode (docs/model.md §7): a row's result does not depend on the other rows.

The reference of each row is the same function called on that row alone (the property itself);
each path is also checked against ``F.linear`` on the dequantised weight, so the mode cannot be
invariant by being wrong. The end-to-end case is the one that failed without the mode: the
tiny-random bf16 checkpoint, seeded sampling (temperature 1, top_p 0.95, top_k 40), 8 prompts
run one by one and then together.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m2serve.config.engine_args import EngineArgs, batch_invariant_enabled
from m2serve.engine.sampling import SamplingParams
from m2serve.formats.fp8 import PackedFP8, quantize_fp8_block
from m2serve.kernels.ops import (
    PackedWeights,
    WeightFormat,
    dense_linear,
    grouped_linear,
    linear,
    rowwise_linear,
)
from m2serve.model.load import load_model
from m2serve.model.router import route
from m2serve.serve.cli import build_parser, resolve_options
from m2serve.serve.llm import LLM

ROW_COUNTS = (1, 2, 3, 8, 17, 40)  # 1-2 rows, the 8-row passes, and past GEMV_ROWS (16)


def _rows_alone_equal(fn, x: torch.Tensor) -> None:
    """fn over the first R rows of x, for every R, gives each row bit for bit as fn on it alone."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    for r in ROW_COUNTS:
        assert torch.equal(fn(x[:r]), alone[:r]), f"rows differ when {r} rows share the call"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_linear_is_row_independent_and_a_linear(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 512, generator=g).to(dtype), torch.randn(96, 512, generator=g).to(dtype)
    _rows_alone_equal(lambda a: rowwise_linear(a, w), x)
    torch.testing.assert_close(rowwise_linear(x, w).float(), F.linear(x.float(), w.float()),
                               rtol=2e-2, atol=2e-1)


def test_dense_bf16_linear_is_row_independent_in_the_mode():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 512, generator=g).bfloat16(), torch.randn(200, 512, generator=g).bfloat16()
    _rows_alone_equal(lambda a: dense_linear(a, w, batch_invariant=True), x)
    _rows_alone_equal(lambda a: linear(a, PackedWeights(WeightFormat.BF16, w[None]), batch_invariant=True), x)
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(dense_linear(x, w, batch_invariant=True).float(), want, rtol=2e-2, atol=3e-1)


def test_fp8_linear_is_row_independent_in_the_mode():
    g = torch.Generator().manual_seed(2)
    q, s = quantize_fp8_block(torch.randn(256, 384, generator=g))
    packed = PackedWeights(WeightFormat.FP8_BLOCK, q[None], s[None], None, 128, 128)
    x = torch.randn(40, 384, generator=g).bfloat16()
    _rows_alone_equal(lambda a: linear(a, packed, batch_invariant=True), x)
    want = F.linear(x.float(), PackedFP8(q, s).dequantize(torch.bfloat16).float())
    torch.testing.assert_close(linear(x, packed, batch_invariant=True).float(), want, rtol=2e-2, atol=3e-1)


def test_grouped_linear_row_does_not_depend_on_the_other_experts_rows():
    g = torch.Generator().manual_seed(3)
    w = PackedWeights(WeightFormat.BF16, torch.randn(3, 128, 256, generator=g).bfloat16())
    x = torch.randn(60, 256, generator=g).bfloat16()
    offsets = torch.tensor([5, 45, 60], dtype=torch.int32)  # 5, 40 (past GEMV_ROWS) and 15 rows
    y = grouped_linear(x, offsets, w, batch_invariant=True)
    for r, e in ((0, 0), (4, 0), (5, 1), (30, 1), (44, 1), (45, 2), (59, 2)):
        alone = grouped_linear(x[r:r + 1], torch.tensor([1], dtype=torch.int32),
                               PackedWeights(WeightFormat.BF16, w.q[e:e + 1]), batch_invariant=True)
        assert torch.equal(y[r:r + 1], alone), f"row {r} (expert {e})"
    want = torch.cat([F.linear(x[a:b].float(), w.q[e].float()) for e, (a, b) in
                      enumerate(((0, 5), (5, 45), (45, 60)))])
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=3e-1)


def test_router_is_row_independent_in_the_mode():
    g = torch.Generator().manual_seed(4)
    h, gate = torch.randn(40, 768, generator=g).bfloat16(), torch.randn(64, 768, generator=g)
    _rows_alone_equal(lambda a: torch.cat([t.float() for t in route(a, gate, None, 4, True)], 1), h)


@pytest.mark.parametrize("variant, dtype", [("bf16", "bfloat16"), ("bf16", "float32"), ("fp8", "bfloat16")])
def test_seeded_requests_alone_and_batched_are_token_identical(variant, dtype, tiny_random_dir,
                                                               tiny_random_fp8_dir):
    path = tiny_random_dir if variant == "bf16" else tiny_random_fp8_dir  # fp8: packed experts and linears
    llm = LLM(str(path), dtype=dtype, batch_invariant=True, num_kv_pages=64, kv_cache_page_size=16)
    prompts = ["The capital of France is", "Once upon a time there", "def fib(n):", "1 2 3 4 5",
               "Hello, my name is", "The quick brown fox", "In 1492, Columbus", "import numpy as np"]
    params = SamplingParams(seed=1234, temperature=1.0, top_p=0.95, top_k=40, max_tokens=32, ignore_eos=True)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    batched = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert [len(t) for t in alone] == [32] * 8
    assert batched == alone


def test_the_mode_is_chosen_by_argument_flag_or_environment():
    assert not batch_invariant_enabled(EngineArgs(), {})
    assert batch_invariant_enabled(EngineArgs(batch_invariant=True), {})
    assert batch_invariant_enabled(EngineArgs(), {"M2SERVE_BATCH_INVARIANT": "1"})
    assert not batch_invariant_enabled(EngineArgs(), {"M2SERVE_BATCH_INVARIANT": "0"})
    with pytest.raises(ValueError, match="M2SERVE_BATCH_INVARIANT"):
        batch_invariant_enabled(EngineArgs(), {"M2SERVE_BATCH_INVARIANT": "maybe"})
    parser = build_parser()
    flag = parser.parse_args(["generate", "--batch-invariant"])
    assert resolve_options(flag, parser, {})["batch_invariant"] is True
    env = {"M2SERVE_BATCH_INVARIANT": "true"}
    assert resolve_options(parser.parse_args(["generate"]), parser, env)["batch_invariant"] is True
    assert resolve_options(parser.parse_args(["generate"]), parser, {})["batch_invariant"] is False


def test_the_mode_is_refused_off_the_cpu(tiny_random_dir):
    with pytest.raises(ValueError, match="batch_invariant: implemented for CPU"):
        load_model(tiny_random_dir, dtype=torch.bfloat16, device="cuda", batch_invariant=True)
