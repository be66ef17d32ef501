"""Parallelism mode selection and the startup validation rules (docs/parallelism.md §1, §5)."""

from __future__ import annotations

import logging

import pytest

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import (
    ParallelismMode,
    dp_attention,
    select_parallelism_mode,
    shard_ranges,
    validate_deployment,
)

TP_TP, TP_EP, DP_EP = ParallelismMode.TP_TP, ParallelismMode.TP_EP, ParallelismMode.DP_EP


def release(**over) -> MiniMaxM2Config:
    """The released MiniMax-M2 shapes (docs/model.md §1)."""
    dims = dict(hidden_size=3072, num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8,
                head_dim=128, intermediate_size=1536, vocab_size=200064, num_local_experts=256,
                num_experts_per_tok=8)
    dims.update(over)
    return MiniMaxM2Config(**dims)


# docs/parallelism.md §1: the selection table, conditions checked in order.
@pytest.mark.parametrize("devices,dp,ep,mode", [
    (1, 1, 1, DP_EP), (1, 8, 8, DP_EP), (0, 1, 1, DP_EP),       # single device first
    (8, 8, 8, DP_EP), (8, 8, 1, DP_EP), (2, 2, 1, DP_EP),       # dp > 1
    (8, 1, 8, TP_EP), (4, 1, 4, TP_EP),                         # EP configured
    (8, 1, 1, TP_TP), (2, 1, 1, TP_TP),                         # otherwise
])
def test_select_parallelism_mode(devices, dp, ep, mode):
    assert select_parallelism_mode(devices, dp, ep) is mode


# docs/parallelism.md §1: dp_attention is the only "batch split" predicate.
def test_dp_attention():
    assert dp_attention(DP_EP, 8)
    assert not dp_attention(DP_EP, 1)
    assert not dp_attention(TP_EP, 8)
    assert not dp_attention(TP_TP, 8)


# docs/serving.md §9: the five recipes give the modes of the table.
@pytest.mark.parametrize("encoding,dp,ep,mode", [
    ("fp8", 8, 8, DP_EP), ("nvfp4", 8, 8, DP_EP), ("mxfp4", 8, 8, DP_EP),
    ("nvfp4", 1, 8, TP_EP), ("nvfp4", 1, 1, TP_TP),
])
def test_recipes_validate(encoding, dp, ep, mode):
    d = validate_deployment(release(), 8, dp, ep, encoding=encoding, max_batch_input_tokens=1024)
    assert d.mode is mode
    assert d.tp_size == (1 if mode is DP_EP else 8)
    assert d.ep_size == ep


def test_v1_data_parallel_degree():  # docs/parallelism.md §5 V1
    with pytest.raises(ValueError, match=r"data_parallel_degree=2 must be 1 or the number of devices \(4\)"):
        validate_deployment(release(), 4, 2, 1)


def test_v2_kv_heads_not_replicated():  # docs/parallelism.md §5 V2
    with pytest.raises(ValueError, match=r"Number of KV heads \(8\) must be divisible by the tensor "
                                         r"parallel degree \(16\)"):
        validate_deployment(release(), 16)
    with pytest.raises(ValueError, match=r"Number of KV heads \(8\) must be divisible by the tensor "
                                         r"parallel degree \(3\); use a tensor parallel degree in \[1, 2\]"):
        validate_deployment(release(num_attention_heads=24), 3)


def test_v3_query_heads():  # docs/parallelism.md §5 V3
    with pytest.raises(ValueError, match=r"Number of attention heads \(12\) must be divisible by the "
                                         r"tensor parallel degree \(8\)"):
        validate_deployment(release(num_attention_heads=12, num_key_value_heads=4, intermediate_size=1024), 8)


def test_v4_ep_size_must_match_world():  # docs/parallelism.md §5 V4
    with pytest.raises(ValueError, match=r"ep_size=4 does not match the 8 devices of this deployment "
                                         r"\(devices per node × nodes\); set ep_size=8"):
        validate_deployment(release(), 8, 1, 4)
    with pytest.raises(ValueError, match=r"ep_size=2 does not match the 4 devices of this deployment "
                                         r"\(2 per node × 2 nodes\); set ep_size=4"):
        validate_deployment(release(), 4, 1, 2, num_nodes=2)
    with pytest.raises(ValueError, match=r"ep_size=8 does not match the 1 devices .*set ep_size=1"):
        validate_deployment(release(), 1, 1, 8)


def test_v5_experts_divisible_and_world_is_all_nodes():  # docs/parallelism.md §5 V5
    with pytest.raises(ValueError, match=r"num_local_experts=8 is not divisible by ep_size=3"):
        cfg = release(num_local_experts=8, num_attention_heads=24, num_key_value_heads=3)
        validate_deployment(cfg, 3, 1, 3)
    # 2 nodes x 2 devices is a 4-device deployment: TP over the world
    d = validate_deployment(release(), 4, 1, 4, num_nodes=2)
    assert (d.mode, d.tp_size, d.ep_size, d.world_size) == (TP_EP, 4, 4, 4)


def test_v6_plain_data_parallelism_accepted():  # docs/parallelism.md §5 V6
    d = validate_deployment(release(), 8, 8, 1)
    assert (d.mode, d.tp_size, d.ep_size) == (DP_EP, 1, 1)
    st = d.state(3)
    assert st.dp_rank == 3 and st.ep_size == 1
    r = shard_ranges(release(), st)
    assert r.experts == (0, 256) and r.intermediate == (0, 1536) and r.q_heads == (0, 48)


def test_v7_quantised_expert_split():  # docs/parallelism.md §5 V7
    # FP8 block experts split any way (issue 30): 192 per rank at tp 8 splits a 128-row band, and the
    # ranks keep the bands they touch (docs/checkpoints.md §6); NVFP4 (16) and MXFP4 (32) accept 192
    for devices in (2, 4, 8):
        assert validate_deployment(release(), devices, encoding="fp8").mode is TP_TP
    for enc in ("nvfp4", "mxfp4"):
        assert validate_deployment(release(), 8, encoding=enc).mode is TP_TP
    # EP splits whole experts, so FP8 at 8 devices is fine with ep_size=8
    assert validate_deployment(release(), 8, 1, 8, encoding="fp8").mode is TP_EP
    with pytest.raises(ValueError, match=r"NVFP4-quantised experts cannot be split 4 ways \(8 per rank is "
                                         r"not a multiple of 16\); use ep_size=4"):
        validate_deployment(release(intermediate_size=32), 4, encoding="nvfp4")
    with pytest.raises(ValueError, match=r"intermediate_size=1004 is not divisible by the tensor parallel "
                                         r"degree \(8\); use ep_size=8"):
        validate_deployment(release(intermediate_size=1004), 8)


def test_v8_memory_utilization():  # docs/parallelism.md §5 V8
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match=rf"device_memory_utilization={bad} must be in \(0, 1\]"):
            validate_deployment(release(), 1, device_memory_utilization=bad)
    assert validate_deployment(release(), 1, device_memory_utilization=1.0).mode is DP_EP


def test_v9_batch_size_clamped(caplog):  # docs/parallelism.md §5 V9
    with caplog.at_level(logging.INFO, logger="m2serve.config.parallel"):
        d = validate_deployment(release(), 1, max_batch_size=4096, max_batch_input_tokens=1024)
    assert d.max_batch_size == 1024
    assert "max_batch_size=4096 clamped to max_batch_input_tokens=1024" in caplog.text


def test_v10_allreduce_on_many_nodes():  # docs/parallelism.md §5 V10
    d = validate_deployment(release(), 8, 1, 8, ep_use_allreduce=True, num_nodes=2)
    assert d.mode is TP_EP and d.ep_use_allreduce and not d.state(0).sequence_parallel
    assert validate_deployment(release(), 8, 1, 8).state(0).sequence_parallel


def test_non_positive_degrees():
    with pytest.raises(ValueError, match=r"ep_size=0 must be a positive integer"):
        validate_deployment(release(), 2, 1, 0)


# docs/parallelism.md §2: rank r holds q heads [r·Hq/P, …), kv heads [r·Hkv/P, …), experts [r·E/ep, …).
def test_shard_ranges_per_mode():
    cfg = release()
    tp_tp = validate_deployment(cfg, 4).state(2)
    r = shard_ranges(cfg, tp_tp)
    assert r.q_heads == (24, 36) and r.kv_heads == (4, 6)
    assert r.experts == (0, 256) and r.intermediate == (768, 1152)
    tp_ep = validate_deployment(cfg, 8, 1, 8).state(7)
    r = shard_ranges(cfg, tp_ep)
    assert r.q_heads == (42, 48) and r.kv_heads == (7, 8)
    assert r.experts == (224, 256) and r.intermediate == (0, 1536)
    dp_ep = validate_deployment(cfg, 8, 8, 8).state(1)
    r = shard_ranges(cfg, dp_ep)
    assert r.q_heads == (0, 48) and r.kv_heads == (0, 8) and r.experts == (32, 64)
    with pytest.raises(ValueError, match="rank=8 is outside the world of 8 ranks"):
        validate_deployment(cfg, 8, 1, 8).state(8)


def test_fp8_attention_split_inside_a_band_accepted():  # issue 30, docs/parallelism.md §5
    # 4 KV heads x head_dim 64: tp 4 leaves 64 K/V rows per rank, half a 128-row FP8 band; accepted
    # (the rank keeps the band and its offset, docs/checkpoints.md §6), as is every degree dividing the heads
    cfg = release(num_key_value_heads=4, head_dim=64)
    for t in (1, 2, 4):
        assert validate_deployment(cfg, t, encoding="fp8").tp_size == t
    with pytest.raises(ValueError, match=r"Number of KV heads \(4\) must be divisible by the tensor parallel "
                                         r"degree \(8\); use a tensor parallel degree in \[1, 2, 4\]"):
        validate_deployment(cfg, 8, encoding="fp8")
