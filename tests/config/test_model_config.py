"""MiniMaxM2Config resolution and validation (docs/model.md §1)."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest

from m2serve.config.model_config import MiniMaxM2Config

# released M2 config.json (docs/model.md §1 release column; keys as the hub file has them)
RELEASE = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
    "head_dim": 128, "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608,
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "sliding_window": None,
    "tie_word_embeddings": False, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064,
    "bos_token_id": 1, "eos_token_id": 2, "use_mtp": True, "num_mtp_modules": 3,
}
GEN = {"bos_token_id": 200019, "eos_token_id": 200020, "temperature": 1.0, "top_p": 0.95, "top_k": 40}


def test_release_config_resolves_to_release_values():
    c = MiniMaxM2Config.from_dict(RELEASE, GEN)
    assert (c.hidden_size, c.num_hidden_layers) == (3072, 62)
    assert (c.num_attention_heads, c.num_key_value_heads) == (48, 8)
    assert (c.head_dim, c.rotary_dim, c.partial_rotary_factor, c.rope_theta) == (128, 64, 0.5, 5e6)
    assert c.attention_multiplier == 128 ** -0.5  # D = 128, not H / Hq = 64 (docs/model.md §5.4)
    assert (c.q_size, c.kv_size, c.num_key_value_groups) == (6144, 1024, 6)
    # bos / eos from generation_config.json, never config.json's 1 / 2
    assert c.bos_token_id == 200019 and c.eos_token_ids == (200020,)
    assert (c.generation.temperature, c.generation.top_p, c.generation.top_k) == (1.0, 0.95, 40)


def test_transformers_saved_config_is_valid(tmp_path):
    # docs/model.md §1: save_pretrained omits scoring_func, use_qk_norm, ...; absence is valid and
    # the rope values resolve as transformers resolves them (oracle)
    import transformers  # a test extra (pyproject.toml)
    hf = transformers.MiniMaxM2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=128, rotary_dim=64, num_hidden_layers=2, vocab_size=512)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "scoring_func" not in raw
    c = MiniMaxM2Config.from_pretrained(tmp_path)
    assert c.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.5
    assert c.rope_theta == hf.rope_parameters["rope_theta"]
    assert c.rotary_dim == 64 and c.head_dim == 128


def test_partial_rotary_factor_precedence():
    # top-level > rope_parameters > rotary_dim / D > 1.0
    base = {k: v for k, v in RELEASE.items() if k != "rotary_dim"}
    assert MiniMaxM2Config.from_dict(base).rotary_dim == 128
    assert MiniMaxM2Config.from_dict({**base, "rotary_dim": 32}).rotary_dim == 32
    with_rp = {**base, "rotary_dim": 32, "rope_parameters": {"partial_rotary_factor": 0.75}}
    assert MiniMaxM2Config.from_dict(with_rp).rotary_dim == 96
    assert MiniMaxM2Config.from_dict({**with_rp, "partial_rotary_factor": 0.5}).rotary_dim == 64


def test_conflicting_sources_warn(caplog):
    with caplog.at_level(logging.WARNING):
        c = MiniMaxM2Config.from_dict({**RELEASE, "rope_parameters": {"rope_theta": 1e4}}, source="cfg.json")
    assert c.rope_theta == 5e6
    assert "rope_theta=5000000.0 disagrees with rope_parameters.rope_theta=10000.0" in caplog.text


def test_rope_theta_from_rope_parameters_and_default():
    no_theta = {k: v for k, v in RELEASE.items() if k != "rope_theta"}
    assert MiniMaxM2Config.from_dict(no_theta).rope_theta == 5e6
    assert MiniMaxM2Config.from_dict({**no_theta, "rope_parameters": {"rope_theta": 1e6}}).rope_theta == 1e6


def test_head_dim_absent_falls_back_with_warning(caplog):
    cfg = {k: v for k, v in RELEASE.items() if k != "head_dim"}
    with caplog.at_level(logging.WARNING):
        c = MiniMaxM2Config.from_dict(cfg)
    assert c.head_dim == 64 and c.attention_multiplier == 64 ** -0.5 and "head_dim absent" in caplog.text


def test_attention_multiplier_field_and_eos_list():
    c = MiniMaxM2Config.from_dict({**RELEASE, "attention_multiplier": 0.1}, {"eos_token_id": [5, 6]})
    assert c.attention_multiplier == 0.1 and c.eos_token_ids == (5, 6) and c.bos_token_id is None


@pytest.mark.parametrize("field,value", [
    ("scoring_func", "softmax"), ("qk_norm_type", "per_head"), ("use_qk_norm", False),
    ("routed_scaling_factor", 2.5), ("norm_topk_prob", False), ("shared_intermediate_size", 1024),
    ("attn_type_list", [0, 1]), ("sliding_window", 4096),
])
def test_unsupported_variants_name_field_value_and_file(field, value):
    with pytest.raises(ValueError, match=re.escape(f"cfg.json: unsupported {field}={value!r}")):
        MiniMaxM2Config.from_dict({**RELEASE, field: value}, source="cfg.json")


def test_not_minimax():
    with pytest.raises(ValueError, match="not a MiniMax-M2 checkpoint"):
        MiniMaxM2Config.from_dict({**RELEASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})


@pytest.mark.parametrize("method,label", [("gptq", "GPTQ"), ("awq", "AWQ")])
def test_gptq_awq_not_implemented(method, label):
    with pytest.raises(NotImplementedError, match=f"{label} MiniMax-M2 checkpoints are not supported"):
        MiniMaxM2Config.from_dict({**RELEASE, "quantization_config": {"quant_method": method}})


def test_rope_scaling_not_implemented():
    with pytest.raises(NotImplementedError, match="rope_scaling.rope_type='yarn'"):
        MiniMaxM2Config.from_dict({**RELEASE, "rope_scaling": {"rope_type": "yarn", "factor": 4}})


def test_bad_rotary_dim_and_heads():
    with pytest.raises(ValueError, match="rotary_dim=33"):
        MiniMaxM2Config.from_dict({**RELEASE, "rotary_dim": 33})
    with pytest.raises(ValueError, match="num_attention_heads=48 is not a multiple of num_key_value_heads=7"):
        MiniMaxM2Config.from_dict({**RELEASE, "num_key_value_heads": 7})


def test_missing_field_names_field_and_file(tmp_path):
    cfg = {k: v for k, v in RELEASE.items() if k != "hidden_size"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: required field 'hidden_size' is missing"):
        MiniMaxM2Config.from_pretrained(tmp_path)


def test_eos_falls_back_to_tokenizer(tiny_random_dir, tmp_path):
    # docs/model.md §1: no eos in generation_config.json -> the tokenizer's eos_token
    d = shutil.copytree(tiny_random_dir, tmp_path / "c")
    (d / "generation_config.json").write_text("{}")
    vocab = json.loads((d / "tokenizer.json").read_text())["added_tokens"]
    eos_id = next(t["id"] for t in vocab if t["content"] == "[e~[")
    assert MiniMaxM2Config.from_pretrained(d).eos_token_ids == (eos_id,)


# Adversarial inputs (docs/model.md §1 "Raises ValueError naming the field, value and source file"): a
# hand-edited config.json with a value of the wrong type is a clear ValueError, never a silent int()
# coercion ("64" -> 64, 64.5 -> 64) nor an AttributeError / TypeError traceback.
@pytest.mark.parametrize("field,value,want", [
    ("hidden_size", "3072", "an integer"), ("hidden_size", 3072.5, "an integer"),
    ("hidden_size", [3072], "an integer"), ("num_hidden_layers", True, "an integer"),
    ("head_dim", "x", "an integer"), ("head_dim", -8, "a positive integer"),
    ("num_local_experts", "x", "an integer"), ("rotary_dim", "x", "an integer"),
    ("max_position_embeddings", -5, "a positive integer"), ("rms_norm_eps", "x", "a number"),
    ("rope_theta", "x", "a number"), ("rope_parameters", [1], "a JSON object or null"),
    ("quantization_config", [1], "a JSON object or null"), ("attn_type_list", 5, "all 1"),
])
def test_wrong_value_types_name_field_value_and_file(field, value, want):
    with pytest.raises(ValueError, match=re.escape(f"cfg.json: unsupported {field}={value!r} "
                                                   f"(m2serve supports {want}")):
        MiniMaxM2Config.from_dict({**RELEASE, field: value}, source="cfg.json")


def test_integral_float_sizes_accepted():
    assert MiniMaxM2Config.from_dict({**RELEASE, "hidden_size": 3072.0}).hidden_size == 3072


@pytest.mark.parametrize("eos", ["x", [2, "x"], -1, True])
def test_bad_generation_eos_names_field(eos):
    with pytest.raises(ValueError, match=r"cfg\.json: eos_token_id=.* \(generation_config\.json\) must be"):
        MiniMaxM2Config.from_dict(RELEASE, {"eos_token_id": eos}, source="cfg.json")


@pytest.mark.parametrize("name,text", [("config.json", "[1, 2]"), ("config.json", '"hi"'),
                                       ("generation_config.json", "[1]")])
def test_json_file_not_an_object(tmp_path, name, text):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE))
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=re.escape(name) + r": expected a JSON object at the top level, got"):
        MiniMaxM2Config.from_pretrained(tmp_path)


@pytest.mark.parametrize("field,value", [("temperature", "hot"), ("top_p", [1]), ("top_k", "x"),
                                         ("top_k", 2.5)])
def test_bad_generation_defaults_name_field_and_file(field, value):
    # docs/model.md §1 generation defaults; adversarial: was float('hot') ->
    # "could not convert string to float"
    want = f"cfg.json: unsupported {field} (generation_config.json)="
    with pytest.raises(ValueError, match=re.escape(want)):
        MiniMaxM2Config.from_dict(RELEASE, {field: value}, source="cfg.json")


# issue 16 item 7: corrupt values are refused with the field named, never replaced by a default
@pytest.mark.parametrize("field,value,want", [
    ("rms_norm_eps", float("nan"), "a finite number"), ("rms_norm_eps", float("inf"), "a finite number"),
    ("rms_norm_eps", 0.0, "a finite number > 0"), ("rms_norm_eps", -1e-6, "a finite number > 0"),
    ("max_position_embeddings", 0, "a positive integer"), ("num_local_experts", 0, "a positive integer"),
    ("num_key_value_heads", 0, "a positive integer"), ("rope_theta", float("nan"), "a finite number"),
    ("rope_theta", 0.0, "a finite number > 0"), ("attention_multiplier", float("inf"), "a finite number"),
    ("partial_rotary_factor", float("nan"), "a finite number"),
])
def test_corrupt_config_values_named(field, value, want):
    with pytest.raises(ValueError, match=re.escape(f"cfg.json: unsupported {field}={value!r} "
                                                   f"(m2serve supports {want})")):
        MiniMaxM2Config.from_dict({**RELEASE, field: value}, source="cfg.json")


def test_corrupt_config_file_named(tmp_path):  # NaN as json.dumps writes it, read from disk
    (tmp_path / "config.json").write_text(json.dumps({**RELEASE, "rms_norm_eps": float("nan")}))
    with pytest.raises(ValueError, match=r"config\.json: unsupported rms_norm_eps=nan"):
        MiniMaxM2Config.from_pretrained(tmp_path)


@pytest.mark.parametrize("eos", [200064, [200020, 300000]])
def test_eos_outside_vocabulary_refused(eos):  # issue 16 item 5; vocab_size 200064 -> ids 0..200063
    with pytest.raises(ValueError, match=r"cfg\.json: eos_token_id=\d+ \(generation_config\.json\) is "
                                         r"outside the vocabulary \(vocab_size=200064: ids 0\.\.200063\)"):
        MiniMaxM2Config.from_dict(RELEASE, {"eos_token_id": eos}, source="cfg.json")
    assert MiniMaxM2Config.from_dict(RELEASE, {"eos_token_id": 200063}).eos_token_ids == (200063,)


def test_max_reasoning_tokens_from_generation_config():
    # issue 26 item 8: the checkpoint's reasoning cap (docs/model.md §1); absent -> no cap
    from m2serve.config.model_config import MiniMaxM2Config

    cfg = {"architectures": ["MiniMaxM2ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 512,
           "vocab_size": 1536, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert MiniMaxM2Config.from_dict(cfg, {}).generation.max_reasoning_tokens is None
    assert MiniMaxM2Config.from_dict(cfg, {"max_reasoning_tokens": 64}).generation.max_reasoning_tokens == 64
    for bad in (0, -3, "many", True):
        with pytest.raises(ValueError, match="max_reasoning_tokens"):
            MiniMaxM2Config.from_dict(cfg, {"max_reasoning_tokens": bad})
