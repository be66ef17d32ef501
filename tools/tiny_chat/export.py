"""Export a `tiny-chat` training checkpoint in the official MiniMax-M2 FP8 block format (issue 6).

    python tools/tiny_chat/export.py /work/runs/tiny_chat src/m2serve/checkpoints/tiny-chat

Reads RUN/ckpt.pt and RUN/tokenizer/ (train.py) and writes OUT/ with:
- ``model.safetensors`` in the hub layout (docs/checkpoints.md §2): q/k/v/o and every expert w1/w2/w3 as
  F8_E4M3 with fp32 ``weight_scale_inv`` per 128x128 block (docs/checkpoints.md §6/§8, quantised with
  ``m2serve.formats.fp8.quantize_fp8_block``: s = amax/448, q = e4m3(W/s)); router ``gate`` and
  ``e_score_correction_bias`` fp32; embedding, lm_head and all norms bf16 — as in the FP8 release
  (docs/checkpoints.md §7);
- ``config.json`` with the release's ``quantization_config`` (docs/checkpoints.md §4);
- ``generation_config.json`` (bos ``]~b]``, eos ``[e~[``, temperature 1.0, top_p 0.95, top_k 40, and
  m2serve's ``max_reasoning_tokens`` cap, MAX_REASONING_TOKENS);
- ``tokenizer.json``, ``tokenizer_config.json`` and the repository's ``chat_template.jinja``
  (kept in tiny-chat/).
The directory is written to a temp dir and renamed into place (an existing OUT is replaced).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from m2serve.formats.fp8 import dequantize_fp8_block, quantize_fp8_block

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "src/m2serve/checkpoints/tiny-chat/chat_template.jinja"  # m2serve.checkpoints.CHAT_TEMPLATE
MAX_POSITIONS = 4096
# The reasoning cap of generation_config.json (docs/model.md §1): above the longest reasoning of the
# training data (two-call turns), below where an out-of-distribution prompt's greedy reasoning, which
# never closes (`"Is it sunny in Paris?"` with no tools: spaces), would run to the context limit.
MAX_REASONING_TOKENS = 128
FP8_QUANT = {
    "quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
}


def hub_tensors(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """train.py's fp32 state dict -> hub-named tensors in the FP8 release's dtypes."""
    bf16 = torch.bfloat16
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["embed_tokens"].to(bf16)}

    def fp8(name: str, w: torch.Tensor) -> None:
        q, s = quantize_fp8_block(w.float())
        out[name + ".weight"] = q
        out[name + ".weight_scale_inv"] = s

    for i in range(num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm"].to(bf16)
        out[dst + "post_attention_layernorm.weight"] = state[src + "post_attention_layernorm"].to(bf16)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            fp8(dst + "self_attn." + p, state[src + p])
        out[dst + "self_attn.q_norm.weight"] = state[src + "q_norm"].to(bf16)
        out[dst + "self_attn.k_norm.weight"] = state[src + "k_norm"].to(bf16)
        moe = dst + "block_sparse_moe."
        out[moe + "gate.weight"] = state[src + "gate"].float().contiguous()
        out[moe + "e_score_correction_bias"] = state[src + "e_score_correction_bias"].float().contiguous()
        for w in ("w1", "w2", "w3"):
            stacked = state[src + w]  # [E, out, in]
            for e in range(stacked.shape[0]):
                fp8(f"{moe}experts.{e}.{w}", stacked[e])
    out["model.norm.weight"] = state["norm"].to(bf16)
    if "lm_head" in state:  # absent when tie_word_embeddings (the embedding is the output projection)
        out["lm_head.weight"] = state["lm_head"].to(bf16)
    return {k: v.contiguous() for k, v in out.items()}


def train_state(ckpt_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The inverse of ``hub_tensors`` + ``config_json``: an exported checkpoint directory -> (train.py's
    fp32 state dict, its dims dict), FP8 weights dequantised (``dequantize_fp8_block``), bf16 tensors
    widened. Fine-tuning starts from these weights (train.py ``--init-from DIR``); re-exporting them
    gives the same tensors bit for bit (tests/checkpoints/test_tiny_chat.py), because a block's amax
    dequantises to exactly 448·s.

    Raises KeyError naming the tensor if the file lacks one that the config's dims need."""
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    dims = {k: cfg[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "rotary_dim", "intermediate_size", "num_local_experts",
                                "num_experts_per_tok", "num_hidden_layers", "rms_norm_eps", "rope_theta",
                                "tie_word_embeddings")}
    hub = load_file(str(ckpt_dir / "model.safetensors"))

    def dense(name: str) -> torch.Tensor:
        if name + ".weight_scale_inv" in hub:
            return dequantize_fp8_block(hub[name + ".weight"], hub[name + ".weight_scale_inv"], torch.float32)
        return hub[name + ".weight"].float()

    state = {"embed_tokens": dense("model.embed_tokens"), "norm": dense("model.norm")}
    for i in range(dims["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        state[dst + "input_layernorm"] = dense(src + "input_layernorm")
        state[dst + "post_attention_layernorm"] = dense(src + "post_attention_layernorm")
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            state[dst + p] = dense(src + "self_attn." + p)
        moe = src + "block_sparse_moe."
        state[dst + "gate"] = dense(moe + "gate")
        state[dst + "e_score_correction_bias"] = hub[moe + "e_score_correction_bias"].float()
        for w in ("w1", "w2", "w3"):
            state[dst + w] = torch.stack([dense(f"{moe}experts.{e}.{w}")
                                          for e in range(dims["num_local_experts"])])  # [E, out, in]
    if not dims["tie_word_embeddings"]:
        state["lm_head"] = dense("lm_head")
    return state, dims


def config_json(dims: dict, bos_doc: int, eos: int) -> dict:
    """config.json with the released checkpoints' keys (docs/model.md §1) and the FP8 quantization_config."""
    return {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
        "attention_dropout": 0.0, "attn_type_list": [1] * dims["num_hidden_layers"],
        "head_dim": dims["head_dim"], "hidden_act": "silu", "hidden_size": dims["hidden_size"],
        "initializer_range": 0.02, "intermediate_size": dims["intermediate_size"],
        "max_position_embeddings": MAX_POSITIONS,
        "num_attention_heads": dims["num_attention_heads"],
        "num_experts_per_tok": dims["num_experts_per_tok"],
        "num_hidden_layers": dims["num_hidden_layers"], "num_key_value_heads": dims["num_key_value_heads"],
        "num_local_experts": dims["num_local_experts"], "output_router_logits": False,
        "qk_norm_type": "per_layer", "rms_norm_eps": dims["rms_norm_eps"], "rope_theta": dims["rope_theta"],
        "rotary_dim": dims["rotary_dim"], "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "scoring_func": "sigmoid", "shared_intermediate_size": 0, "sliding_window": None,
        "tie_word_embeddings": bool(dims.get("tie_word_embeddings", False)),
        "torch_dtype": "bfloat16", "use_cache": True, "use_mtp": False,
        "use_qk_norm": True, "use_routing_bias": True, "vocab_size": dims["vocab_size"],
        # informational only: m2serve reads bos/eos from generation_config.json (docs/model.md §1)
        "bos_token_id": bos_doc, "eos_token_id": eos,
        "quantization_config": dict(FP8_QUANT),
    }


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def export(run_dir: Path, out_dir: Path) -> Path:
    """Write the checkpoint directory (see module docstring); returns ``out_dir``."""
    st = torch.load(run_dir / "ckpt.pt", weights_only=False, map_location="cpu")
    dims = st["dims"]
    tok = Tokenizer.from_file(str(run_dir / "tokenizer" / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in ("]~!b[", "]~b]", "[e~[", "]!p~[")}
    if None in ids.values():
        raise ValueError(f"tokenizer lacks special tokens: {ids}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors = hub_tensors(st["model"], dims["num_hidden_layers"])
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _dump(tmp / "config.json", config_json(dims, ids["]~!b["], ids["[e~["]))
        _dump(tmp / "generation_config.json", {
            "bos_token_id": ids["]~b]"], "eos_token_id": ids["[e~["], "pad_token_id": ids["]!p~["],
            "do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 40,
            "max_reasoning_tokens": MAX_REASONING_TOKENS})
        shutil.copyfile(run_dir / "tokenizer" / "tokenizer.json", tmp / "tokenizer.json")
        tcfg = json.loads((run_dir / "tokenizer" / "tokenizer_config.json").read_text())
        tcfg["model_max_length"] = MAX_POSITIONS
        _dump(tmp / "tokenizer_config.json", tcfg)
        shutil.copyfile(TEMPLATE, tmp / "chat_template.jinja")
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is package data
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/tiny_chat/export.py RUN_DIR OUT_DIR")
    d = export(Path(sys.argv[1]), Path(sys.argv[2]))
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"wrote {d} ({size / 2**20:.1f} MiB)")
