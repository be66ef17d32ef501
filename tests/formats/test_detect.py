"""Format detection from quantization_config and per-linear headers (docs/checkpoints.md §4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from m2serve.formats.detect import Encoding, LinearKind, detect_encoding, linear_kind
from m2serve.formats.safetensors_io import TensorInfo

FP8 = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128],
       "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def _t(name, dtype, shape):
    return TensorInfo(name, Path("x.safetensors"), dtype, tuple(shape), 0)


def test_dense_and_fp8():
    assert detect_encoding(None) is Encoding.DENSE
    assert detect_encoding(FP8) is Encoding.FP8_BLOCK


@pytest.mark.parametrize("key,value", [("weight_block_size", [64, 64]), ("activation_scheme", "static"),
                                       ("fmt", "float8_e5m2")])
def test_fp8_variants_refused(key, value):
    with pytest.raises(ValueError, match=f"quantization_config.{key}="):
        detect_encoding({**FP8, key: value}, "c.json")


@pytest.mark.parametrize("method,label", [("gptq", "GPTQ"), ("awq", "AWQ")])
def test_recognised_but_unsupported(method, label):
    with pytest.raises(NotImplementedError, match=label):
        detect_encoding({"quant_method": method})


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown quantization_config.quant_method='foo'"):
        detect_encoding({"quant_method": "foo"})


def test_linear_kind_from_headers():
    w = _t("a.weight", "F8_E4M3", (1024, 256))
    scale = _t("a.weight_scale_inv", "F32", (8, 2))
    assert linear_kind(w, {"weight_scale_inv": scale}) is LinearKind.FP8_BLOCK
    assert linear_kind(_t("b.weight", "BF16", (4, 4)), {}) is LinearKind.DENSE
    with pytest.raises(ValueError, match="a.weight: F8_E4M3 weight needs exactly one weight_scale_inv"):
        linear_kind(w, {})
    with pytest.raises(ValueError, match="u.weight: U8 weight without a recognised scale set"):
        linear_kind(_t("u.weight", "U8", (4, 2)), {})
    nvfp4 = {"weight_scale": _t("n.weight_scale", "F8_E4M3", (16, 1)),
             "weight_scale_2": _t("n.weight_scale_2", "F32", ())}
    assert linear_kind(_t("n.weight", "U8", (16, 8)), nvfp4) is LinearKind.NVFP4  # FP4: test_quantized_*
