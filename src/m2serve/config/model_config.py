"""MiniMax-M2 model configuration from a checkpoint's ``config.json`` + ``generation_config.json``.

Every rule here is docs/model.md §1 (config resolution and validation). The result is a frozen
dataclass; nothing below reads weights.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m2serve.config.quant import REFUSED_QUANT_METHODS

log = logging.getLogger(__name__)

_ARCH = "MiniMaxM2ForCausalLM"
_MODEL_TYPE = "minimax_m2"



@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults from ``generation_config.json`` used when a request omits them.

    temperature / top_p / top_k are ``None`` when the file does not set them (the sampler's own
    defaults then apply: temperature 1.0, top_p 1.0, top_k disabled). max_reasoning_tokens (an m2serve
    key, not a transformers one): a chat reply still reasoning after this many tokens ends there,
    ``finish_reason`` ``length`` (SamplingParams.max_reasoning_tokens; None = no cap; docs/model.md §1).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_reasoning_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class MiniMaxM2Config:
    """Resolved MiniMax-M2 configuration (docs/model.md §1).

    Sizes use the field's standard names: H ``hidden_size``, L ``num_hidden_layers``,
    Hq ``num_attention_heads``, Hkv ``num_key_value_heads``, D ``head_dim``, R ``rotary_dim``,
    I ``intermediate_size`` (per expert), E ``num_local_experts``, k ``num_experts_per_tok``.
    ``quantization_config`` is the raw dict from config.json (or None); formats/detect.py decides
    the encoding from it and the safetensors headers.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_multiplier: float = 128 ** -0.5
    partial_rotary_factor: float = 0.5
    rotary_dim: int = 64
    rope_theta: float = 5e6
    max_position_embeddings: int = 196608
    use_routing_bias: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    quantization_config: dict[str, Any] | None = None
    source: str = "<dict>"

    @property
    def q_size(self) -> int:
        """Hq·D, the flattened query width (6144 in the release)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Hkv·D, the flattened key (and value) width (1024 in the release)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def num_key_value_groups(self) -> int:
        """Hq / Hkv: query heads per KV head (6 in the release)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None,
                  source: str = "<dict>") -> MiniMaxM2Config:
        """Resolve and validate a config dict (docs/model.md §1).

        Raises ValueError naming the field, value and ``source`` file for anything unsupported
        or inconsistent; NotImplementedError for non-default RoPE scaling and for GPTQ/AWQ/GGUF
        quantisation (docs/checkpoints.md §4).
        """
        gen = generation_config or {}
        archs = cfg.get("architectures") or []
        if _ARCH not in archs and cfg.get("model_type") != _MODEL_TYPE:
            raise ValueError(
                f"not a MiniMax-M2 checkpoint: {source} has architectures={archs!r}, "
                f"model_type={cfg.get('model_type')!r} (expected {_ARCH} / {_MODEL_TYPE})")

        def req(name: str) -> Any:
            if name not in cfg or cfg[name] is None:
                raise ValueError(f"{source}: required field '{name}' is missing")
            return cfg[name]

        def bad(name: str, value: Any, want: str) -> ValueError:
            return ValueError(f"{source}: unsupported {name}={value!r} (m2serve supports {want})")

        def integer(name: str, value: Any) -> int:
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, value, "an integer")
            return value

        def positive(name: str, value: Any) -> int:
            value = integer(name, value)
            if value < 1:
                raise bad(name, value, "an integer >= 1")
            return value

        def number(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise bad(name, value, "a number")
            if not math.isfinite(value):
                raise bad(name, value, "a finite number")
            return float(value)

        def given(name: str, default: Any) -> Any:  # absent or null -> default; 0 stays 0 (refused)
            return default if cfg.get(name) is None else cfg[name]

        def mapping(name: str) -> dict[str, Any] | None:
            value = cfg.get(name)
            if value is not None and not isinstance(value, dict):
                raise bad(name, value, "a JSON object or null")
            return value

        H = integer("hidden_size", req("hidden_size"))
        L = integer("num_hidden_layers", req("num_hidden_layers"))
        Hq = integer("num_attention_heads", req("num_attention_heads"))
        Hkv = integer("num_key_value_heads", given("num_key_value_heads", Hq))
        V = integer("vocab_size", req("vocab_size"))
        I = integer("intermediate_size", req("intermediate_size"))
        max_pos = integer("max_position_embeddings", given("max_position_embeddings", 196608))
        for name, val in (("hidden_size", H), ("num_hidden_layers", L), ("num_attention_heads", Hq),
                          ("num_key_value_heads", Hkv), ("vocab_size", V), ("intermediate_size", I),
                          ("max_position_embeddings", max_pos)):
            if val <= 0:
                raise bad(name, val, "a positive integer")
        if Hq % Hkv:
            raise ValueError(f"{source}: num_attention_heads={Hq} is not a multiple of "
                             f"num_key_value_heads={Hkv}")
        if cfg.get("head_dim") is not None:
            D = integer("head_dim", cfg["head_dim"])
            if D <= 0:
                raise bad("head_dim", D, "a positive integer")
        else:
            D = H // Hq
            log.warning("%s: head_dim absent; using hidden_size // num_attention_heads = %d "
                        "(wrong for released MiniMax-M2 configs, which set head_dim=128)", source, D)
        E = integer("num_local_experts", given("num_local_experts", 256))
        k = integer("num_experts_per_tok", given("num_experts_per_tok", 8))
        if E <= 0:
            raise bad("num_local_experts", E, "a positive integer")
        if not 0 < k <= E:
            raise ValueError(f"{source}: num_experts_per_tok={k} must be in [1, num_local_experts={E}]")

        # --- validation table of docs/model.md §1 ---
        checks = [
            ("scoring_func", lambda v: v in (None, "sigmoid"), "'sigmoid'"),
            ("qk_norm_type", lambda v: v in (None, "per_layer"),
             "'per_layer' (per-head QK norm is not implemented)"),
            ("use_qk_norm", lambda v: v in (None, True), "true"),
            ("routed_scaling_factor", lambda v: v is None or v == 1.0, "1.0"),
            ("norm_topk_prob", lambda v: v in (None, True), "true"),
            ("shared_intermediate_size", lambda v: v in (None, 0), "0 (no shared expert)"),
            ("attn_type_list", lambda v: v is None or (isinstance(v, list) and all(a == 1 for a in v)),
             "all 1 (full attention; 0 is MiniMax-01 linear attention)"),
            ("sliding_window", lambda v: v is None, "null (no sliding window)"),
        ]
        for name, ok, want in checks:
            if not ok(cfg.get(name)):
                raise bad(name, cfg.get(name), want)

        rope_params = mapping("rope_parameters") or {}
        rope_type = rope_params.get("rope_type") or rope_params.get("type")
        scaling = mapping("rope_scaling")
        scaling_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") if scaling else None
        for name, t in (("rope_parameters.rope_type", rope_type), ("rope_scaling.rope_type", scaling_type)):
            if t not in (None, "default"):
                raise NotImplementedError(f"{source}: {name}={t!r} is not supported (only default RoPE)")

        # partial_rotary_factor precedence: top-level > rope_parameters > rotary_dim / D > 1.0
        f_sources = [("partial_rotary_factor", cfg.get("partial_rotary_factor")),
                     ("rope_parameters.partial_rotary_factor", rope_params.get("partial_rotary_factor")),
                     ("rotary_dim / head_dim",
                      integer("rotary_dim", cfg["rotary_dim"]) / D if cfg.get("rotary_dim") else None)]
        f = _first([(n, None if v is None else number(n, v)) for n, v in f_sources], 1.0, source)
        R = int(D * f)
        if R <= 0 or R > D or R % 2:
            raise ValueError(f"{source}: rotary_dim={R} (head_dim {D} x partial_rotary_factor {f}) "
                             f"must be even and in (0, {D}]")
        theta = _first([(n, None if v is None else number(n, v))
                        for n, v in (("rope_theta", cfg.get("rope_theta")),
                                     ("rope_parameters.rope_theta", rope_params.get("rope_theta")))],
                       5e6, source)
        scale = cfg.get("attention_multiplier")
        scale = number("attention_multiplier", scale) if scale is not None else D ** -0.5
        eps = number("rms_norm_eps", given("rms_norm_eps", 1e-6))
        for name, val in (("rope_theta", theta), ("attention_multiplier", scale), ("rms_norm_eps", eps)):
            if not val > 0:
                raise bad(name, val, "a finite number > 0")

        eos = gen.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        for t in eos_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"{source}: eos_token_id={eos!r} (generation_config.json) must be a "
                                 "token id (int >= 0) or a list of them")
            if t >= V:
                raise ValueError(f"{source}: eos_token_id={t} (generation_config.json) is outside the "
                                 f"vocabulary (vocab_size={V}: ids 0..{V - 1}); set it to the id of the "
                                 "tokenizer's end-of-message token")

        quant = mapping("quantization_config")
        if quant is not None:
            method = str(quant.get("quant_method", "")).lower()
            if method in REFUSED_QUANT_METHODS:
                raise NotImplementedError(
                    f"{REFUSED_QUANT_METHODS[method]} MiniMax-M2 checkpoints are not supported "
                    f"({source}: quantization_config.quant_method={quant.get('quant_method')!r})")

        use_bias = cfg.get("use_routing_bias")
        return cls(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=Hq, num_key_value_heads=Hkv,
            head_dim=D, intermediate_size=I, vocab_size=V, num_local_experts=E, num_experts_per_tok=k,
            rms_norm_eps=eps,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_multiplier=scale, partial_rotary_factor=float(f), rotary_dim=R,
            rope_theta=float(theta),
            max_position_embeddings=max_pos,
            use_routing_bias=use_bias is None or bool(use_bias),
            bos_token_id=gen.get("bos_token_id"), eos_token_ids=eos_ids,
            generation=GenerationDefaults(
                temperature=_opt(gen, "temperature", number), top_p=_opt(gen, "top_p", number),
                top_k=_opt(gen, "top_k", integer),
                max_reasoning_tokens=_opt(gen, "max_reasoning_tokens", positive)),
            quantization_config=quant, source=source,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MiniMaxM2Config:
        """Load ``config.json`` (+ ``generation_config.json`` if present) from a directory.

        ``path`` may also be a ``config.json`` file itself. Raises FileNotFoundError naming the
        missing file, ValueError for invalid JSON (naming the file) and everything from_dict raises.
        """
        p = Path(path)
        cfg_file = p if p.is_file() else p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json in {p}")
        cfg = _read_json(cfg_file)
        gen_file = cfg_file.parent / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else {}
        if gen.get("eos_token_id") is None:
            eos = _tokenizer_eos_id(cfg_file.parent)
            if eos is not None:
                gen = {**gen, "eos_token_id": eos}
        return cls.from_dict(cfg, gen, source=str(cfg_file))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def _tokenizer_eos_id(d: Path) -> int | None:
    """Id of tokenizer_config.json's ``eos_token`` among tokenizer.json's added tokens, if any
    (the fallback of docs/model.md §1 when generation_config.json has no eos_token_id)."""
    tc, tj = d / "tokenizer_config.json", d / "tokenizer.json"
    if not (tc.is_file() and tj.is_file()):
        return None
    eos = _read_json(tc).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    for tok in _read_json(tj).get("added_tokens", []):
        if tok.get("content") == eos:
            return int(tok["id"])
    return None


def _opt(gen: dict[str, Any], name: str, conv: Any) -> Any:
    """generation_config.json's ``name`` through ``conv(name, value)`` (which names a bad value), or None."""
    return None if gen.get(name) is None else conv(f"{name} (generation_config.json)", gen[name])


def _first(sources: list[tuple[str, Any]], default: float, source: str) -> float:
    """First non-None value of ``sources``; warn if later sources disagree (docs/model.md §1)."""
    present = [(n, float(v)) for n, v in sources if v is not None]
    if not present:
        return default
    name, val = present[0]
    for other, v in present[1:]:
        if not math.isclose(v, val, rel_tol=1e-9):
            log.warning("%s: %s=%s disagrees with %s=%s; using %s", source, name, val, other, v, name)
    return val
