"""FP4 element formats and dequantisation against the reference libraries' own functions.

docs/checkpoints.md §5 (E2M1 table, nibble order, E8M0), §6 (NVFP4 / MXFP4 formulas), §8 (the
references: nvidia-modelopt NVFP4QTensor, compressed-tensors NVFP4 helpers + dequantize, amd-quark
Pack_fp4 / to_e8m0_uint8 / dequantize_fp4_fp6_per_group). Equality is bitwise (int32 views, so
-0.0 and 0.0 differ) on random bytes that hit every code, plus explicit edge rows.

The libraries are imported inside the tests that use them (:func:`_lib`), and those tests are marked
``slow``: importing amd-quark takes ~25 s of CPU and nvidia-modelopt ~10 s, which at module level
made collecting the whole suite, and so the fast subset (``-m "not slow"``), take that long too.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from m2serve.formats.fp4 import (
    E2M1_VALUES,
    FP4Scheme,
    PackedFP4,
    decode_e8m0,
    dequantize_mxfp4,
    dequantize_nvfp4_ct,
    dequantize_nvfp4_modelopt,
    unpack_e2m1,
)

N, K = 24, 128
CT_PACK = "compressed_tensors.compressors.nvfp4.helpers"


def _lib(module: str, *names: str) -> list:
    """``names`` from reference-library ``module``, imported now (their import warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importlib.import_module(module)
    return [getattr(mod, n) for n in names]


def _pack_fp4():
    """amd-quark's FP4 packer (``Pack_fp4("per_group", "fp4")``)."""
    return _lib("quark.torch.utils.pack", "Pack_fp4")[0]("per_group", "fp4")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor (so -0.0 != 0.0 and the comparison is exact)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def packed_codes(seed: int) -> torch.Tensor:
    """[N, K/2] uint8: random bytes, row 0 = every (low, high) code pair 0..15 twice over."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8)
    p[0, :16] = codes | (codes.flip(0) << 4)
    p[0, 16:32] = codes.flip(0) | (codes << 4)
    return p


def e4m3_scales(seed: int) -> torch.Tensor:
    """[N, K/16] e4m3: random non-NaN codes plus zero, the smallest subnormal 2^-9 and 448."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 0x7F, (N, K // 16), generator=g, dtype=torch.uint8)  # positive, no NaN
    b[0, :4] = torch.tensor([0x00, 0x01, 0x7E, 0x38], dtype=torch.uint8)  # 0, 2^-9, 448, 1.0
    return b.view(torch.float8_e4m3fn)


def assert_equal_but_sign_of_zero(ours: torch.Tensor, modelopt: torch.Tensor) -> None:
    """Bit equality, except that modelopt decodes E2M1 code 8 as +0.

    modelopt's ``e2m1_values`` table holds ``0`` at index 8 where spec §5 (and compressed-tensors,
    Quark) have -0; every other bit must agree, and the disagreeing entries must be exactly
    (ours -0.0, modelopt +0.0).
    """
    diff = bits(ours) != bits(modelopt)
    assert torch.equal(ours, modelopt)  # value equality (-0 == +0)
    assert bool((ours[diff] == 0).all() & torch.signbit(ours[diff]).all())
    assert not bool(torch.signbit(modelopt[diff]).any())
    assert int((~diff).sum()) > 0.9 * ours.numel()


GLOBAL_SCALES = [2.0**-30, 0.0123, 1.0, 2.0**20]


@pytest.mark.slow
def test_e2m1_table_matches_spec_and_libraries():  # docs/checkpoints.md §5
    [unpack_fp4_from_uint8] = _lib(CT_PACK, "unpack_fp4_from_uint8")
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8)
    ours = unpack_e2m1(packed)
    assert bits(ours).tolist() == bits(torch.tensor([E2M1_VALUES])).tolist()
    assert ours[0, 8].item() == 0.0 and torch.signbit(ours[0, 8])  # code 8 is -0
    ct = unpack_fp4_from_uint8(packed, 1, 16, dtype=torch.float32)
    quark = _pack_fp4().unpack(packed, reorder=False)
    assert torch.equal(bits(ours), bits(ct))
    assert torch.equal(bits(ours), bits(quark))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_unpack_matches_libraries_and_inverts_their_pack(seed):  # docs/checkpoints.md §5 packing
    pack_fp4_to_uint8, unpack_fp4_from_uint8 = _lib(CT_PACK, "pack_fp4_to_uint8", "unpack_fp4_from_uint8")
    quark = _pack_fp4()
    p = packed_codes(seed)
    ours = unpack_e2m1(p)  # [N, K]
    assert torch.equal(bits(ours), bits(unpack_fp4_from_uint8(p, N, K, dtype=torch.float32)))
    assert torch.equal(bits(ours), bits(quark.unpack(p, reorder=False)))
    # the libraries' packers, fed our values, give back the same bytes (low nibble = even column)
    assert torch.equal(pack_fp4_to_uint8(ours), p)
    assert torch.equal(quark.pack(ours, reorder=False), p)


MODELOPT = "modelopt.torch.quantization.qtensor.nvfp4_tensor"


@pytest.mark.slow
@pytest.mark.parametrize("ws2", GLOBAL_SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_modelopt_equals_modelopt_dequantize(ws2, dtype):  # docs/checkpoints.md §6 NVFP4 (ModelOpt)
    [NVFP4QTensor] = _lib(MODELOPT, "NVFP4QTensor")
    p, ws = packed_codes(2), e4m3_scales(3)
    ws2_t = torch.tensor(ws2, dtype=torch.float32)
    ref = NVFP4QTensor(torch.Size([N, K]), dtype, p).dequantize(
        dtype=dtype, scale=ws, double_scale=ws2_t, block_sizes={-1: 16})
    ours = dequantize_nvfp4_modelopt(p, ws, ws2_t, dtype)
    assert ours.dtype == dtype
    assert_equal_but_sign_of_zero(ours, ref)


@pytest.mark.slow
def test_nvfp4_modelopt_roundtrip_of_modelopt_quantize():  # docs/checkpoints.md §8 produce/check
    [NVFP4QTensor] = _lib(MODELOPT, "NVFP4QTensor")
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(4)) * 0.02
    w[1, :16] = 0.0  # an all-zero block (scale forced to 1.0 by modelopt)
    qt, ws, ws2 = NVFP4QTensor.quantize(w.clone(), 16)
    assert ws.dtype == torch.float8_e4m3fn
    ref = qt.dequantize(dtype=torch.float32, scale=ws, double_scale=ws2, block_sizes={-1: 16})
    ours = dequantize_nvfp4_modelopt(qt._quantized_data, ws, ws2, torch.float32)
    assert_equal_but_sign_of_zero(ours, ref)


@pytest.mark.slow
@pytest.mark.parametrize("wgs", [1.0 / s for s in GLOBAL_SCALES] + [3.0])
def test_nvfp4_ct_equals_compressed_tensors_dequantize(wgs):  # docs/checkpoints.md §4 compressed-tensors
    [unpack_fp4_from_uint8] = _lib(CT_PACK, "unpack_fp4_from_uint8")
    [QuantizationArgs] = _lib("compressed_tensors.quantization", "QuantizationArgs")
    [ct_dequantize] = _lib("compressed_tensors.quantization.lifecycle.forward", "dequantize")
    p, ws = packed_codes(5), e4m3_scales(6)
    gs = torch.tensor([wgs], dtype=torch.float32)
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    ref = ct_dequantize(unpack_fp4_from_uint8(p, N, K, dtype=torch.float32), scale=ws.float(), args=args,
                        global_scale=gs, dtype=torch.float32)
    ours = dequantize_nvfp4_ct(p, ws, gs, torch.float32)
    assert torch.equal(bits(ours), bits(ref))
    if wgs == 3.0:  # the ModelOpt formula (multiply by 1/wgs) is not bit-equal on these names (§4)
        assert not torch.equal(ours, dequantize_nvfp4_modelopt(p, ws, 1.0 / gs, torch.float32))


@pytest.mark.slow
def test_nvfp4_ct_bf16_equals_compressor_decompress():  # docs/checkpoints.md §6 one rounding
    [NVFP4PackedCompressor] = _lib("compressed_tensors.compressors.nvfp4.base", "NVFP4PackedCompressor")
    QuantizationArgs, QuantizationScheme = _lib("compressed_tensors.quantization", "QuantizationArgs",
                                                "QuantizationScheme")

    p, ws = packed_codes(7), e4m3_scales(8)
    gs = torch.tensor([1.0 / 0.0123], dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="float", strategy="tensor_group", group_size=16))
    ref = NVFP4PackedCompressor.decompress(
        {"weight_packed": p, "weight_scale": ws, "weight_global_scale": gs}, scheme)["weight"]
    assert ref.dtype == torch.bfloat16
    assert torch.equal(bits(dequantize_nvfp4_ct(p, ws, gs, torch.bfloat16)), bits(ref))


@pytest.mark.slow
def test_e8m0_decode_matches_quark_and_compressed_tensors():  # docs/checkpoints.md §5 E8M0
    [_e8m0_to_fp32] = _lib("quark.torch.quantization.nn.modules.flydsl_a8w4_inference_linear",
                           "_e8m0_to_fp32")
    [to_e8m0_uint8] = _lib("quark.torch.utils.numerics", "to_e8m0_uint8")
    [decompress_mx_scale] = _lib("compressed_tensors.compressors.mx_utils", "decompress_mx_scale")
    e = torch.arange(255, dtype=torch.uint8)
    ours = decode_e8m0(e)
    assert torch.equal(bits(ours), bits(_e8m0_to_fp32(e)))
    assert torch.equal(ours.to(torch.bfloat16), decompress_mx_scale(e))
    assert ours[127].item() == 1.0 and ours[0].item() == 2.0**-127 and ours[254].item() == 2.0**127
    # Quark's encoder inverts it on every power of two it can write
    assert torch.equal(to_e8m0_uint8(ours[1:]), e[1:])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_equals_quark_per_group_dequantize(dtype):  # docs/checkpoints.md §6 MXFP4
    [dequantize_fp4_fp6_per_group] = _lib("quark.torch.kernel.hw_emulation.hw_emulation_interface",
                                          "dequantize_fp4_fp6_per_group")
    p = packed_codes(9)
    g = torch.Generator().manual_seed(10)
    s = torch.randint(100, 150, (N, K // 32), generator=g, dtype=torch.uint8)
    s[0, :4] = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)  # 2^-127 (subnormal), 2^-126, 1, 2^127
    vals = _pack_fp4().unpack(p, reorder=False)
    scale = 2 ** (s.to(torch.int16) - 127).to(torch.float32)  # Quark realquantizer.unpack_params (e8m0)
    ref = dequantize_fp4_fp6_per_group(vals, scale, axis=-1, group_size=32).to(dtype)
    ours = dequantize_mxfp4(p, s, dtype)
    assert torch.equal(bits(ours), bits(ref))


def test_packed_fp4_dispatches_by_scheme():  # docs/checkpoints.md §4: one formula per convention
    p, ws = packed_codes(11), e4m3_scales(12)
    s2 = torch.tensor(0.37)
    assert torch.equal(PackedFP4(FP4Scheme.NVFP4_MODELOPT, p, ws, s2).dequantize(torch.float32),
                       dequantize_nvfp4_modelopt(p, ws, s2))
    assert torch.equal(PackedFP4(FP4Scheme.NVFP4_CT, p, ws, s2).dequantize(torch.float32),
                       dequantize_nvfp4_ct(p, ws, s2))
    e = torch.full((N, K // 32), 120, dtype=torch.uint8)
    assert torch.equal(PackedFP4(FP4Scheme.MXFP4, p, e).dequantize(torch.bfloat16),
                       dequantize_mxfp4(p, e, torch.bfloat16))
    assert PackedFP4(FP4Scheme.MXFP4, p, e).shape == (N, K) and FP4Scheme.MXFP4.group == 32


# ---- errors (issue 7 "Errors"), each message asserted -------------------------------------------

def test_wrong_scale_shape_names_tensor():  # docs/checkpoints.md §4 "a scale of the wrong shape"
    p, ws = packed_codes(0), e4m3_scales(0)
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight_scale: scale shape \[24, 4\] does not "
                       r"match weight experts\.0\.w1\.weight \[24, 128\] in groups of 16 along K "
                       r"\(expected \[24, 8\]\)"):
        dequantize_nvfp4_modelopt(p, ws[:, :4], torch.tensor(1.0), name="experts.0.w1.weight")
    with pytest.raises(ValueError, match=r"w2\.weight_scale: scale shape \[23, 8\] does not match weight "
                       r"w2\.weight_packed \[24, 128\] in groups of 16 along K \(expected \[24, 8\]\)"):
        dequantize_nvfp4_ct(p, ws[:23], torch.tensor(1.0), name="w2.weight_packed")
    with pytest.raises(ValueError, match=r"w3\.weight_scale: scale shape \[24, 8\] does not match weight "
                       r"w3\.weight \[24, 128\] in groups of 32 along K \(expected \[24, 4\]\)"):
        dequantize_mxfp4(p, torch.full((24, 8), 127, dtype=torch.uint8), name="w3.weight")


def test_e8m0_nan_code_rejected():  # docs/checkpoints.md §5 (255 = NaN)
    s = torch.full((24, 4), 127, dtype=torch.uint8)
    s[3, 2] = 255
    with pytest.raises(ValueError, match=r"w1\.weight_scale: 1 E8M0 scale\(s\) hold the NaN code 255 "
                       r"\(first at index \[3, 2\]\); the checkpoint is corrupt"):
        dequantize_mxfp4(packed_codes(0), s, name="w1.weight")


def test_wrong_dtypes_rejected():  # docs/checkpoints.md §4 per-linear table
    p = packed_codes(0)
    with pytest.raises(ValueError, match=r"x\.weight: packed FP4 weight must be uint8, found torch\.int8"):
        unpack_e2m1(p.view(torch.int8), "x.weight")
    with pytest.raises(ValueError, match=r"x\.weight_scale: NVFP4 \(ModelOpt\) block scale must be "
                       r"float8_e4m3fn, found torch\.float32"):
        dequantize_nvfp4_modelopt(p, torch.ones(N, K // 16), torch.tensor(1.0), name="x.weight")
    with pytest.raises(ValueError, match=r"x\.weight_scale_2: per-tensor scale must hold one value, "
                       r"found shape \[2\]"):
        dequantize_nvfp4_modelopt(p, e4m3_scales(0), torch.ones(2), name="x.weight")
    with pytest.raises(ValueError, match=r"s: E8M0 scale must be uint8, found torch\.float32"):
        decode_e8m0(torch.ones(3), "s")
