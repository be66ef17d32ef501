"""Builder of the ``tiny-random`` checkpoint: a complete, small, random MiniMax-M2 directory.

Deterministic from a seed, written atomically (temp dir, then rename). It exercises every
feature of the architecture: GQA ratio 2, head_dim 128 > rotary_dim 64, 8
experts top-2, 2 layers, untied lm_head, fp32 router gate and bias, random (non-trivial) norm
gammas and correction bias. Variants: ``bf16`` and ``fp8`` (official FP8 block format,
docs/checkpoints.md §4 and §8; every quantised dimension a multiple of 128). Weights are written in
the hub layout as an index + 2 shards, so sharded loading is exercised.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from m2serve.checkpoints import CHAT_TEMPLATE
from m2serve.checkpoints.tokenizer_train import train_tokenizer
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.quant import FP8_BLOCK
from m2serve.formats.fp8 import quantize_fp8_block
from m2serve.formats.names import expected_shapes, is_linear, is_router
from m2serve.formats.safetensors_io import INDEX_FILE
from m2serve.text.tokenizer import ADDED_TOKENS, CONTROL_TOKENS

TEMPLATE = CHAT_TEMPLATE

TINY_DIMS: dict[str, int] = {
    "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
    "rotary_dim": 64, "intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "max_position_embeddings": 4096,
}
_FP8_QUANT = {
    "activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
}
_VARIANTS = ("bf16", "fp8")


def build_tiny_random(out_dir: str | Path, seed: int = 0, variant: str = "bf16", **dims: int) -> Path:
    """Build the checkpoint into ``out_dir`` (returned as a Path) unless it is already there.

    ``dims`` override entries of ``TINY_DIMS`` (and ``vocab_size``, default: tokenizer size
    rounded up to a multiple of 128). Raises ValueError for an unknown variant / dim name, an
    FP8 variant whose quantised dims are not multiples of 128, and FileNotFoundError if
    ``chat_template.jinja`` is missing from the package.
    """
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / INDEX_FILE).is_file():
        return out
    if variant not in _VARIANTS:
        raise ValueError(f"variant={variant!r}: expected one of {_VARIANTS}")
    unknown = set(dims) - set(TINY_DIMS) - {"vocab_size"}
    if unknown:
        raise ValueError(f"unknown dims {sorted(unknown)}; allowed: {sorted(TINY_DIMS)} + vocab_size")
    if not TEMPLATE.is_file():
        raise FileNotFoundError(f"{TEMPLATE} is missing: the package's chat template must exist before "
                                "the tiny-random checkpoint can be built")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write(tmp, seed, variant, {**TINY_DIMS, **dims})
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent builder that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def cached_tiny_random() -> Path:
    """tiny-random (bf16) in ``$M2SERVE_CACHE`` or ``~/.cache/m2serve``, built on first use."""
    root = Path(os.environ.get("M2SERVE_CACHE") or Path.home() / ".cache" / "m2serve")
    return build_tiny_random(root / "tiny-random")


def _write(d: Path, seed: int, variant: str, dims: dict[str, int]) -> None:
    tok = train_tokenizer()
    tok.save(str(d / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in ADDED_TOKENS}
    vocab = dims.pop("vocab_size", None) or -(-tok.get_vocab_size() // FP8_BLOCK) * FP8_BLOCK
    if vocab < tok.get_vocab_size():
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer ({tok.get_vocab_size()} tokens)")
    config = _config_json(dims, vocab, variant)
    # informational only (m2serve reads bos/eos from generation_config.json, docs/model.md §1)
    config["bos_token_id"], config["eos_token_id"] = ids["]~!b["], ids["[e~["]
    cfg = MiniMaxM2Config.from_dict(config, source="tiny-random")
    tensors = _random_weights(cfg, seed)
    if variant == "fp8":
        tensors = _to_fp8(tensors)
    _save_sharded(d, tensors)
    _dump(d / "config.json", config)
    _dump(d / "generation_config.json", {
        "bos_token_id": ids["]~b]"], "eos_token_id": ids["[e~["], "do_sample": True,
        "temperature": 1.0, "top_p": 0.95, "top_k": 40})
    _dump(d / "tokenizer_config.json", {
        "add_prefix_space": False, "bos_token": "]~!b[", "eos_token": "[e~[", "unk_token": "]!d~[",
        "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_position_embeddings,
        "tokenizer_class": "GPT2Tokenizer",
        "added_tokens_decoder": {str(i): {"content": t, "special": t in CONTROL_TOKENS, "lstrip": False,
                                          "rstrip": False, "normalized": False, "single_word": False}
                                 for t, i in sorted(ids.items(), key=lambda kv: kv[1])}})
    shutil.copyfile(TEMPLATE, d / "chat_template.jinja")


def _config_json(dims: dict[str, int], vocab: int, variant: str) -> dict:
    """config.json with the keys of the released checkpoints (docs/model.md §1)."""
    config = {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
        "attention_dropout": 0.0, "attn_type_list": [1] * dims["num_hidden_layers"],
        "head_dim": dims["head_dim"], "hidden_act": "silu", "hidden_size": dims["hidden_size"],
        "initializer_range": 0.02, "intermediate_size": dims["intermediate_size"],
        "max_position_embeddings": dims["max_position_embeddings"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_experts_per_tok": dims["num_experts_per_tok"],
        "num_hidden_layers": dims["num_hidden_layers"], "num_key_value_heads": dims["num_key_value_heads"],
        "num_local_experts": dims["num_local_experts"], "output_router_logits": False,
        "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
        "rotary_dim": dims["rotary_dim"], "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "scoring_func": "sigmoid", "shared_intermediate_size": 0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_mtp": False, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": vocab,
    }
    if variant == "fp8":
        config["quantization_config"] = dict(_FP8_QUANT)
    return config


def _random_weights(cfg: MiniMaxM2Config, seed: int) -> dict[str, torch.Tensor]:
    """Hub-named tensors: bf16, except router gate + bias fp32. Each tensor is drawn from its own
    generator seeded by (seed, name), so it does not depend on the order or other dims."""
    out = {}
    for name, shape in expected_shapes(cfg).items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g)
        if name.endswith("e_score_correction_bias"):
            t = 0.05 * x  # comparable to the spread of the sigmoid scores: changes the choice
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = 1.0 + 0.25 * x  # gammas away from their trivial init of 1
        elif name.endswith("embed_tokens.weight"):
            t = x
        else:
            t = x / shape[-1] ** 0.5  # fan-in scaling keeps activations O(1)
        out[name] = t.float() if is_router(name) else t.to(torch.bfloat16)
    return out


def _to_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Quantise attention and expert linears to FP8 128x128 blocks (docs/checkpoints.md §8)."""
    out = {}
    for name, t in tensors.items():
        if is_linear(name):
            n, k = t.shape
            if n % FP8_BLOCK or k % FP8_BLOCK:
                raise ValueError(f"{name}: FP8 needs every quantised dimension a multiple of {FP8_BLOCK}, "
                                 f"got {[n, k]}")
            q, s = quantize_fp8_block(t)
            out[name] = q
            out[name[: -len("weight")] + "weight_scale_inv"] = s
        else:
            out[name] = t
    return out


def _save_sharded(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards split by tensor count, plus model.safetensors.index.json."""
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _dump(d / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
