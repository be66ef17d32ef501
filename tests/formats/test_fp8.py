"""FP8 block quantise / dequantise (docs/checkpoints.md §6, §8) against transformers' FP8 path, whole and
band by band as the loader does it."""

from __future__ import annotations

import math

import accelerate  # noqa: F401  (transformers needs it to load FP8; a test extra, pyproject.toml)
import pytest
import torch
import transformers  # a test extra: missing, these tests fail rather than skip
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402

from m2serve.formats.fp8 import PackedFP8, dequantize_fp8_block, quantize_fp8_block, refine_fp8_grid
from m2serve.formats.loader import dequantize_in_bands
from m2serve.model.load import load_model


def _random_e4m3(shape, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # avoid the NaN encodings
    return raw.view(torch.float8_e4m3fn)


def test_quantize_block_scale_is_amax_over_448():
    # docs/checkpoints.md §8: s = amax / 448 per 128x128 block; the amax element maps to ±448
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g)
    w[:128, 128:256] = 0  # an all-zero block
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            if blk.abs().max() == 0:
                assert torch.equal(q[:128, 128:256].float(), torch.zeros(128, 128))
                continue
            assert s[i, j].item() == (blk.abs().max() / 448).item()
            qb = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            assert qb.abs().max().item() == 448.0
            assert torch.equal(qb, (blk / s[i, j]).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_bit_exact_vs_transformers(dtype):
    # docs/checkpoints.md §6: fp32 product, one rounding; transformers' Fp8Dequantize is the reference
    q = _random_e4m3((256, 384), 1)
    s = torch.rand(2, 3, generator=torch.Generator().manual_seed(2)) * 1e-2
    ref = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)
    ours = dequantize_fp8_block(q, s, dtype)
    assert ours.dtype == dtype and torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_at_load_in_bands_bit_exact_vs_transformers(dtype):
    # the loader's band-by-band dequantisation (3 bands of 128 rows) gives transformers' values
    q = _random_e4m3((384, 256), 4)
    s = torch.rand(3, 2, generator=torch.Generator().manual_seed(5)) * 1e-2
    ref = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)
    ours = dequantize_in_bands(PackedFP8(q, s), dtype)
    assert ours.dtype == dtype and torch.equal(ours, ref)


def test_dequantize_rejects_wrong_scale_grid():
    with pytest.raises(ValueError, match=r"scale grid \[2, 2\].*\[256, 384\]"):
        dequantize_fp8_block(_random_e4m3((256, 384), 3), torch.ones(2, 2), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_weights_bit_exact_vs_transformers_fp8_load(tiny_random_fp8_dir, dtype):
    # issue 2 must-show: our dequantised weights equal transformers' FP8 load, bf16 and fp32 targets
    ours = load_model(tiny_random_fp8_dir, dtype=dtype, weight_dequant="load")
    ref = transformers.MiniMaxM2ForCausalLM.from_pretrained(tiny_random_fp8_dir, dtype=dtype)
    I = ours.config.intermediate_size
    for n, (a, b) in enumerate(zip(ours.model.layers, ref.model.layers)):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w_ref = getattr(b.self_attn, p).weight
            assert w_ref.dtype == dtype, f"transformers kept {p} as {w_ref.dtype}"
            assert torch.equal(getattr(a.self_attn, p).weight, w_ref), f"layer {n} {p}"
        ex, rx = a.block_sparse_moe.experts, b.mlp.experts
        assert torch.equal(ex.w13[:, :I], rx.gate_up_proj[:, :I]), f"layer {n} w1"
        assert torch.equal(ex.w13[:, I:], rx.gate_up_proj[:, I:]), f"layer {n} w3"
        assert torch.equal(ex.w2, rx.down_proj), f"layer {n} w2"


def test_quantize_block_hand_derived_values():
    # --quantize-unquantized fp8 (docs/checkpoints.md §6 "Online FP8"), values worked out by hand:
    # a [130, 200] weight has a 2x2 block grid whose last row band holds 2 rows and last column
    # band 72 columns. Block (0, 0): amax 896 -> s = 2; 3 -> 1.5 (exact in e4m3); 2.125 -> 1.0625,
    # halfway between e4m3 1.0 and 1.125 -> 1.0 (even mantissa); 2.375 -> 1.1875, halfway between
    # 1.125 and 1.25 -> 1.25 (even). Block (0, 1) is all zero -> s = 1, q = 0. Block (1, 0):
    # amax 0.75 -> s = 0.75 / 448; its 0.75 -> 448. Block (1, 1): amax 7 -> s = 7 / 448 = 1/64;
    # 7 -> 448, 0.5 -> 32, -1/64 -> -1.
    w = torch.zeros(130, 200)
    w[0, 0], w[5, 7], w[9, 1], w[127, 127] = 896.0, 3.0, 2.125, -2.375
    w[128, 3] = 0.75
    w[129, 199], w[128, 150], w[129, 128] = 7.0, 0.5, -1 / 64
    q, s = quantize_fp8_block(w)
    assert q.shape == (130, 200) and s.shape == (2, 2)
    assert s.tolist() == [[2.0, 1.0], [torch.tensor(0.75 / 448).item(), 1 / 64]]
    qf = q.float()
    assert (qf[0, 0].item(), qf[5, 7].item(), qf[9, 1].item(), qf[127, 127].item()) == \
        (448.0, 1.5, 1.0, -1.25)
    assert qf[:128, 128:].abs().sum().item() == 0
    assert (qf[128, 3].item(), qf[129, 199].item(), qf[128, 150].item(), qf[129, 128].item()) == \
        (448.0, 448.0, 32.0, -1.0)
    assert torch.count_nonzero(qf) == 8
    # the bit-exact dequantiser (transformers-checked above) returns the weight except the two ties
    back = dequantize_fp8_block(q, s, torch.float32)
    expect = w.clone()
    expect[9, 1], expect[127, 127] = 2.0, -2.5
    assert torch.equal(back, expect)


@pytest.mark.parametrize(("rows", "cols"), [((64, 256), (0, 384)), ((192, 384), (64, 320)),
                                            ((0, 96), (200, 300)), ((130, 131), (127, 129))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_that_split_a_band_bit_exact_vs_transformers(rows, cols, dtype):
    # issue 30, docs/checkpoints.md §6: a TP slice [a, b) x [c, d) that starts inside a 128-wide band
    # keeps the bands it touches and row0 = a % 128, col0 = c % 128; whole, band by band (the loader),
    # and on the kernels' finer grid, it equals the same rows and columns of transformers' dequantisation
    # of the whole tensor
    q = _random_e4m3((384, 384), 6)
    s = torch.rand(3, 3, generator=torch.Generator().manual_seed(7)) * 1e-2
    (a, b), (c, d) = rows, cols
    ref = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)[a:b, c:d]
    p = PackedFP8(q[a:b, c:d], s[a // 128:-(-b // 128), c // 128:-(-d // 128)], "w", a % 128, c % 128)
    assert torch.equal(p.dequantize(dtype), ref)
    assert torch.equal(dequantize_in_bands(p, dtype), ref)
    fine, bn, bk = refine_fp8_grid(p.scale, b - a, d - c, a % 128, c % 128)
    assert (bn, bk) == (math.gcd(128, a % 128), math.gcd(128, c % 128))
    assert torch.equal(dequantize_fp8_block(p.q, fine, dtype, (bn, bk)), ref)


def test_offsets_and_finer_grids_are_checked():
    q = _random_e4m3((64, 128), 8)
    with pytest.raises(ValueError, match=r"row0=128 must be in \[0, 128\)"):
        dequantize_fp8_block(q, torch.ones(2, 1), torch.float32, row0=128)
    with pytest.raises(ValueError, match=r"\[1, 1\] does not match weight \[64, 128\] at row0 96, col0 0"):
        dequantize_fp8_block(q, torch.ones(1, 1), torch.float32, row0=96)  # rows 96..159 touch 2 bands
    with pytest.raises(ValueError, match=r"block_n=48 must divide 128 and the offset 96"):
        refine_fp8_grid(torch.ones(2, 1), 64, 128, 96, 0, block_n=48)
