"""Checkpoint encoding detection (checkpoints.md §4): ``quantization_config`` first, then headers.

The checkpoint-level answer (:func:`detect_encoding`) validates the config; the per-linear answer
(:func:`linear_kind`) comes from each weight's header dtype and its companion tensors, so a
release whose excluded layers were left in another form still loads correctly.
"""

from __future__ import annotations

import enum
from typing import Any

from m2serve.formats.safetensors_io import TensorInfo

FP8_BLOCK = 128


class Encoding(enum.Enum):
    """Checkpoint weight encoding (checkpoints.md §4)."""

    DENSE = "dense"
    FP8_BLOCK = "fp8_block"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"


class LinearKind(enum.Enum):
    """How one linear weight is stored (checkpoints.md §4, per-linear table)."""

    DENSE = "dense"
    FP8_BLOCK = "fp8_block"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"


_REFUSED = {"gptq": "GPTQ", "awq": "AWQ", "gguf": "GGUF"}


def detect_encoding(quant: dict[str, Any] | None, source: str = "config.json") -> Encoding:
    """The checkpoint's encoding from its ``quantization_config`` (None = dense).

    Raises ValueError naming the field and value for an FP8 config other than dynamic 128x128
    e4m3 blocks or an unknown ``quant_method``; NotImplementedError for GPTQ/AWQ/GGUF (as MAX)
    and, until issue 7 lands, for NVFP4 / MXFP4 / compressed-tensors.
    """
    if not quant:
        return Encoding.DENSE
    method = str(quant.get("quant_method", "")).lower()
    if method in _REFUSED:
        raise NotImplementedError(f"{_REFUSED[method]} MiniMax-M2 checkpoints are not supported ({source})")
    if method == "fp8":
        want = {"fmt": "float8_e4m3fn", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        for key, val in want.items():
            got = quant.get(key, val if key == "fmt" else None)
            if got != val:
                raise ValueError(f"{source}: quantization_config.{key}={got!r} is not supported "
                                 f"(FP8 block checkpoints need {key}={val!r})")
        return Encoding.FP8_BLOCK
    if method == "modelopt":
        raise NotImplementedError(f"{source}: NVFP4 (ModelOpt) checkpoints are recognised but not "
                                  "supported yet (issue 7)")
    if method == "quark":
        raise NotImplementedError(f"{source}: MXFP4 (Quark) checkpoints are recognised but not "
                                  "supported yet (issue 7)")
    if method == "compressed-tensors":
        raise NotImplementedError(f"{source}: compressed-tensors FP4 checkpoints are recognised but "
                                  "not supported yet (issue 7)")
    raise ValueError(f"{source}: unknown quantization_config.quant_method={quant.get('quant_method')!r} "
                     "(supported: fp8; none for BF16)")


def linear_kind(weight: TensorInfo, companions: dict[str, TensorInfo]) -> LinearKind:
    """Decide how ``weight`` is stored from header dtypes (checkpoints.md §4 per-linear table).

    ``companions`` maps suffixes (``weight_scale_inv``, ``weight_scale``, ...) to their headers.
    Raises ValueError naming the tensor for any combination the table does not list, or an FP8
    scale whose grid is not [ceil(N/128), ceil(K/128)]; NotImplementedError for FP4 (issue 7).
    """
    name = weight.name
    if weight.dtype in ("BF16", "F16", "F32"):
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
        if tuple(scale.shape) != grid or scale.dtype not in ("F32", "BF16", "F16"):
            raise ValueError(f"{scale.name}: FP8 block scale must be float {list(grid)} for weight "
                             f"{list(weight.shape)}, found {scale.dtype} {list(scale.shape)}")
        return LinearKind.FP8_BLOCK
    if weight.dtype == "U8":
        scale = companions.get("weight_scale")
        if scale is not None and scale.dtype == "F8_E4M3" and "weight_scale_2" in companions:
            raise NotImplementedError(f"{name}: NVFP4 weights are not supported yet (issue 7)")
        if scale is not None and scale.dtype == "U8":
            raise NotImplementedError(f"{name}: MXFP4 weights are not supported yet (issue 7)")
        raise ValueError(f"{name}: U8 weight without a recognised scale set (NVFP4 needs F8_E4M3 "
                         f"weight_scale + weight_scale_2, MXFP4 U8 weight_scale); found {sorted(companions)}")
    raise ValueError(f"{name}: unsupported weight dtype {weight.dtype}")
