"""Shard plans and per-rank weight bytes (docs/parallelism.md §2, docs/serving.md §7)."""

from __future__ import annotations

import pytest

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import validate_deployment
from m2serve.parallel.shard import make_shard_plan, rank_weight_bytes


def release() -> MiniMaxM2Config:
    return MiniMaxM2Config(hidden_size=3072, num_hidden_layers=62, num_attention_heads=48,
                           num_key_value_heads=8, head_dim=128, intermediate_size=1536,
                           vocab_size=200064, num_local_experts=256, num_experts_per_tok=8)


def tiny(**over) -> MiniMaxM2Config:
    dims = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                head_dim=128, intermediate_size=512, vocab_size=512, num_local_experts=8,
                num_experts_per_tok=2)
    dims.update(over)
    return MiniMaxM2Config(**dims)


# docs/serving.md §7: the hand-derived table for the FP8 release (M2.7), v1 layout.
def test_release_fp8_bytes_per_device():
    cfg = release()
    one = validate_deployment(cfg, 1).state(0)
    assert rank_weight_bytes(cfg, one, "fp8") == 230_121_630_720
    tp_ep = validate_deployment(cfg, 8, 1, 8, encoding="fp8")
    assert {rank_weight_bytes(cfg, tp_ep.state(r), "fp8") for r in (0, 7)} == {31_087_675_264}
    dp_ep = validate_deployment(cfg, 8, 8, 8, encoding="fp8")
    assert {rank_weight_bytes(cfg, dp_ep.state(r), "fp8") for r in (0, 5)} == {33_478_216_704}
    # TP_TP tp 4 from the per-layer figures of §7: attention, experts, q/k norm ÷ 4; rest replicated
    per_layer = (44_050_944 + 3_624_763_392 + 14_336) // 4 + 12_288 + 3_146_752
    want = 62 * per_layer + 2 * 1_229_193_216 + 6_144
    tp_tp = validate_deployment(cfg, 4, encoding="fp8")
    assert rank_weight_bytes(cfg, tp_tp.state(3), "fp8") == want


# docs/parallelism.md §2: rank r reads q heads [r·Hq/P, …), kv heads [r·Hkv/P, …), o_proj the same heads'
# columns, q/k norm gamma with the heads, experts by intermediate dim (TP_TP) or expert range (EP).
def test_tiny_plans_tp_tp():
    cfg = tiny()
    plan = make_shard_plan(cfg, validate_deployment(cfg, 2, encoding="fp8").state(1))
    L = "model.layers.1"
    assert plan(f"{L}.self_attn.q_proj.weight", (1024, 256)) == (0, 512, 1024)
    assert plan(f"{L}.self_attn.q_proj.weight_scale_inv", (8, 2)) == (0, 4, 8)
    assert plan(f"{L}.self_attn.k_proj.weight", (512, 256)) == (0, 256, 512)
    assert plan(f"{L}.self_attn.v_proj.weight_scale_inv", (4, 2)) == (0, 2, 4)
    assert plan(f"{L}.self_attn.o_proj.weight", (256, 1024)) == (1, 512, 1024)
    assert plan(f"{L}.self_attn.o_proj.weight_scale_inv", (2, 8)) == (1, 4, 8)
    assert plan(f"{L}.self_attn.q_norm.weight", (1024,)) == (0, 512, 1024)
    assert plan(f"{L}.self_attn.k_norm.weight", (512,)) == (0, 256, 512)
    assert plan(f"{L}.block_sparse_moe.experts.5.w1.weight", (512, 256)) == (0, 256, 512)
    assert plan(f"{L}.block_sparse_moe.experts.5.w3.weight_scale_inv", (4, 2)) == (0, 2, 4)
    assert plan(f"{L}.mlp.experts.0.down_proj.weight", (256, 512)) == (1, 256, 512)
    assert plan(f"{L}.block_sparse_moe.experts.7.w2.weight_scale_inv", (2, 4)) == (1, 2, 4)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 f"{L}.block_sparse_moe.gate.weight", f"{L}.block_sparse_moe.e_score_correction_bias",
                 f"{L}.input_layernorm.weight", f"{L}.self_attn.k_proj.k_scale"):
        assert plan(name, (8, 256)) is None, name


def test_tiny_plans_ep():
    cfg = tiny()
    tp_ep = validate_deployment(cfg, 4, 1, 4)
    plan = make_shard_plan(cfg, tp_ep.state(2))  # experts [4, 6), q heads [4, 6), kv heads [2, 3)
    L = "model.layers.0"
    assert plan(f"{L}.self_attn.q_proj.weight", (1024, 256)) == (0, 512, 768)
    assert plan(f"{L}.self_attn.v_proj.weight", (512, 256)) == (0, 256, 384)
    got = {e: plan(f"{L}.block_sparse_moe.experts.{e}.w2.weight", (256, 512)) for e in range(8)}
    assert got == {0: "skip", 1: "skip", 2: "skip", 3: "skip", 4: None, 5: None, 6: "skip", 7: "skip"}
    dp = make_shard_plan(cfg, validate_deployment(cfg, 2, 2, 2).state(1))
    assert dp(f"{L}.self_attn.q_proj.weight", (1024, 256)) is None  # DP: attention replicated
    assert dp(f"{L}.block_sparse_moe.experts.3.w1.weight", (512, 256)) == "skip"
    assert dp(f"{L}.block_sparse_moe.experts.4.w1.weight", (512, 256)) is None


def test_whole_model_needs_no_plan():
    cfg = tiny()
    assert make_shard_plan(cfg, validate_deployment(cfg, 1).state(0)) is None
    assert make_shard_plan(cfg, validate_deployment(cfg, 4, 4, 1).state(3)) is None  # V6


def test_packed_fp4_companions():
    # NVFP4 w2 [H, I/2] bytes + [H, I/16] scales + scalar weight_scale_2 (docs/checkpoints.md §4)
    cfg = tiny()
    plan = make_shard_plan(cfg, validate_deployment(cfg, 2, encoding="nvfp4").state(1))
    L = "model.layers.0.block_sparse_moe.experts.2.w2"
    assert plan(f"{L}.weight", (256, 256)) == (1, 128, 256)
    assert plan(f"{L}.weight_scale", (256, 32)) == (1, 16, 32)
    assert plan(f"{L}.weight_scale_2", ()) is None


def test_fp8_grid_split_inside_a_band():
    # issue 30: FP8 experts in TP_TP 8 (1536 / 8 = 192 rows per rank; odd ranks start 64 rows into a
    # 128-row band): each rank reads the scale bands its slice touches, a split band on both ranks
    cfg = release()
    dep = validate_deployment(cfg, 8, encoding="fp8")
    w1 = "model.layers.3.block_sparse_moe.experts.9.w1"
    w2 = "model.layers.3.block_sparse_moe.experts.9.w2"
    r0, r1, r7 = (make_shard_plan(cfg, dep.state(r)) for r in (0, 1, 7))
    assert r1(f"{w1}.weight", (1536, 3072)) == (0, 192, 384)
    assert r0(f"{w1}.weight_scale_inv", (12, 24)) == (0, 0, 2)      # rows [0, 192): bands 0, 1
    assert r1(f"{w1}.weight_scale_inv", (12, 24)) == (0, 1, 3)      # rows [192, 384): bands 1, 2
    assert r1(f"{w2}.weight_scale_inv", (24, 12)) == (1, 1, 3)      # the same along w2's columns
    assert r7(f"{w1}.weight_scale_inv", (12, 24)) == (0, 10, 12)    # rows [1344, 1536)
    # hand-derived bytes per rank: attention is whole 128-row heads (÷ 8); each expert linear is
    # 192 x 3072 codes + 2 bands x 24 fp32 scales; norms, router, embedding, lm_head replicated
    attention = 2 * 768 * 3072 + 2 * 128 * 3072 + (2 * 6 + 2 * 1) * 24 * 4
    experts = 256 * 3 * (192 * 3072 + 2 * 24 * 4)
    per_layer = attention + (768 + 128) * 2 + experts + 2 * 3072 * 2 + 256 * 3072 * 4 + 256 * 4
    want = 62 * per_layer + 2 * 200064 * 3072 * 2 + 3072 * 2
    assert {rank_weight_bytes(cfg, dep.state(r), "fp8") for r in (0, 1)} == {want}  # even, odd rank
    # FP4 group scales along K are still never split (w2 columns at 24 of 96, groups of 16)
    small = tiny(intermediate_size=96)
    nv = make_shard_plan(small, validate_deployment(small, 4).state(1))
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.weight_scale: cannot cut \[24, 48\)"):
        nv("model.layers.0.block_sparse_moe.experts.0.w2.weight_scale", (256, 6))
