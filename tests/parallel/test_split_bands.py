"""FP8 TP slices that split a 128-wide scale band (issue 30, docs/checkpoints.md §6 "Slices that
split a band"), loaded by one rank's shard plan from a locally built checkpoint.

The checkpoint (checkpoints/tiny_random.py, FP8 variant) has 64-wide heads (6 query, 2 KV) and an
intermediate size of 384, so at tp 2 rank 1's q rows start at 192, its K/V rows at 64, its o_proj
columns at 192 and its w1 / w3 rows and w2 columns at 192: each 64 into a band. Each rank's weights
must equal the same rows / columns of formats/fp8.py's dequantisation of the whole stored tensor, bit
for bit, held packed (the kernels' finer grid included) or dequantised at load, and the rank's
resident bytes must be the planner's figure (the bands its slices touch) to the byte; the linears and the
experts must compute with them (CPU kernels on the finer grid) as the dequantised weight + a matmul
does; and on 2 gloo ranks in TP_TP the model generates the single-process model's greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rank_helpers import greedy_tokens

from m2serve.config.engine_args import EngineArgs
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import validate_deployment
from m2serve.engine.planner import plan_memory
from m2serve.formats.fp8 import dequantize_fp8_block
from m2serve.formats.loader import open_checkpoint, packed_fp8
from m2serve.kernels.build import kernel_backend
from m2serve.kernels.choice import LinearImpl
from m2serve.model.load import load_model, resident_weight_bytes
from m2serve.parallel.deploy import load_rank, plan_deployment
from m2serve.parallel.launch import run_ranks
from m2serve.parallel.shard import make_shard_plan
from m2serve.parallel.worker import DistributedModel, worker_loop

DIMS = {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64, "rotary_dim": 32,
        "intermediate_size": 384, "num_local_experts": 4}


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory):
    from m2serve.checkpoints.tiny_random import build_tiny_random

    return build_tiny_random(tmp_path_factory.mktemp("split-bands") / "fp8", variant="fp8", **DIMS)


def _full(ckpt, name: str) -> torch.Tensor:
    """The whole stored weight, dequantised to fp32 by formats/fp8.py (the reference)."""
    plan = open_checkpoint(ckpt, MiniMaxM2Config.from_pretrained(ckpt))
    try:
        w = packed_fp8(plan, name)
        return dequantize_fp8_block(w.q, w.scale, torch.float32)
    finally:
        plan.reader.close()


@pytest.mark.parametrize("weight_dequant", ["runtime", "load"])
def test_rank_weights_are_the_whole_weights_slices(split_dir, weight_dequant):
    cfg = MiniMaxM2Config.from_pretrained(split_dir)
    state = validate_deployment(cfg, 2, encoding="fp8").state(1)
    model = load_model(split_dir, parallel=state, shard=make_shard_plan(cfg, state),
                       weight_dequant=weight_dequant)
    attn = model.model.layers[1].self_attn
    experts = model.model.layers[0].block_sparse_moe.experts
    p = "model.layers.1.self_attn"
    # rows [192, 384) of q, [64, 128) of k / v, columns [192, 384) of o_proj: all 64 into a band
    for proj, rows, cols in (("q_proj", (192, 384), None), ("k_proj", (64, 128), None),
                             ("v_proj", (64, 128), None), ("o_proj", None, (192, 384))):
        lin = getattr(attn, proj)
        want = _full(split_dir, f"{p}.{proj}.weight")
        want = want[rows[0]:rows[1]] if rows else want[:, cols[0]:cols[1]]
        assert torch.equal(lin.dense_weight(), want), proj
        if weight_dequant == "runtime":
            assert lin.packed and (lin.row0, lin.col0) == ((64, 0) if rows else (0, 64)), proj
            stored = lin.stored_weight()  # the kernels' finer grid: the same values
            assert (stored.block_n, stored.block_k) == ((64, 128) if rows else (128, 64)), proj
            assert torch.equal(stored.dequantize(0, torch.float32), want), proj
    e = 2
    for which, sl in (("w1", (slice(192, 384), slice(None))), ("w3", (slice(192, 384), slice(None))),
                      ("w2", (slice(None), slice(192, 384)))):
        want = _full(split_dir, f"model.layers.0.block_sparse_moe.experts.{e}.{which}.weight")[sl]
        w13, w2 = experts.expert_weights(e, torch.float32)
        got = {"w1": w13[:192], "w3": w13[192:], "w2": w2}[which]
        assert torch.equal(got, want), which
    # what the rank holds is what the planner counts for it (the bands its slices touch), to the byte
    args = EngineArgs(model=str(split_dir), devices="cpu:2", dtype="float32", weight_dequant=weight_dequant)
    assert resident_weight_bytes(model) == plan_memory(cfg, args, device_memory_gib=8).weight_bytes
    if weight_dequant == "runtime":
        assert experts.band0 == 64 and experts.kernel_weights is not None
        w13k, w2k = experts.kernel_weights
        assert (w13k.block_n, w2k.block_k) == (64, 64)
        w13, w2 = experts.expert_weights(e, torch.float32)
        assert torch.equal(w13k.dequantize(e, torch.float32), w13)
        assert torch.equal(w2k.dequantize(e, torch.float32), w2)


def test_split_band_linears_and_experts_compute_with_those_weights(split_dir):
    # runtime, CPU kernels chosen (finer grid): each linear against its dequantised weight + F.linear,
    # the experts against the same layer loaded dense at load (the torch reference's grouped_mm)
    assert kernel_backend().available, kernel_backend().banner()
    cfg = MiniMaxM2Config.from_pretrained(split_dir)
    state = validate_deployment(cfg, 2, encoding="fp8").state(1)
    shard = make_shard_plan(cfg, state)
    packed = load_model(split_dir, parallel=state, shard=shard, weight_dequant="runtime")
    dense = load_model(split_dir, parallel=state, shard=shard, weight_dequant="load")
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(0))
    for proj in ("q_proj", "k_proj", "o_proj"):
        lin = getattr(packed.model.layers[0].self_attn, proj)
        assert lin.choice.impl is LinearImpl.CPU_PACKED, proj
        xin = x[:, :lin.weight_q.shape[1]]
        ref = F.linear(xin.double(), lin.dense_weight().double())
        torch.testing.assert_close(lin(xin).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    ex = packed.model.layers[1].block_sparse_moe.experts
    ref_ex = dense.model.layers[1].block_sparse_moe.experts
    assert ex.choice.impl is LinearImpl.CPU_PACKED
    h = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, cfg.num_local_experts, (7, 2), generator=torch.Generator().manual_seed(2))
    w = torch.rand(7, 2, generator=torch.Generator().manual_seed(3))
    y, ref = ex(h, ids, w), ref_ex(h, ids, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _tp_tp(rank: int, world: int, ckpt: str) -> dict:
    out = {}
    for wd in ("runtime", "load"):
        args = EngineArgs(model=ckpt, devices="cpu:2", dtype="float32", weight_dequant=wd)
        _, dep = plan_deployment(args, world)
        state = dep.state(rank)
        model = load_rank(args, state, "cpu")
        if rank == 0:
            ref = greedy_tokens(load_model(ckpt, weight_dequant=wd), args)
            dm = DistributedModel(model, state)
            try:
                out[wd] = (dep.mode.value, greedy_tokens(dm, args), ref)
            finally:
                dm.stop()
        else:
            worker_loop(model, state)
    return out


@pytest.mark.slow  # starts two rank processes
def test_tp_tp_on_two_ranks_generates_as_one_process(split_dir):
    got = run_ranks(_tp_tp, 2, str(split_dir), timeout_s=120)[0]
    for wd in ("runtime", "load"):
        mode, tokens, ref = got[wd]
        assert mode == "TP_TP" and tokens == ref and all(len(t) == 8 for t in ref), wd
