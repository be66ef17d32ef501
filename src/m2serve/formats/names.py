"""Hub weight names: the expected set for a config, spelling variants and drop rules.

docs/checkpoints.md §2 (names and shapes) and docs/checkpoints.md §3 (adapter). m2serve keeps the hub names
(``model.layers.N.block_sparse_moe.experts.E.w1.weight`` ...) as its canonical names; the
``mlp.`` spelling of gate, bias and experts is accepted and mapped onto them.
"""

from __future__ import annotations

import re

from m2serve.config.model_config import MiniMaxM2Config

# Companion tensors of a quantised linear weight ``X.weight`` are named ``X.<suffix>``.
# compressed-tensors FP4 names its scalars weight_global_scale / input_global_scale (docs/checkpoints.md §4).
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale_2", "weight_scale", "input_scale", "weight_global_scale",
                  "input_global_scale")
# Optional fp8 KV-cache scales (docs/checkpoints.md §3.6): consumed by the KV cache only.
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:k_proj\.|v_proj\.)?([kv])_scale$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MLP_SPELLING = re.compile(r"\.mlp\.(gate\.weight|e_score_correction_bias|experts\.)")


def canonical_name(name: str) -> str:
    """Map the ``mlp.`` spelling of router/expert names to the hub's ``block_sparse_moe.``."""
    return _MLP_SPELLING.sub(r".block_sparse_moe.\1", name)


def drop_reason(name: str, num_hidden_layers: int) -> str | None:
    """Why a file tensor is dropped (docs/checkpoints.md §3.1-2), or None if it must be consumed.

    Returns ``"mtp"`` for ``model.layers.K.*`` with K >= L, ``"quantizer"`` for ModelOpt
    ``*_quantizer*`` artefacts and ``"inv_freq"`` for ``rotary_emb.inv_freq``.
    """
    if "_quantizer" in name:
        return "quantizer"
    if name.endswith("rotary_emb.inv_freq"):
        return "inv_freq"
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= num_hidden_layers:
        return "mtp"
    return None


def kv_scale_of(name: str) -> tuple[int, str] | None:
    """``(layer, "k"|"v")`` if ``name`` is an fp8 KV-cache scale (docs/checkpoints.md §3.6), else None."""
    m = _KV_SCALE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def split_companion(name: str) -> tuple[str, str] | None:
    """``("X.weight", suffix)`` if ``name`` is a scale companion ``X.<suffix>``, else None."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith("." + suffix):
            return name[: -len(suffix)] + "weight", suffix
    return None


def expected_shapes(cfg: MiniMaxM2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a dense checkpoint of ``cfg`` holds, with its global shape (docs/model.md §2)."""
    H, I, V, E = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_local_experts
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        out[p + "self_attn.q_proj.weight"] = (cfg.q_size, H)
        out[p + "self_attn.k_proj.weight"] = (cfg.kv_size, H)
        out[p + "self_attn.v_proj.weight"] = (cfg.kv_size, H)
        out[p + "self_attn.o_proj.weight"] = (H, cfg.q_size)
        out[p + "self_attn.q_norm.weight"] = (cfg.q_size,)
        out[p + "self_attn.k_norm.weight"] = (cfg.kv_size,)
        out[p + "block_sparse_moe.gate.weight"] = (E, H)
        out[p + "block_sparse_moe.e_score_correction_bias"] = (E,)  # optional if not use_routing_bias
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            out[q + "w1.weight"] = (I, H)
            out[q + "w3.weight"] = (I, H)
            out[q + "w2.weight"] = (H, I)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    return out


def is_linear(name: str) -> bool:
    """True for the weights that may be quantised: attention projections and expert w1/w2/w3."""
    return name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def is_router(name: str) -> bool:
    """True for the router gate and correction bias, which are held in fp32 (docs/model.md §5.1)."""
    return name.endswith(("block_sparse_moe.gate.weight", "e_score_correction_bias"))
