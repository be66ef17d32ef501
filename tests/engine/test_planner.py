"""Memory planner tests against the hand-derived figures of docs/serving.md §7 and docs/model.md §4.

The fixture is the shipped MiniMax-M2.7 config.json (release values, docs/model.md §1–§4). Every
expected number is derived here from the release shapes, term by term, never from the planner.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

import m2serve
from m2serve.config.engine_args import EngineArgs
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import ParallelismMode
from m2serve.engine import planner
from m2serve.engine.planner import (
    GiB,
    MiB,
    ep_activation_bytes,
    format_plan,
    measure_free_bytes,
    num_devices,
    plan_memory,
)

HUB = Path(m2serve.__file__).parent / "checkpoints" / "hub_configs"
GPU8 = "gpu:0,1,2,3,4,5,6,7"

# --- release shapes (docs/model.md §1-§2) and hand-derived bytes (docs/serving.md §7) --------------
H, L, Hq, Hkv, D, I, E, k, V = 3072, 62, 48, 8, 128, 1536, 256, 8, 200064
Q, KV = Hq * D, Hkv * D                                                   # 6144, 1024
# One step's activations without EP (docs/serving.md §7), bf16 (2 B), 8192 tokens, 256 sampled rows:
# hidden 2·8192·3072·2 = 100,663,296; attention (tp 1) 8192·(96 + 16)·128·2 = 234,881,024; MoE
# 8192·256·4 + 8192·8·(3·1536 + 3072)·2 = 8,388,608 + 1,006,632,960 = 1,015,021,568 (the larger);
# logits 256·200,064·4 = 204,865,536. Under TP_TP tp 8: MoE 8,388,608 + 8192·8·(3·192 + 3072)·2 =
# 486,539,264 > attention 29,360,128.
DENSE_ONE = 100_663_296 + 1_015_021_568 + 204_865_536                     # 1,320,550,400 B, 1.23 GiB
DENSE_TP8 = 100_663_296 + 486_539_264 + 204_865_536                       # 792,068,096 B, 0.74 GiB


def blocks(n: int, m: int) -> int:
    """Number of 128x128 FP8 scale blocks of an [n, m] weight."""
    return math.ceil(n / 128) * math.ceil(m / 128)


ATTN_ELEMS = Q * H + 2 * KV * H + H * Q                                   # q, k, v, o
ATTN_SCALES = blocks(Q, H) + 2 * blocks(KV, H) + blocks(H, Q)
EXPERT_ELEMS = 3 * H * I                                                  # w1, w3, w2
EXPERT_SCALES = 2 * blocks(I, H) + blocks(H, I)
ATTN_FP8 = ATTN_ELEMS * 1 + ATTN_SCALES * 4
EXPERTS_FP8 = E * (EXPERT_ELEMS * 1 + EXPERT_SCALES * 4)
QK_NORM = (Q + KV) * 2
LAYER_NORMS = 2 * H * 2
ROUTER = E * H * 4 + E * 4                                                # fp32 gate + bias
EMBED = LM_HEAD = V * H * 2
FINAL_NORM = H * 2


def test_hand_derived_terms_match_the_spec_table():
    # docs/serving.md §7 "Per layer" line, so the terms below are the spec's own figures
    assert (ATTN_FP8, ATTN_SCALES * 4) == (44_050_944, 10_752)
    assert (EXPERTS_FP8, E * EXPERT_SCALES * 4) == (3_624_763_392, 884_736)
    assert (QK_NORM, LAYER_NORMS, ROUTER) == (14_336, 12_288, 3_146_752)
    assert (EMBED, FINAL_NORM) == (1_229_193_216, 6_144)


REPLICATED = EMBED + LM_HEAD + FINAL_NORM
ONE_DEVICE = L * (ATTN_FP8 + EXPERTS_FP8 + QK_NORM + LAYER_NORMS + ROUTER) + REPLICATED
TP_EP_8 = L * (ATTN_FP8 // 8 + QK_NORM // 8 + EXPERTS_FP8 // 8 + LAYER_NORMS + ROUTER) + REPLICATED
DP_EP_8 = L * (ATTN_FP8 + QK_NORM + EXPERTS_FP8 // 8 + LAYER_NORMS + ROUTER) + REPLICATED


@pytest.fixture(scope="module")
def m27() -> MiniMaxM2Config:
    return MiniMaxM2Config.from_pretrained(HUB / "MiniMaxAI" / "MiniMax-M2.7")


def plan(config, device_memory_gib=1000.0, **kw):
    return plan_memory(config, EngineArgs(**kw), device_memory_gib=device_memory_gib)


# --- the shipped config (docs/model.md §1, docs/checkpoints.md §4) ---------------------------------

def test_m27_config_is_the_release(m27):
    raw = json.loads((HUB / "MiniMaxAI" / "MiniMax-M2.7" / "config.json").read_text())
    assert raw["quantization_config"] == {
        "quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    assert (m27.hidden_size, m27.num_hidden_layers, m27.num_attention_heads, m27.num_key_value_heads,
            m27.head_dim, m27.rotary_dim, m27.intermediate_size, m27.num_local_experts,
            m27.num_experts_per_tok, m27.vocab_size) == (H, L, Hq, Hkv, D, 64, I, E, k, V)
    assert m27.max_position_embeddings == 204_800
    assert (m27.bos_token_id, m27.eos_token_ids) == (200_019, (200_020,))
    g = m27.generation
    assert (g.temperature, g.top_p, g.top_k) == (1.0, 0.95, 40)


@pytest.mark.parametrize("repo, quant_method, encoding", [
    ("lukealonso/MiniMax-M2.7-NVFP4", "modelopt", "nvfp4"), ("amd/MiniMax-M2.7-MXFP4", "quark", "mxfp4"),
    ("MiniMaxAI/MiniMax-M2", "fp8", "fp8_block")])
def test_other_shipped_configs_load_and_plan(repo, quant_method, encoding):
    cfg = MiniMaxM2Config.from_pretrained(HUB / repo)
    assert cfg.quantization_config["quant_method"] == quant_method
    assert planner.checkpoint_encoding(cfg).value == encoding
    assert plan(cfg, devices=GPU8, ep_size=8, data_parallel_degree=8, weight_dequant="runtime").num_pages > 0


# --- KV bytes per token (docs/model.md §4, docs/serving.md §7 table) ------------------------------------

KV_TOKEN_BF16 = 2 * L * Hkv * D * 2


@pytest.mark.parametrize("kw, per_device", [
    (dict(devices="gpu"), KV_TOKEN_BF16),
    (dict(devices="gpu:0,1", ep_size=2), KV_TOKEN_BF16 // 2),
    (dict(devices="gpu:0,1,2,3", ep_size=4), KV_TOKEN_BF16 // 4),
    (dict(devices=GPU8, ep_size=8), KV_TOKEN_BF16 // 8),
    (dict(devices=GPU8, ep_size=8, data_parallel_degree=8), KV_TOKEN_BF16),
])
def test_kv_bytes_per_token(m27, kw, per_device):
    assert (KV_TOKEN_BF16, KV_TOKEN_BF16 // 8) == (253_952, 31_744)
    assert plan(m27, weight_dequant="runtime", **kw).kv_bytes_per_token == per_device


def test_fp8_kv_cache_doubles_the_kv_tokens(m27):
    kw = dict(devices=GPU8, ep_size=8, weight_dequant="runtime", device_memory_gib=141)
    bf16 = plan(m27, **kw)
    fp8 = plan(m27, kv_cache_format="float8_e4m3fn", **kw)
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.kv_budget_bytes == bf16.kv_budget_bytes
    assert fp8.num_pages in (2 * bf16.num_pages, 2 * bf16.num_pages + 1)  # floor of twice the pages
    assert fp8.kv_tokens >= 2 * bf16.kv_tokens


# --- weight bytes per device (docs/serving.md §7 table) -------------------------------------------

@pytest.mark.parametrize("kw, want, published", [
    (dict(devices="gpu"), ONE_DEVICE, 230_121_630_720),
    (dict(devices=GPU8, ep_size=8), TP_EP_8, 31_087_675_264),
    (dict(devices=GPU8, ep_size=8, data_parallel_degree=8), DP_EP_8, 33_478_216_704),
])
def test_weight_bytes_per_device(m27, kw, want, published):
    assert want == published
    p = plan(m27, weight_dequant="runtime", **kw)
    assert p.weight_bytes == want and p.checkpoint_bytes == want
    # the default (auto) on a GPU keeps FP8 as stored (issue 30): the same bytes
    assert plan(m27, **kw).weight_bytes == want
    # weight_dequant=load: the loader dequantises every FP8 linear to the compute dtype
    # (bf16, 2 B): FP8 bytes and scales replaced by 2 B per element
    loaded = plan(m27, weight_dequant="load", **kw)
    assert loaded.checkpoint_bytes == want
    shards = {"gpu": (1, 1), GPU8: (8, 8 if kw.get("data_parallel_degree") != 8 else 1)}[kw["devices"]]
    ep, tp = shards[0], shards[1]
    dense = L * (ATTN_ELEMS * 2 // tp + QK_NORM // tp + E * EXPERT_ELEMS * 2 // ep + LAYER_NORMS + ROUTER) \
        + EMBED + LM_HEAD + FINAL_NORM
    assert loaded.weight_bytes == dense


def test_parameter_count_consistent_with_model_md(m27):
    # docs/model.md §4: 228,689,764,864 parameters; the one-device FP8 total adds 3 B per fp32 scale
    # element and 1 B per bf16 element beyond the 1 B FP8 elements
    params = L * (ATTN_ELEMS + E * EXPERT_ELEMS + Q + KV + 2 * H + E * H + E) + 2 * V * H + H
    assert params == 228_689_764_864


def test_fp4_weight_bytes(m27):
    nv = MiniMaxM2Config.from_pretrained(HUB / "lukealonso" / "MiniMax-M2.7-NVFP4")
    mx = MiniMaxM2Config.from_pretrained(HUB / "amd" / "MiniMax-M2.7-MXFP4")
    rest = L * (ATTN_ELEMS * 2 + QK_NORM + LAYER_NORMS + ROUTER) + EMBED + LM_HEAD + FINAL_NORM
    linear = H * I
    # NVFP4: nibbles (1/2 B) + one E4M3 scale per 16 + weight_scale_2 and input_scale (fp32) per linear
    nv_experts = L * E * 3 * (linear // 2 + linear // 16 + 8)
    # MXFP4: nibbles + one E8M0 byte per 32
    mx_experts = L * E * 3 * (linear // 2 + linear // 32)
    assert plan(nv, devices="gpu", weight_dequant="runtime").weight_bytes == rest + nv_experts
    assert plan(mx, devices="gpu", weight_dequant="runtime").weight_bytes == rest + mx_experts
    dense = rest + L * E * EXPERT_ELEMS * 2
    assert plan(nv, devices="gpu", weight_dequant="load").weight_bytes == dense  # bf16 experts
    assert plan(nv, devices="gpu").weight_bytes == rest + nv_experts  # auto on a GPU: as stored
    # TP_TP tp 8 is allowed for NVFP4 (192 % 16 == 0, V7): experts split by I, attention by heads
    p = plan(nv, devices=GPU8, weight_dequant="runtime")
    assert p.mode is ParallelismMode.TP_TP
    linear8 = H * I // 8
    assert p.weight_bytes == (L * (ATTN_ELEMS * 2 // 8 + QK_NORM // 8 + LAYER_NORMS + ROUTER)
                              + EMBED + LM_HEAD + FINAL_NORM + L * E * 3 * (linear8 // 2 + linear8 // 16 + 8))


def test_tp_tp_8_accepted_for_fp8(m27):
    # issue 30: 1536 / 8 = 192 rows per rank splits a 128-row scale band (odd ranks start 64 rows in);
    # each rank holds its codes and the 2 bands its slice touches (docs/checkpoints.md §6): per expert
    # linear 192 x H codes + 2 x H/128 fp32 scales, one band more than an even 1/8 of the 12 bands
    p = plan(m27, devices=GPU8, weight_dequant="runtime")
    assert p.mode is ParallelismMode.TP_TP and p.tp_size == 8
    expert_linear = 192 * H + 2 * (H // 128) * 4
    per_layer = ATTN_FP8 // 8 + QK_NORM // 8 + E * 3 * expert_linear + LAYER_NORMS + ROUTER
    assert p.weight_bytes == L * per_layer + REPLICATED
    p = plan(m27, devices="gpu:0,1,2,3", weight_dequant="runtime")  # 384 = 3 x 128, whole bands
    assert p.mode is ParallelismMode.TP_TP and p.kv_bytes_per_token == KV_TOKEN_BF16 // 4


def test_activations_without_ep_are_one_steps_tensors(m27):
    # `m2serve plan` under TP_TP printed "activations 0.00 GiB": without EP the planner counted 0 (MAX's
    # rule), leaving a step's tensors to the utilisation headroom; now the hand-derived step (DENSE_*)
    p = plan(m27, devices=GPU8, weight_dequant="runtime", device_memory_gib=80)
    assert (p.mode, p.tp_size, p.activation_bytes) == (ParallelismMode.TP_TP, 8, DENSE_TP8)
    assert "activations / device       0.74 GiB (792,068,096 B)" in format_plan(p)
    one = plan(m27, devices="gpu", weight_dequant="runtime", device_memory_gib=300)
    assert one.activation_bytes == DENSE_ONE
    # speculative decoding samples up to 1 + K rows per sequence: 256 x 5 = 1280 rows of fp32 logits
    spec = plan(m27, devices=GPU8, weight_dequant="runtime", device_memory_gib=80,
                speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert spec.activation_bytes == DENSE_TP8 + (1280 - 256) * V * 4
    # the budget follows: free x 0.9 - (weights + activations + scratch)
    assert p.kv_budget_bytes == math.floor(80 * GiB * 0.9 - p.weight_bytes - DENSE_TP8 - 256 * MiB)


# --- the two "does not fit" errors (docs/serving.md §7) ---------------------------------------------

def test_model_does_not_fit_names_the_numbers(m27):
    # one device, FP8 held packed: 214.32 GiB of weights > 200 GiB
    with pytest.raises(RuntimeError, match=r"^model does not fit: weights 214\.32 GiB \+ activations "
                                           r"1\.23 GiB \+ scratch 0\.00 GiB > free 200\.00 GiB on device 0"):
        plan(m27, devices="gpu", weight_dequant="runtime", device_memory_gib=200)
    # TP_EP on 8 x 24 GiB: 28.95 GiB of weights per device
    with pytest.raises(RuntimeError, match=r"weights 28\.95 GiB \+ activations 0\.71 GiB \+ "
                                           r"scratch 0\.25 GiB > free 24\.00 GiB"):
        plan(m27, devices=GPU8, ep_size=8, weight_dequant="runtime", device_memory_gib=24,
             max_batch_input_tokens=1024)


def test_no_room_for_kv_cache_names_the_numbers(m27):
    # 230 GiB x 0.9 = 207 GiB < 215.55 GiB of weights and activations, although they alone fit
    with pytest.raises(RuntimeError, match=r"^no room for KV cache: free 230\.00 GiB x "
                                           r"device_memory_utilization=0\.9 - static 215\.55 GiB .* "
                                           r"at device_memory_utilization=0\.9"):
        plan(m27, devices="gpu", weight_dequant="runtime", device_memory_gib=230)
    # a budget below one page (128 x 253,952 B = 31 MiB) is no room either
    free = (ONE_DEVICE + DENSE_ONE + 10 * MiB) / 0.9 / GiB
    with pytest.raises(RuntimeError, match=r"no room for KV cache: .* less than one KV page of 31\.00 MiB"):
        plan(m27, devices="gpu", weight_dequant="runtime", device_memory_gib=free)


def test_pages_and_max_context_from_the_formula(m27):
    free = 141 * GiB
    moe_act = 8 * (128 * 64 * I * 2 + 128 * 64 * H * 2 + 256 * MiB)   # mbit 1024, dp 1: mt 128, bf16 dispatch
    ep_buf = 2 * 8 * (128 * H * 2 + E * 128 * H * 2 + k * 128 * H * 2)
    static = TP_EP_8 + (moe_act + ep_buf) // 8 + 256 * MiB
    budget = math.floor(free * 0.9 - static)
    pages = budget // (128 * KV_TOKEN_BF16 // 8)
    p = plan(m27, devices=GPU8, ep_size=8, weight_dequant="runtime", device_memory_gib=141,
             max_batch_input_tokens=1024)
    assert (p.static_bytes, p.kv_budget_bytes, p.num_pages) == (static, budget, pages)
    assert p.max_length == 204_800 <= p.kv_tokens


def test_max_length_lowered_or_refused(m27, caplog):
    kw = dict(devices="gpu", weight_dequant="runtime", device_memory_gib=230, device_memory_utilization=1.0)
    budget = math.floor(230 * GiB - ONE_DEVICE - DENSE_ONE)
    capacity = budget // (128 * KV_TOKEN_BF16) * 128
    assert capacity < 204_800
    with caplog.at_level("WARNING"):
        assert plan(m27, **kw).max_length == capacity
    assert "max_length lowered from 204800" in caplog.text
    with pytest.raises(ValueError, match=rf"max_length=200000 does not fit .* set max_length <= {capacity}"):
        plan(m27, max_length=200_000, **kw)
    assert plan(m27, max_length=1000, **kw).max_length == 1000


# --- EP buffer estimate: MAX's worked values (docs/serving.md §7) -------------------------------------

def test_ep_worked_values_dp8_fp8(m27):
    mt, recv = 1024, 1024 * min(E, 8 * k)                 # dp 8: mt = ceil(1024 / (8 / 8))
    moe_act = 8 * (recv * I * 1 + recv * H * 2 + 256 * MiB)
    per_dev = mt * H + E * mt * H + k * mt * H * 2        # tok = H x 1 B
    got = ep_activation_bytes(m27, 1024, num_devices=8, ep_size=8, data_parallel_degree=8, dispatch="fp8")
    assert got == (moe_act, 2 * 8 * per_dev)
    assert [round(x / GiB, 2) for x in (*got, sum(got))] == [5.75, 12.80, 18.55]


def test_ep_worked_values_fp4(m27):
    tok = int(H / 2 * 1.125)                              # 1728 B, scales included
    dp8 = ep_activation_bytes(m27, 1024, num_devices=8, ep_size=8, data_parallel_degree=8, dispatch="fp4")
    assert dp8[1] == 2 * 8 * (1024 * tok + E * 1024 * tok + k * 1024 * H * 2)
    assert [round(x / GiB, 2) for x in (*dp8, sum(dp8))] == [5.75, 7.53, 13.28]
    tp8 = ep_activation_bytes(m27, 1024, num_devices=8, ep_size=8, data_parallel_degree=1, dispatch="fp4")
    mt = 128                                              # ceil(1024 / (8 / 1))
    assert tp8 == (8 * (mt * 64 * I + mt * 64 * H * 2 + 256 * MiB),
                   2 * 8 * (mt * tok + E * mt * tok + k * mt * H * 2))
    assert [round(x / GiB, 2) for x in (*tp8, sum(tp8))] == [2.47, 0.94, 3.41]


def test_ep_allreduce_variant(m27):
    # ep_use_allreduce: every rank routes all mbit tokens; only its own E/ep experts' buffers
    got = ep_activation_bytes(m27, 1024, num_devices=8, ep_size=8, data_parallel_degree=1,
                              ep_use_allreduce=True, dispatch="bfloat16")
    mt, tok = 1024, H * 2
    assert got == (8 * (mt * 64 * I * 2 + mt * 64 * H * 2 + 256 * MiB),
                   2 * 8 * (mt * tok + (E // 8) * mt * tok + k * mt * H * 2))


# --- device memory, devices strings, bad arguments ---------------------------------------------

def test_cpu_memory_is_available_ram_shared_by_ranks():
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    one, source = measure_free_bytes("cpu", 1)
    assert 0 < one <= total and "available RAM" in source
    two, _ = measure_free_bytes("cpu:2", 2)
    assert abs(2 * two - one) < 0.2 * one  # RAM moves a little between the two reads


def test_gpu_without_cuda_suggests_device_memory_gib(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--device-memory-gib"):
        measure_free_bytes("gpu:0,1", 2)


def test_num_devices():
    assert [num_devices(d) for d in ("cpu", "cpu:4", "gpu", "gpu:0,1,2")] == [1, 4, 1, 3]
    for bad in ("tpu", "cpu:x", "cpu:0", "gpu:a"):
        with pytest.raises(ValueError, match=r"use cpu, cpu:N \(N CPU ranks\), gpu or gpu:0,1"):
            num_devices(bad)


@pytest.mark.parametrize("kw, field", [(dict(kv_cache_format="int8"), "kv_cache_format"),
                                       (dict(dtype="float64"), "dtype"),
                                       (dict(weight_dequant="never"), "weight_dequant"),
                                       (dict(kv_cache_page_size=0), "kv_cache_page_size"),
                                       (dict(max_length=0), "max_length=0 must be a positive"),
                                       (dict(max_length=-3), "max_length=-3 must be a positive"),
                                       (dict(device_memory_utilization=1.5), "device_memory_utilization")])
def test_bad_arguments_named(m27, kw, field):
    with pytest.raises(ValueError, match=field):
        plan(m27, devices="gpu", **kw)


def test_tiny_config_plans_on_this_cpu():
    cfg = MiniMaxM2Config.from_dict({
        "architectures": ["MiniMaxM2ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64,
        "intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512,
        "max_position_embeddings": 4096})
    p = plan_memory(cfg, EngineArgs(devices="cpu", dtype="float32", kv_cache_page_size=16))
    assert p.kv_bytes_per_token == 2 * 2 * 4 * 128 * 2 and p.max_length == 4096
    assert p.num_pages * 16 >= 4096 and "available RAM" in p.memory_source
    table = format_plan(p)
    assert "KV pages" in table and f"{p.num_pages:,} x 16 tokens" in table


def test_plain_data_parallel_holds_every_expert(m27):
    # V6: dp 8 with ep_size 1 is plain data parallelism; every device holds the whole model, so on
    # 141 GiB devices the planner (not an assertion) says it does not fit
    with pytest.raises(RuntimeError, match=r"model does not fit: weights 214\.32 GiB .* > free 141\.00 GiB"):
        plan(m27, devices=GPU8, data_parallel_degree=8, weight_dequant="runtime", device_memory_gib=141)
    p = plan(m27, devices=GPU8, data_parallel_degree=8, weight_dequant="runtime", device_memory_gib=300)
    assert (p.mode, p.weight_bytes, p.activation_bytes) == (ParallelismMode.DP_EP, ONE_DEVICE, DENSE_ONE)
    assert p.scratch_bytes == 256 * MiB and p.kv_bytes_per_token == KV_TOKEN_BF16


# --- CPU KV pool: a fixed size, not free RAM (issue 16 item 10) -------------------------------

TINY_CPU = {
    "architectures": ["MiniMaxM2ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64,
    "intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512,
    "max_position_embeddings": 4096}
TINY_PAGE = 16 * 2 * 2 * 4 * 128 * 2   # S x (K, V) x L x Hkv x D x bf16 = 65,536 B


@pytest.mark.parametrize("kw, pages", [
    (dict(max_batch_size=8), 8 * 4096 // 16),                          # 8 x 256 pages = 128 MiB < 4 GiB
    (dict(max_batch_size=8, max_length=1000), 8 * 63),                 # ceil(1000 / 16) = 63 pages each
    (dict(max_batch_size=512), 8 * 4096 // 16),                        # 8 sequences, not 512 (32 GiB)
    (dict(max_batch_size=4), 4 * 4096 // 16),                          # fewer than 8 running: 4
    (dict(max_batch_size=8, max_length=2**20), 4 * GiB // TINY_PAGE),  # 8 x 1 Mi tokens: the 4 GiB cap
    (dict(max_batch_size=8, kv_cache_memory_gib=0.5), GiB // 2 // TINY_PAGE),   # explicit size wins
    (dict(devices="cpu:2", max_batch_size=8), 8 * 4096 // 16),         # TP over 2 ranks: half the bytes
])
def test_cpu_kv_pool_rule(kw, pages):
    cfg = MiniMaxM2Config.from_dict({**TINY_CPU, "max_position_embeddings": 2**20})
    kw = {"max_length": 4096, **kw}
    args = EngineArgs(**{"devices": "cpu", "dtype": "float32", "kv_cache_page_size": 16, **kw})
    p = plan_memory(cfg, args)
    assert p.kv_bytes_per_token * 16 == TINY_PAGE // num_devices(args.devices)  # per rank
    assert p.num_pages == pages
    again = plan_memory(cfg, args)  # no free-memory reading enters the figure: identical each time
    assert (again.num_pages, again.kv_budget_bytes) == (p.num_pages, p.kv_budget_bytes)


def test_cpu_kv_pool_explicit_size_that_does_not_fit(m27):
    with pytest.raises(RuntimeError, match=r"kv_cache_memory_gib=900 does not fit: .*<="):
        plan(m27, devices="cpu", weight_dequant="runtime", kv_cache_memory_gib=900)
    with pytest.raises(ValueError, match=r"kv_cache_memory_gib=-1 must be a positive number of GiB"):
        plan(m27, devices="cpu", weight_dequant="runtime", kv_cache_memory_gib=-1)


def test_cpu_kv_pool_release(m27, caplog):
    # 8 x 196,608 tokens x 253,952 B want more than 4 GiB: 4 GiB // (128 x 253,952 B) = 132 pages
    p = plan(m27, devices="cpu", weight_dequant="runtime")
    assert p.num_pages == 4 * GiB // (128 * KV_TOKEN_BF16) == 132
    assert p.max_length == 132 * 128 and "4 GiB CPU default" in format_plan(p)
