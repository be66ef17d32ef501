"""Corrupt checkpoints are refused at load with the tensor named (issue 16 item 7).

Each case writes one hand-made corruption into a copy of tiny-random (BF16 or FP8 block): a NaN /
inf in a weight, a norm or an FP8 scale, the e4m3 NaN codes 0x7F / 0xFF in the raw FP8 bytes
(docs/checkpoints.md §6: e4m3fn has no inf, 0x7F and 0xFF are NaN), with ``weight_dequant`` load and
runtime (packed weights are checked too); and config fields (``rms_norm_eps: NaN``,
``max_position_embeddings: 0``) refused when the server starts.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m2serve.formats.finite import CorruptTensorError, find_nonfinite
from m2serve.model.load import load_model
from m2serve.serve.llm import LLM

NORM = "model.layers.1.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"


def _corrupt(src: Path, dst: Path, name: str, edit) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with tensor ``name`` replaced by ``edit(tensor)``."""
    shutil.copytree(src, dst)
    index = dst / "model.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    tensors = load_file(dst / file)
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, dst / file, metadata={"format": "pt"})
    return dst


def _set(index, value):
    def edit(t):
        t[index] = value
        return t
    return edit


def _set_byte(index, code):
    def edit(t):
        t.view(torch.uint8)[index] = code
        return t
    return edit


@pytest.mark.parametrize("name, edit, what", [
    (NORM, _set((5,), float("nan")), "1 value(s) are NaN or inf (first at index [5])"),
    (EMBED, _set((3, 7), float("inf")), "1 value(s) are NaN or inf (first at index [3, 7])"),
    (EXPERT, _set((0, 1), float("-inf")), "1 value(s) are NaN or inf (first at index [0, 1])"),
])
def test_bf16_weight_or_norm_with_nan_or_inf(tiny_random_dir, tmp_path, name, edit, what):
    d = _corrupt(tiny_random_dir, tmp_path / "c", name, edit)
    want = re.escape(f".safetensors: {name}: {what}; the checkpoint is corrupt")
    with pytest.raises(CorruptTensorError, match=want):
        load_model(d)


@pytest.mark.parametrize("weight_dequant", ["load", "runtime"])
@pytest.mark.parametrize("name, edit, what", [
    (Q_PROJ, _set_byte((2, 9), 0x7F), r"1 FP8 e4m3 value\(s\) hold a NaN code \(0x7F/0xFF\) "
                                      r"\(first at index \[2, 9\]\)"),
    (EXPERT, _set_byte((130, 4), 0xFF), r"1 FP8 e4m3 value\(s\) hold a NaN code \(0x7F/0xFF\) "
                                        r"\(first at index \[130, 4\]\)"),
    (Q_PROJ + "_scale_inv", _set((1, 0), float("nan")),
     r"1 value\(s\) are NaN or inf \(first at index \[1, 0\]\)"),
    (EXPERT + "_scale_inv", _set((0, 1), float("inf")),
     r"1 value\(s\) are NaN or inf \(first at index \[0, 1\]\)"),
    (NORM, _set((0,), float("nan")), r"1 value\(s\) are NaN or inf \(first at index \[0\]\)"),
])
def test_fp8_codes_scales_and_norms(tiny_random_fp8_dir, tmp_path, name, edit, what, weight_dequant):
    d = _corrupt(tiny_random_fp8_dir, tmp_path / "c", name, edit)
    with pytest.raises(CorruptTensorError, match=rf"\.safetensors: {name}: {what}; the checkpoint is"):
        load_model(d, weight_dequant=weight_dequant)


def test_e4m3_nan_codes_are_exactly_0x7f_and_0xff():  # docs/checkpoints.md §6, against torch's own decoding
    codes = torch.arange(256, dtype=torch.uint8)
    nan_by_torch = torch.isnan(codes.view(torch.float8_e4m3fn).float())
    assert nan_by_torch.nonzero().flatten().tolist() == [0x7F, 0xFF]
    for c in range(256):
        found = find_nonfinite(codes[c:c + 1].view(torch.float8_e4m3fn))
        assert (found is not None) == bool(nan_by_torch[c]), c
    assert find_nonfinite(codes.view(torch.float8_e4m3fn)) == (2, [0x7F])


def test_float_check_matches_isfinite():  # every dtype the loader reads floats in
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.randn(64, 32).to(dtype)
        assert find_nonfinite(t) is None
        for value in (float("nan"), float("inf"), -float("inf")):
            u = t.clone()
            u[40, 2] = value
            u[50, 1] = value
            assert find_nonfinite(u) == (2, [40, 2])
            assert int((~torch.isfinite(u)).sum()) == 2


def _with_config(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("field, value, want", [
    ("rms_norm_eps", math.nan, r"unsupported rms_norm_eps=nan \(m2serve supports a finite number\)"),
    ("max_position_embeddings", 0, r"unsupported max_position_embeddings=0 \(m2serve supports a positive"),
])
def test_corrupt_config_refused_at_start(tiny_random_dir, tmp_path, field, value, want):
    d = _with_config(tiny_random_dir, tmp_path / "c", **{field: value})
    with pytest.raises(ValueError, match=r"config\.json: " + want):
        LLM(str(d), dtype="float32", num_kv_pages=8, kv_cache_page_size=16)


def test_corrupt_weight_refused_at_start(tiny_random_fp8_dir, tmp_path):
    d = _corrupt(tiny_random_fp8_dir, tmp_path / "c", NORM, _set((1,), float("nan")))
    with pytest.raises(CorruptTensorError, match=rf"{NORM}: 1 value\(s\) are NaN or inf"):
        LLM(str(d), dtype="float32", num_kv_pages=8, kv_cache_page_size=16)
