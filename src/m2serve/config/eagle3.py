"""EAGLE-3 draft configuration: the public draft layout's config.json, the default auxiliary layer
ids and the draft-against-target checks (docs/serving.md §14).

Legend: H the draft's ``hidden_size``, Ht the target's hidden size, L the target's
``num_hidden_layers``, V the target vocabulary, Vd ``draft_vocab_size``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Auxiliary hidden states an EAGLE-3 draft reads (its ``fc`` takes 3 x Ht inputs).
NUM_AUX_LAYERS = 3


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, int, int]:
    """The target layers whose input hidden state an EAGLE-3 draft reads when its config names none
    (docs/serving.md §14): ``(2, L // 2, L - 3)`` (vLLM's and SGLang's default for MiniMax-M2) when
    2 < L // 2 < L - 3, i.e. L >= 7; otherwise (shallow targets: L = 4 gives 2, 2, 1) the quartiles
    ``(L // 4, L // 2, 3 L // 4)``, increasing for every L >= 3.

    num_hidden_layers: L, an int. Returns three increasing ints in [0, L) (the ``fc`` input blocks'
    order). Raises ValueError naming num_hidden_layers for
    L < 3 (three distinct layers do not exist).
    """
    L = num_hidden_layers
    if not isinstance(L, int) or isinstance(L, bool) or L < NUM_AUX_LAYERS:
        raise ValueError(f"num_hidden_layers={L!r}: an EAGLE-3 draft reads {NUM_AUX_LAYERS} distinct target "
                         f"layers, so the target needs at least {NUM_AUX_LAYERS}")
    ids = (2, L // 2, L - 3)
    if ids[0] < ids[1] < ids[2]:
        return ids
    return (L // 4, L // 2, (3 * L) // 4)


@dataclass(frozen=True, slots=True)
class Eagle3DraftConfig:
    """An EAGLE-3 draft's config.json (SpecForge's ``LlamaForCausalLMEagle3`` output, read by vLLM and
    SGLang; docs/serving.md §14). Build it with :meth:`from_dict` / :meth:`from_pretrained`.

    hidden_size H; num_attention_heads Hq; num_key_value_heads Hkv; head_dim D (default
    H // Hq); intermediate_size I; vocab_size V (the target's); draft_vocab_size Vd (default V);
    target_hidden_size Ht (default H); rms_norm_eps; rope_theta (RoPE over all D dims, rotate-half);
    norm_before_residual (vLLM's flag: the residual is taken after ``hidden_norm`` when true);
    aux_layer_ids: ``eagle_config.eagle_aux_hidden_state_layer_ids`` (or the top-level field of the
    same name), None when absent (then :func:`default_aux_layer_ids` of the target applies).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    norm_before_residual: bool
    aux_layer_ids: tuple[int, ...] | None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "draft config.json") -> Eagle3DraftConfig:
        """Parse and check the fields. Raises ValueError naming ``source`` and the field for a missing
        or bad value, or for what this draft runner does not implement (num_hidden_layers != 1,
        hidden_act other than silu, rope_scaling, attention_bias)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: must be a JSON object")

        def integer(name: str, default: int | None = None) -> int:
            v = cfg.get(name, default)
            if v is None:
                raise ValueError(f"{source}: {name} is required")
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{source}: {name}={v!r} must be a positive integer")
            return v

        def number(name: str, default: float) -> float:
            v = cfg.get(name, default)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{source}: {name}={v!r} must be a positive number")
            return float(v)

        H = integer("hidden_size")
        Hq = integer("num_attention_heads")
        Hkv = integer("num_key_value_heads", Hq)
        if Hq % Hkv:
            raise ValueError(f"{source}: num_attention_heads={Hq} must be a multiple of "
                             f"num_key_value_heads={Hkv}")
        D = integer("head_dim", H // Hq if H % Hq == 0 else None)
        if D % 2:
            raise ValueError(f"{source}: head_dim={D} must be even (rotary pairs)")
        V = integer("vocab_size")
        Vd = integer("draft_vocab_size", V)
        if Vd > V:
            raise ValueError(f"{source}: draft_vocab_size={Vd} must be <= vocab_size={V}")
        layers = cfg.get("num_hidden_layers", 1)
        if layers != 1:
            raise ValueError(f"{source}: num_hidden_layers={layers!r}: only one-layer EAGLE-3 drafts "
                             "(one midlayer) are supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act={act!r}: only silu is supported")
        if cfg.get("rope_scaling") not in (None, {}):
            raise ValueError(f"{source}: rope_scaling={cfg['rope_scaling']!r}: not supported "
                             "(plain RoPE only)")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError(f"{source}: attention_bias / mlp_bias: biased drafts are not supported")
        nbr = cfg.get("norm_before_residual", False)
        if not isinstance(nbr, bool):
            raise ValueError(f"{source}: norm_before_residual={nbr!r} must be true or false")
        eagle = cfg.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"{source}: eagle_config must be an object")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
        field_name = "eagle_config.eagle_aux_hidden_state_layer_ids"
        if ids is not None:
            if (not isinstance(ids, list) or len(ids) != NUM_AUX_LAYERS
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise ValueError(f"{source}: {field_name}={ids!r} must be a list of {NUM_AUX_LAYERS} "
                                 "integers")
            ids = tuple(ids)
        return cls(hidden_size=H, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                   intermediate_size=integer("intermediate_size"), vocab_size=V, draft_vocab_size=Vd,
                   target_hidden_size=integer("target_hidden_size", H),
                   rms_norm_eps=number("rms_norm_eps", 1e-6), rope_theta=number("rope_theta", 10000.0),
                   norm_before_residual=nbr, aux_layer_ids=ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Eagle3DraftConfig:
        """``path/config.json`` parsed by :meth:`from_dict`. Raises ValueError naming the file when it
        is absent or not JSON."""
        file = Path(path) / "config.json"
        if not file.is_file():
            why = "no config.json in that directory" if Path(path).is_dir() else (
                "no such directory (LLM and `m2serve serve` resolve a hub id to its snapshot; the "
                "engine itself takes a local directory)")
            raise ValueError(f"speculative_config.model={str(path)!r}: {why}")
        try:
            cfg = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e.msg} at line {e.lineno})") from e
        return cls.from_dict(cfg, str(file))

    def check_target(self, hidden_size: int, vocab_size: int, num_hidden_layers: int) -> tuple[int, ...]:
        """Refuse a draft that does not fit the target; return the aux layer ids to capture.

        hidden_size / vocab_size / num_hidden_layers: the target's H, V, L. Raises ValueError naming
        the draft field: target_hidden_size (or hidden_size when the config has no
        target_hidden_size) != the target's H, vocab_size != the target's V,
        eagle_config.eagle_aux_hidden_state_layer_ids out of [0, L) or repeated. Returns the
        config's ids, else :func:`default_aux_layer_ids` (L).
        """
        if self.target_hidden_size != hidden_size:
            name = "target_hidden_size" if self.target_hidden_size != self.hidden_size else "hidden_size"
            raise ValueError(f"EAGLE-3 draft {name}={self.target_hidden_size} does not match the target's "
                             f"hidden_size={hidden_size}")
        if self.vocab_size != vocab_size:
            raise ValueError(f"EAGLE-3 draft vocab_size={self.vocab_size} does not match the target's "
                             f"vocab_size={vocab_size}")
        if self.aux_layer_ids is None:
            return default_aux_layer_ids(num_hidden_layers)
        ids = self.aux_layer_ids
        bad = [i for i in ids if not 0 <= i < num_hidden_layers]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"EAGLE-3 draft eagle_config.eagle_aux_hidden_state_layer_ids={list(ids)}: "
                             f"must be {NUM_AUX_LAYERS} distinct target layers in [0, {num_hidden_layers})")
        return ids
