"""The tiny-random builder (issue 2 item 5; docs/checkpoints.md §2, §4, §8; docs/parsers.md §1)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from tokenizers import Tokenizer

from m2serve.checkpoints import tiny_random
from m2serve.checkpoints.tiny_random import build_tiny_random, cached_tiny_random
from m2serve.formats.safetensors_io import CheckpointReader
from m2serve.text.tokenizer import ADDED_TOKENS


def _digest(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_deterministic_and_reused(tmp_path, tiny_random_dir):
    a = build_tiny_random(tmp_path / "a")
    assert _digest(a) == _digest(tiny_random_dir)  # same seed -> same bytes
    before = {f.name: f.stat().st_mtime_ns for f in a.iterdir()}
    assert build_tiny_random(a) == a  # complete dir: returned untouched
    assert {f.name: f.stat().st_mtime_ns for f in a.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    other = build_tiny_random(tmp_path / "b", seed=1)
    shard = "model-00001-of-00002.safetensors"
    assert _digest(other)[shard] != _digest(a)[shard]


def test_config_dims_and_release_keys(tiny_random_dir):
    cfg = json.loads((tiny_random_dir / "config.json").read_text())
    want = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
            "rotary_dim": 64, "intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "scoring_func": "sigmoid", "use_qk_norm": True,
            "qk_norm_type": "per_layer", "use_routing_bias": True, "tie_word_embeddings": False,
            "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2"}
    assert {k: cfg[k] for k in want} == want
    tok = Tokenizer.from_file(str(tiny_random_dir / "tokenizer.json"))
    V = cfg["vocab_size"]
    assert V % 128 == 0 and V - 128 < tok.get_vocab_size() <= V


def test_tokenizer_special_tokens_and_generation_config(tiny_random_dir):
    # docs/parsers.md §1: each special string is one token; bos/eos ids from the tokenizer
    tok = Tokenizer.from_file(str(tiny_random_dir / "tokenizer.json"))
    for t in ADDED_TOKENS:
        assert tok.encode(t, add_special_tokens=False).ids == [tok.token_to_id(t)], t
    assert tok.decode(tok.encode("héllo 東京 🙂").ids) == "héllo 東京 🙂"  # byte-level: lossless
    gen = json.loads((tiny_random_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == tok.token_to_id("]~b]") and gen["eos_token_id"] == tok.token_to_id("[e~[")
    assert (gen["temperature"], gen["top_p"], gen["top_k"]) == (1.0, 0.95, 40)
    tc = json.loads((tiny_random_dir / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"]) == ("]~!b[", "[e~[", "]!d~[")
    assert "chat_template" not in tc
    assert (tiny_random_dir / "chat_template.jinja").read_text() == tiny_random.TEMPLATE.read_text()


def test_weights_hub_layout_dtypes_and_nontrivial_init(tiny_random_dir):
    # docs/checkpoints.md §2 layout; router fp32; γ and bias away from their trivial init
    idx = json.loads((tiny_random_dir / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) == 2
    with CheckpointReader(tiny_random_dir) as r:
        info = r.tensors
        assert info["model.layers.0.block_sparse_moe.gate.weight"].dtype == "F32"
        assert info["model.layers.1.block_sparse_moe.e_score_correction_bias"].dtype == "F32"
        assert info["model.layers.1.block_sparse_moe.experts.7.w2.weight"].shape == (256, 512)
        assert info["lm_head.weight"].dtype == "BF16"
        gamma = r.read("model.layers.0.self_attn.q_norm.weight").float()
        bias = r.read("model.layers.0.block_sparse_moe.e_score_correction_bias")
    assert gamma.std() > 0.1 and bias.abs().min() > 0


def test_fp8_variant_official_format(tiny_random_fp8_dir, tiny_random_dir):
    # docs/checkpoints.md §4 quantization_config exactly like the release; §8 block quantisation
    cfg = json.loads((tiny_random_fp8_dir / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    with CheckpointReader(tiny_random_fp8_dir) as r, CheckpointReader(tiny_random_dir) as dense:
        q = "model.layers.0.self_attn.q_proj"
        assert r.tensors[q + ".weight"].dtype == "F8_E4M3"
        assert r.tensors[q + ".weight_scale_inv"].shape == (8, 2)
        assert r.tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight_scale_inv"].shape == (4, 2)
        assert r.tensors["model.layers.0.block_sparse_moe.gate.weight"].dtype == "F32"
        assert r.tensors["model.embed_tokens.weight"].dtype == "BF16"
        w = dense.read(q + ".weight").float()
        s = r.read(q + ".weight_scale_inv")
    assert s[0, 0].item() == (w[:128, :128].abs().max() / 448).item()


def test_fp8_requires_128_multiples(tmp_path):
    with pytest.raises(ValueError, match=r"multiple of 128, got \[192, 256\]"):
        build_tiny_random(tmp_path / "x", variant="fp8", intermediate_size=192)
    assert not (tmp_path / "x").exists()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="variant='int4'"):
        build_tiny_random(tmp_path / "x", variant="int4")
    with pytest.raises(ValueError, match=r"unknown dims \['hiddensize'\]"):
        build_tiny_random(tmp_path / "x", hiddensize=3)


def test_cached_tiny_random_builds_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("M2SERVE_CACHE", str(tmp_path))
    p = cached_tiny_random()
    assert p == tmp_path / "tiny-random" and (p / "config.json").is_file()


def test_loads_in_transformers(tiny_random_dir):
    import transformers  # a test extra (pyproject.toml)
    m = transformers.MiniMaxM2ForCausalLM.from_pretrained(tiny_random_dir, dtype=torch.float32)
    assert m.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert float(m.model.layers[0].mlp.e_score_correction_bias.abs().min()) > 0
