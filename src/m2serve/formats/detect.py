"""Checkpoint encoding detection (docs/checkpoints.md §4): ``quantization_config`` first, then headers.

The checkpoint-level answer (:func:`detect_encoding`) validates the config; the per-linear answer
(:func:`linear_kind`) comes from each weight's header dtype and its companion tensors, so a
release whose excluded layers were left in another form still loads correctly.
"""

from __future__ import annotations

import enum
import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m2serve.config.quant import FP8_BLOCK, MXFP4_GROUP, NVFP4_GROUP, REFUSED_QUANT_METHODS
from m2serve.formats.act_quant import ActivationScheme
from m2serve.formats.safetensors_io import FLOAT_HEADER_DTYPES, TensorInfo

HF_QUANT_CONFIG = "hf_quant_config.json"


class Encoding(enum.Enum):
    """Checkpoint weight encoding (docs/checkpoints.md §4)."""

    DENSE = "dense"
    FP8_BLOCK = "fp8_block"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"


class LinearKind(enum.Enum):
    """How one linear weight is stored (docs/checkpoints.md §4, per-linear table).

    NVFP4 is ModelOpt's naming (``weight``, ``weight_scale``, ``weight_scale_2``); NVFP4_CT is
    compressed-tensors' (``weight_packed``, ``weight_scale``, ``weight_global_scale``), whose
    formula differs (docs/checkpoints.md §4: never mix them).
    """

    DENSE = "dense"
    FP8_BLOCK = "fp8_block"
    NVFP4 = "nvfp4"
    NVFP4_CT = "nvfp4_ct"
    MXFP4 = "mxfp4"


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """Checkpoint-level quantisation facts (docs/checkpoints.md §4).

    ``exclude``: the config's ignore / exclude list. ModelOpt and Quark patterns are fnmatch
    globs (``model.layers.0.self_attn*``, ``*self_attn*``); compressed-tensors patterns are exact
    module names or ``re:`` regexes matched from the start (``ct_patterns``), as its
    ``match_name`` does.

    ``activations``: the FP4 input quantisation the config declares for its quantised linears
    (W4A4, docs/checkpoints.md §9), None for weight-only. ``activations_unsupported``: why a declared
    input quantisation cannot be reproduced (then ``activations`` is None; ``activation_quant auto``
    refuses to load, ``none`` runs W4A16).
    """

    encoding: Encoding
    exclude: tuple[str, ...] = ()
    ct_patterns: bool = False
    source: str = "config.json"
    activations: ActivationScheme | None = None
    activations_unsupported: str | None = None

    def excluded_by(self, module: str) -> str | None:
        """The first pattern that excludes ``module`` (e.g. ``model.layers.0.self_attn.q_proj``)."""
        for pat in self.exclude:
            if self.ct_patterns:
                hit = re.match(pat[3:], module) is not None if pat.startswith("re:") else pat == module
            else:
                hit = fnmatch.fnmatchcase(module, pat)
            if hit:
                return pat
        return None

    def check_linear(self, module: str, kind: LinearKind) -> None:
        """Cross-check one linear's header kind against the config (docs/checkpoints.md §4).

        In an FP4 checkpoint a module matched by the ignore / exclude list must not be packed FP4
        (it may be dense or FP8 block), every other linear must be packed in this checkpoint's
        convention; a checkpoint without an FP4 config must hold no packed FP4 weight. Raises
        ValueError naming the module, the kind found and the pattern or config responsible.
        """
        fp4 = kind in (LinearKind.NVFP4, LinearKind.NVFP4_CT, LinearKind.MXFP4)
        if self.encoding not in (Encoding.NVFP4, Encoding.MXFP4):
            if fp4:
                raise ValueError(f"{module}: packed FP4 ({kind.value}) weight, but {self.source} declares a "
                                 f"{self.encoding.value} checkpoint (no FP4 quantization_config)")
            return
        pattern = self.excluded_by(module)
        if fp4 and pattern:
            raise ValueError(f"{module}: {kind.value} weight, but {self.source} excludes it from "
                             f"quantisation (pattern {pattern!r})")
        if not fp4 and not pattern:
            raise ValueError(f"{module}: {kind.value} weight, but {self.source} quantises it "
                             "(it matches no ignore/exclude pattern)")
        want = (LinearKind.MXFP4 if self.encoding is Encoding.MXFP4
                else LinearKind.NVFP4_CT if self.ct_patterns else LinearKind.NVFP4)
        if fp4 and kind is not want:
            raise ValueError(f"{module}: {kind.value} weight in a {want.value} checkpoint ({self.source})")


def detect_encoding(quant: dict[str, Any] | None, source: str = "config.json") -> Encoding:
    """The checkpoint's encoding from its ``quantization_config`` (None = dense); see :func:`detect_quant`."""
    return detect_quant(quant, source).encoding


def checkpoint_quant_config(directory: str | Path, quant: dict[str, Any] | None,
                            source: str = "config.json") -> tuple[dict[str, Any] | None, str]:
    """``(quantization_config, source)`` for a checkpoint directory (docs/checkpoints.md §1, §4).

    config.json's ``quantization_config`` wins; only without one is a ModelOpt
    ``hf_quant_config.json`` (``{"quantization": {"quant_algo", "group_size",
    "exclude_modules"}}``) read, as the secondary NVFP4 signal. (A compressed-tensors conversion of
    a ModelOpt export carries the stale file along; config.json decides.) Raises ValueError
    naming the file when it is not valid JSON or lacks ``quantization``.
    """
    if quant:
        return quant, source
    path = Path(directory) / HF_QUANT_CONFIG
    if not path.is_file():
        return quant, source
    try:
        q = json.loads(path.read_text())["quantization"]
        if not isinstance(q, dict):
            raise TypeError("not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a ModelOpt hf_quant_config.json "
                         f"(needs a 'quantization' object: {e})") from e
    return {"quant_method": "modelopt", "quant_algo": q.get("quant_algo"), "group_size": q.get("group_size"),
            "ignore": q.get("exclude_modules") or []}, str(path)


def detect_quant(quant: dict[str, Any] | None, source: str = "config.json") -> QuantSpec:
    """Validate ``quantization_config`` and return the checkpoint's :class:`QuantSpec`.

    Dense (absent), FP8 block (``fp8``), NVFP4 (``modelopt`` with quant_algo NVFP4, group 16),
    MXFP4 (``quark``: fp4 per_group, group 32, e8m0 scales) and compressed-tensors FP4
    (``config_groups`` weights 4-bit float, group 16 -> NVFP4, 32 -> MXFP4). Raises ValueError
    naming the field and value for an FP8 config other than dynamic 128x128 e4m3 blocks, an
    unknown ModelOpt ``quant_algo``, a group size other than 16 / 32, a non-fp4 Quark or
    compressed-tensors scheme, or an unknown ``quant_method``; NotImplementedError for
    GPTQ/AWQ/GGUF (as MAX).
    """
    if not quant:
        return QuantSpec(Encoding.DENSE, source=source)
    method = str(quant.get("quant_method", "")).lower()
    if method in REFUSED_QUANT_METHODS:
        raise NotImplementedError(f"{REFUSED_QUANT_METHODS[method]} MiniMax-M2 checkpoints are not supported "
                                  f"({source})")
    if method == "fp8":
        want = {"fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        for key, val in want.items():
            got = quant.get(key, val if key == "fmt" else None)
            if got != val:
                raise ValueError(f"{source}: quantization_config.{key}={got!r} is not supported "
                                 f"(FP8 block checkpoints need {key}={val!r})")
        return QuantSpec(Encoding.FP8_BLOCK, source=source)
    if method == "modelopt":
        return _modelopt(quant, source)
    if method == "quark":
        return _quark(quant, source)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, source)
    raise ValueError(f"{source}: unknown quantization_config.quant_method={quant.get('quant_method')!r} "
                     "(supported: fp8, modelopt, quark, compressed-tensors; none for BF16)")


def _check_group(got: Any, want: int, field: str, source: str, label: str) -> None:
    if got != want:
        raise ValueError(f"{source}: {field}={got!r} is not supported ({label} uses group size {want}; "
                         f"supported FP4 group sizes: NVFP4 {NVFP4_GROUP}, MXFP4 {MXFP4_GROUP})")


def _modelopt(quant: dict[str, Any], source: str) -> QuantSpec:
    algo = quant.get("quant_algo")
    if algo != "NVFP4":
        raise ValueError(f"{source}: quantization_config.quant_algo={algo!r} is not supported "
                         "(ModelOpt checkpoints: NVFP4)")
    weights = (quant.get("config_groups") or {}).get("group_0", {}).get("weights") or {}
    if weights:
        if weights.get("num_bits") != 4 or weights.get("type") != "float":
            raise ValueError(f"{source}: quantization_config.config_groups.group_0.weights="
                             f"{weights!r} is not NVFP4 (needs num_bits 4, type float)")
        _check_group(weights.get("group_size"), NVFP4_GROUP,
                     "quantization_config.config_groups.group_0.weights.group_size", source, "NVFP4")
    if "group_size" in quant:
        _check_group(quant["group_size"], NVFP4_GROUP, "quantization.group_size", source, "NVFP4")
    # ModelOpt's NVFP4 algorithm quantises the inputs too (W4A4); config_groups, when written, say so
    inputs = (quant.get("config_groups") or {}).get("group_0", {}).get("input_activations")
    declared = inputs is not None if weights else True
    act, why = (_nvfp4_inputs(inputs or {}, "quantization_config.config_groups.group_0.input_activations",
                              source) if declared else (None, None))
    return QuantSpec(Encoding.NVFP4, tuple(quant.get("ignore") or quant.get("exclude_modules") or ()),
                     source=source, activations=act, activations_unsupported=why)


def _nvfp4_inputs(inputs: dict[str, Any], field: str, source: str,
                  scheme: ActivationScheme = ActivationScheme.NVFP4
                  ) -> tuple[ActivationScheme | None, str | None]:
    """Declared NVFP4 input activations -> (``scheme``, None): ModelOpt's rules (NVFP4) or
    compressed-tensors' (NVFP4_CT), docs/checkpoints.md §9; (None, why) when not 4-bit float per 16."""
    got = (inputs.get("num_bits", 4), inputs.get("type", "float"), inputs.get("group_size", NVFP4_GROUP))
    if got != (4, "float", NVFP4_GROUP):
        return None, (f"{source}: {field} num_bits={got[0]!r} type={got[1]!r} group_size={got[2]!r} "
                      f"is not NVFP4 input quantisation (4-bit float, group {NVFP4_GROUP})")
    return scheme, None


def _quark(quant: dict[str, Any], source: str) -> QuantSpec:
    w = (quant.get("global_quant_config") or {}).get("weight") or {}
    field = "quantization_config.global_quant_config.weight"
    for key, val in (("dtype", "fp4"), ("qscheme", "per_group"), ("scale_format", "e8m0")):
        if w.get(key) != val:
            raise ValueError(f"{source}: {field}.{key}={w.get(key)!r} is not supported "
                             f"(Quark MXFP4 needs {key}={val!r})")
    _check_group(w.get("group_size"), MXFP4_GROUP, f"{field}.group_size", source, "MXFP4")
    act, why = _quark_inputs((quant.get("global_quant_config") or {}).get("input_tensors"), source)
    return QuantSpec(Encoding.MXFP4, tuple(quant.get("exclude") or ()), source=source, activations=act,
                     activations_unsupported=why)


#: Quark ``input_tensors`` m2serve reproduces: dynamic OCP MXFP4, "even" scales, half-even elements
#: (the amd/MiniMax-M2.7-MXFP4 recipe; docs/checkpoints.md §9). Absent keys take these defaults.
_QUARK_MX_INPUTS = {"dtype": "fp4", "qscheme": "per_group", "group_size": MXFP4_GROUP, "scale_format": "e8m0",
                    "is_dynamic": True, "scale_calculation_mode": "even", "round_method": "half_even"}


def _quark_inputs(inputs: dict[str, Any] | None,
                  source: str) -> tuple[ActivationScheme | None, str | None]:
    """Quark ``global_quant_config.input_tensors`` -> (MXFP4, None), (None, None) when absent (weight-
    only), or (None, why) for an input quantisation other than :data:`_QUARK_MX_INPUTS`."""
    if not inputs:
        return None, None
    for key, want in _QUARK_MX_INPUTS.items():
        got = inputs.get(key, want)
        if got != want:
            return None, (f"{source}: quantization_config.global_quant_config.input_tensors.{key}={got!r} "
                          f"is not supported (W4A4 MXFP4 inputs need {key}={want!r})")
    return ActivationScheme.MXFP4, None


_CT_FORMATS = {NVFP4_GROUP: "nvfp4-pack-quantized", MXFP4_GROUP: "mxfp4-pack-quantized"}


def _compressed_tensors(quant: dict[str, Any], source: str) -> QuantSpec:
    groups = quant.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{source}: compressed-tensors quantization_config has no config_groups")
    sizes = set()
    for gname, group in groups.items():
        w = group.get("weights") or {}
        field = f"quantization_config.config_groups.{gname}.weights"
        if w.get("num_bits") != 4 or w.get("type") != "float":
            raise ValueError(f"{source}: {field} num_bits={w.get('num_bits')!r} type={w.get('type')!r} "
                             "is not supported (compressed-tensors checkpoints: NVFP4 / MXFP4, 4-bit float)")
        if w.get("group_size") not in _CT_FORMATS:
            raise ValueError(f"{source}: {field}.group_size={w.get('group_size')!r} is not supported "
                             f"(supported FP4 group sizes: NVFP4 {NVFP4_GROUP}, MXFP4 {MXFP4_GROUP})")
        fmt = group.get("format") or quant.get("format")
        if fmt is not None and fmt != _CT_FORMATS[w["group_size"]]:
            raise ValueError(f"{source}: config_groups.{gname}.format={fmt!r} does not match group size "
                             f"{w['group_size']} (expected {_CT_FORMATS[w['group_size']]!r})")
        sizes.add(w["group_size"])
    if len(sizes) > 1:
        raise ValueError(f"{source}: compressed-tensors config mixes NVFP4 and MXFP4 groups; not supported")
    enc = Encoding.NVFP4 if sizes == {NVFP4_GROUP} else Encoding.MXFP4
    act = why = None
    for gname, group in groups.items():
        inputs = group.get("input_activations")
        if inputs and enc is Encoding.NVFP4:
            act, why = _nvfp4_inputs(inputs, f"quantization_config.config_groups.{gname}.input_activations",
                                     source, ActivationScheme.NVFP4_CT)
        elif inputs:
            why = (f"{source}: config_groups.{gname}.input_activations: compressed-tensors MXFP4 input "
                   "quantisation is not supported (W4A4 MXFP4 follows Quark's rules)")
    return QuantSpec(enc, tuple(quant.get("ignore") or ()), ct_patterns=True, source=source,
                     activations=act if why is None else None, activations_unsupported=why)


def linear_kind(weight: TensorInfo, companions: dict[str, TensorInfo]) -> LinearKind:
    """Decide how ``weight`` is stored from header dtypes (docs/checkpoints.md §4 per-linear table).

    ``companions`` maps suffixes (``weight_scale_inv``, ``weight_scale``, ...) to their headers.
    Raises ValueError naming the tensor for any combination the table does not list, or an FP8
    scale whose grid is not [ceil(N/128), ceil(K/128)]. FP4: see :func:`_fp4_kind`.
    """
    name = weight.name
    if weight.dtype == "U8":
        return _fp4_kind(weight, companions)
    if name.endswith(".weight_packed"):
        raise ValueError(f"{name}: a weight_packed tensor must be U8 (packed FP4), found {weight.dtype}")
    if weight.dtype in FLOAT_HEADER_DTYPES:
        if companions:
            raise ValueError(f"{name}: dense {weight.dtype} weight has unexpected scale tensors "
                             f"{sorted(companions)}")
        return LinearKind.DENSE
    if weight.dtype == "F8_E4M3":
        scale = companions.get("weight_scale_inv") or companions.get("weight_scale")
        if scale is None or len(companions) != 1:
            raise ValueError(f"{name}: F8_E4M3 weight needs exactly one weight_scale_inv companion, "
                             f"found {sorted(companions) or 'none'}")
        n, k = weight.shape
        grid = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        if tuple(scale.shape) != grid or scale.dtype not in FLOAT_HEADER_DTYPES:
            raise ValueError(f"{scale.name}: FP8 block scale must be float {list(grid)} for weight "
                             f"{list(weight.shape)}, found {scale.dtype} {list(scale.shape)}")
        return LinearKind.FP8_BLOCK
    raise ValueError(f"{name}: unsupported weight dtype {weight.dtype}")


_FP4_CONVENTIONS = {  # (compressed-tensors names?) -> kind, second scale, input scale, other convention's
    False: (LinearKind.NVFP4, "weight_scale_2", "input_scale", "weight_global_scale"),
    True: (LinearKind.NVFP4_CT, "weight_global_scale", "input_global_scale", "weight_scale_2"),
}


def _fp4_kind(weight: TensorInfo, companions: dict[str, TensorInfo]) -> LinearKind:
    """U8 [N, K/2] packed FP4 weight (docs/checkpoints.md §4 per-linear table).

    NVFP4: ``weight_scale`` F8_E4M3 [N, K/16] + an F32 scalar ``weight_scale_2`` (ModelOpt,
    weight named ``.weight``) or ``weight_global_scale`` (compressed-tensors, ``.weight_packed``),
    optional ``input_scale`` / ``input_global_scale``. MXFP4: ``weight_scale`` U8 [N, K/32].
    Raises ValueError naming the tensor for a missing scale, a scale of the wrong dtype or shape,
    the other convention's scale name, or an unexpected companion.
    """
    name = weight.name
    if len(weight.shape) != 2:
        raise ValueError(f"{name}: packed FP4 weight must be 2-D [N, K/2], found {list(weight.shape)}")
    n, k = weight.shape[0], 2 * weight.shape[1]
    ct = name.endswith(".weight_packed")
    kind, second, input_name, foreign = _FP4_CONVENTIONS[ct]
    scale = companions.get("weight_scale")
    if scale is None:
        raise ValueError(f"{name}: U8 weight without a recognised scale set: no weight_scale (packed FP4 "
                         f"needs F8_E4M3 weight_scale + {second} for NVFP4, U8 weight_scale for MXFP4); "
                         f"found {sorted(companions) or 'none'}")
    if scale.dtype == "F8_E4M3":
        group, allowed = NVFP4_GROUP, {"weight_scale", second, input_name}
        if foreign in companions:
            raise ValueError(f"{companions[foreign].name}: {foreign} belongs to the "
                             f"{'ModelOpt' if ct else 'compressed-tensors'} convention but {name} uses "
                             f"{'compressed-tensors' if ct else 'ModelOpt'} names; the two are never mixed")
        s2 = companions.get(second)
        if s2 is None:
            raise ValueError(f"{name}: NVFP4 weight is missing its {second} tensor "
                             f"({name.rsplit('.', 1)[0]}.{second})")
        if s2.dtype != "F32" or len(s2.shape) > 1 or (s2.shape and s2.shape[0] != 1):
            raise ValueError(f"{s2.name}: {second} must be an F32 scalar, found {s2.dtype} {list(s2.shape)}")
    elif scale.dtype == "U8":
        kind, group, allowed = LinearKind.MXFP4, MXFP4_GROUP, {"weight_scale"}
    else:
        raise ValueError(f"{scale.name}: FP4 block scale dtype {scale.dtype} is not supported "
                         "(NVFP4: F8_E4M3, MXFP4: U8 E8M0)")
    extra = sorted(set(companions) - allowed)
    if extra:
        raise ValueError(f"{name}: unexpected tensors next to a {kind.value} weight: {extra}")
    want = (n, k // group)
    if k % group or tuple(scale.shape) != want:
        raise ValueError(f"{scale.name}: scale shape {list(scale.shape)} does not match weight {name} "
                         f"[{n}, {k}] in groups of {group} along K (expected {list(want)})")
    return kind
