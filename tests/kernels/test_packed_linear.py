"""Packed-weight CPU kernels vs formats/' pure-PyTorch dequantisation (the oracle: it matches
modelopt, compressed-tensors and Quark bit for bit, tests/formats).

Two checks per format, run once per ISA this CPU supports plus the scalar fallback:

- decoded values are the spec's exactly: with x = rows of the identity, y = Wᵀ columns, bit for bit
  (every e4m3 code incl. subnormals and ±0, every E2M1 code, the smallest and largest scales);
  for the many-row path bit-equal to F.linear on the dequantised weight (same GEMM); the AVX-512
  BF16 path (bf16 activations) may flush weights below 2⁻¹²⁶ to 0, and nothing else;
- products: |y − x·dequantize(W, x.dtype)ᵀ| ≤ K·(2⁻²⁴·(|x|·|W|ᵀ) + 2⁻¹²⁶) (the fp32 summation bound
  with its underflow term) plus
  2⁻⁸·|y_ref| when the output is bf16 (one rounding of the fp32 result), for M in {1, 3, 8, 64, 300}
  (both the GEMV path and the tile + at::mm path) and N/K at block multiples and TP-sliced widths.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from m2serve.formats.fp4 import FP4Scheme, PackedFP4
from m2serve.formats.fp8 import PackedFP8
from m2serve.kernels import build
from m2serve.kernels.ops import (
    GEMV_ROWS,
    PackedWeights,
    WeightFormat,
    grouped_expert_ffn,
    grouped_linear,
    linear,
)

ISAS = build.supported_isas()


def gemv_backend(isa: str) -> build.KernelBackend:
    """The backend of ``isa`` with the GEMV row limit at ``GEMV_ROWS`` (16) for bf16 weights too: these
    tests hold the GEMV paths of 1-16 rows to their bounds on any CPU (on one with AMX-BF16 the
    process's backend sends 5+ bf16 rows of a bf16 weight to F.linear; tests/kernels/test_gemv_rows.py)."""
    return dataclasses.replace(build.select_backend(isa), bf16_gemv_rows=GEMV_ROWS)
DTYPES = [torch.float32, torch.bfloat16]
FORMATS = list(WeightFormat)


def test_kernels_build_and_scalar_is_always_supported():
    # a machine with a C++ compiler (CI, this one) must build them: no silent fallback in the tests
    assert build.load_library() is None
    assert "scalar" in ISAS


def _e4m3_codes(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """uint8 [n, k]: all 254 non-NaN e4m3 codes (0x00 +0, 0x80 -0, subnormals 0x01-0x07), shuffled."""
    valid = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    reps = -(-n * k // len(valid))
    codes = valid.repeat(reps)[torch.randperm(len(valid) * reps, generator=g)][: n * k]
    return codes.view(n, k)


def make_weight(fmt: WeightFormat, n: int, k: int, seed: int = 0, experts: int = 1,
                top_e8m0: int = 254) -> PackedWeights:
    """Random weights of ``fmt`` [experts, n, k] covering every code and the extreme scales
    (MXFP4's largest exponent ``top_e8m0``: sums of 2^127-sized products overflow fp32)."""
    g = torch.Generator().manual_seed(seed)
    ws = []
    for _ in range(experts):
        if fmt is WeightFormat.BF16:
            ws.append(torch.randn(n, k, generator=g).to(torch.bfloat16))
            continue
        if fmt is WeightFormat.FP8_BLOCK:
            q = _e4m3_codes(n, k, g).view(torch.float8_e4m3fn)
            grid = (-(-n // 128), k // 128)
            exp = torch.randint(-20, 21, grid, generator=g).float()
            exp.view(-1)[0] = -126  # smallest normal scale: products land in the fp32 subnormals
            exp.view(-1)[-1] = 100  # 448 * 2^100 still fits fp32 and bf16
            ws.append(PackedFP8(q, torch.exp2(exp) * (1 + torch.rand(grid, generator=g))))
            continue
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        codes[0, :8] = torch.arange(0, 256, 17, dtype=torch.uint8)[:8]  # all 16 nibbles in row 0
        codes[0, 8:16] = torch.arange(15, 256, 17, dtype=torch.uint8)[:8]
        if fmt is WeightFormat.MXFP4:
            scale = torch.randint(100, 150, (n, k // 32), dtype=torch.uint8, generator=g)
            scale[0, 0] = 0  # 2^-127, an fp32 subnormal
            scale[-1, -1] = top_e8m0  # 2^127: keep |code| <= 1.5 there so the product stays finite
            codes[-1, -16:] &= 0x33
            ws.append(PackedFP4(FP4Scheme.MXFP4, codes, scale))
            continue
        scale = _e4m3_codes(n, k // 16, g).view(torch.float8_e4m3fn)
        scale = torch.where(scale.float() < 0, -scale.float(), scale.float()).to(torch.float8_e4m3fn)
        scale[0, 0], scale[-1, -1] = 2**-9, 448.0  # ModelOpt's clamp range, both ends
        scale[0, 1] = 2**-9 / 8  # the smallest e4m3 subnormal
        s2 = torch.tensor(1.7e-3)
        scheme = FP4Scheme.NVFP4_MODELOPT if fmt is WeightFormat.NVFP4_MODELOPT else FP4Scheme.NVFP4_CT
        ws.append(PackedFP4(scheme, codes, scale, s2 if scheme is FP4Scheme.NVFP4_MODELOPT else 1 / s2))
    return PackedWeights.stack(ws)


SHAPES = {  # (N, K): block multiples, and TP-sliced expert widths (I = 1536 / tp, H = 3072 / tp)
    WeightFormat.BF16: [(256, 384), (96, 200)],
    WeightFormat.FP8_BLOCK: [(256, 384), (192, 128)],
    WeightFormat.NVFP4_MODELOPT: [(256, 384), (96, 48)],
    WeightFormat.NVFP4_CT: [(256, 384), (96, 48)],
    WeightFormat.MXFP4: [(256, 384), (96, 96)],
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoded_values_equal_the_formula_bit_for_bit(isa, fmt, dtype):
    backend = gemv_backend(isa)
    for n, k in SHAPES[fmt]:
        w = make_weight(fmt, n, k)
        want = w.dequantize(0, dtype)  # [N, K] formats/ oracle, one rounding to dtype
        eye = torch.eye(k, dtype=dtype)
        got = linear(eye[:GEMV_ROWS], w, backend)  # GEMV path: [rows, N] = W[:, :rows]ᵀ
        want_t = want[:, :GEMV_ROWS].T
        if dtype == torch.bfloat16:  # AVX-512 BF16 dot products flush fp32-subnormal weights, only those
            want_t = torch.where((want_t.abs() < 2**-126) & (got == 0), 0, want_t)
        torch.testing.assert_close(got, want_t, rtol=0, atol=0, equal_nan=True)
        # tile + at::mm path: the decoded tile goes through the same GEMM as dequantise-then-matmul
        # (oneDNN's bf16 GEMM flushes fp32-subnormal products, in both)
        got = linear(eye, w, backend)
        torch.testing.assert_close(got, F.linear(eye, want), rtol=0, atol=0, equal_nan=True)


def _check_products(y: torch.Tensor, x: torch.Tensor, wd: torch.Tensor) -> None:
    """y [M, N] vs x [M, K] · wd [N, K]ᵀ within the fp32 summation bound (+ bf16 output rounding)."""
    ref = x.double() @ wd.double().T
    # fp32 summation (K·u·Σ|x||w|) plus underflow (K·2^-126: GEMMs may flush subnormal products)
    bound = x.shape[1] * (2.0**-24 * (x.double().abs() @ wd.double().abs().T) + 2.0**-126)
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound.clamp_min(1e-300)).max()):.3g}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_products_within_fp32_summation_bound(isa, fmt, dtype):
    backend = gemv_backend(isa)
    g = torch.Generator().manual_seed(1)
    for n, k in SHAPES[fmt]:
        w = make_weight(fmt, n, k, seed=n + k, top_e8m0=200)
        wd = w.dequantize(0, dtype)
        for m in (1, 3, 8, 64, 300):
            x = torch.randn(m, k, generator=g).to(dtype)
            _check_products(linear(x, w, backend), x, wd)


@pytest.mark.parametrize("isa", ISAS)
def test_nan_codes_propagate_like_the_reference(isa):
    w = make_weight(WeightFormat.FP8_BLOCK, 128, 128)
    w.q.view(torch.uint8)[0, 5, 7] = 0x7F
    w.q.view(torch.uint8)[0, 9, 3] = 0xFF
    x = torch.randn(2, 128)
    y = linear(x, w, gemv_backend(isa))
    assert y[:, [5, 9]].isnan().all() and not y[:, [0, 1, 2, 3, 4, 6, 7, 8]].isnan().any()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_linear_matches_a_per_expert_loop(isa, fmt):
    w = make_weight(fmt, 128, 256, seed=3, experts=5, top_e8m0=200)
    counts = [3, 0, 8, 40, 1]  # an empty expert, GEMV and at::mm sized groups
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).int()
    x = torch.randn(sum(counts) + 2, 256).to(torch.bfloat16)  # 2 trailing rows past offsets[-1]
    y = grouped_linear(x, offsets, w, gemv_backend(isa))
    assert y[-2:].eq(0).all()
    for e, (start, end) in enumerate(zip([0, *offsets.tolist()], offsets.tolist())):
        if end > start:
            _check_products(y[start:end], x[start:end], w.dequantize(e, torch.bfloat16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_expert_ffn_matches_dequantised_swiglu(isa, fmt):
    E, H, I = 4, 256, 128
    w13, w2 = make_weight(fmt, 2 * I, H, 5, E, 200), make_weight(fmt, H, I, 6, E, 200)
    if fmt is WeightFormat.MXFP4:  # keep activations finite through two layers: moderate scales
        w13.scale.clamp_(118, 124), w2.scale.clamp_(118, 124)
    if fmt is WeightFormat.FP8_BLOCK:
        w13.scale.clamp_(2**-10, 2**-6), w2.scale.clamp_(2**-10, 2**-6)
    counts = [8, 2, 0, 20]
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).int()
    x = torch.randn(sum(counts), H).to(torch.bfloat16)
    y = grouped_expert_ffn(x, offsets, w13, w2, gemv_backend(isa))
    ref, start = torch.zeros_like(x), 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            gate, up = F.linear(x[start:end], w13.dequantize(e, x.dtype)).chunk(2, dim=-1)
            ref[start:end] = F.linear(F.silu(gate) * up, w2.dequantize(e, x.dtype))
        start = end
    # two bf16 linears and a bf16 SwiGLU: the intermediate roundings may differ by one bf16 ulp
    torch.testing.assert_close(y, ref, rtol=2**-6, atol=2**-6 * float(ref.abs().max()))


def test_fallback_backend_gives_the_same_values():
    w = make_weight(WeightFormat.MXFP4, 96, 96)
    x = torch.randn(5, 96)
    fallback = build.select_backend("none")
    assert not fallback.available and fallback.name == "pytorch"
    torch.testing.assert_close(linear(x, w, fallback), x @ w.dequantize(0, torch.float32).T)


def test_isa_override_and_errors():
    assert build.select_backend("scalar").name == "cpu-scalar"
    assert build.select_backend("").name == f"cpu-{ISAS[-1]}"  # the widest supported
    with pytest.raises(ValueError, match="M2SERVE_CPU_ISA='sse9'"):
        build.select_backend("sse9")


def test_fake_impl_gives_shapes_without_running():
    w = make_weight(WeightFormat.FP8_BLOCK, 128, 256)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(7, 256))
        offsets = mode.from_tensor(torch.tensor([7], dtype=torch.int32))
        q, scale = mode.from_tensor(w.q), mode.from_tensor(w.scale)
        y = torch.ops.m2serve_kernels.grouped_linear(x, offsets, q, scale, None, 1, 128, 128, 0, 16, 16, 64)
    assert tuple(y.shape) == (7, 128)


def test_opcheck_schema_and_fake():
    w = make_weight(WeightFormat.MXFP4, 32, 64, top_e8m0=130)  # opcheck perturbs inputs: no fp8 tensors
    args = (torch.randn(3, 64), torch.tensor([3], dtype=torch.int32), w.q, w.scale, None,
            int(w.fmt), 1, 32, 0, 16, 16, 64)
    torch.library.opcheck(torch.ops.m2serve_kernels.grouped_linear.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_scales_near_the_fp32_limit(isa, dtype):
    # a block scale >= 2^120 (the AVX-512 path rescales e4m3 by 2^8 first): small codes keep W finite
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (128, 256), dtype=torch.uint8, generator=g) & 0x9F  # exponent <= 3
    scale = torch.tensor([[1.5 * 2.0**121, 3.0]])
    w = PackedWeights.stack([PackedFP8(codes.view(torch.float8_e4m3fn), scale)])
    want = w.dequantize(0, dtype)
    got = linear(torch.eye(256, dtype=dtype)[:GEMV_ROWS], w, gemv_backend(isa))
    torch.testing.assert_close(got, want[:, :GEMV_ROWS].T, rtol=0, atol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_w13_from_separate_w1_w3_matches_two_linears(isa, fmt):
    # how the experts' buffers (w1, w3 each [E, I, H] with their own NVFP4 weight_scale_2) feed the op
    E, H, I = 3, 256, 128
    w1, w3 = make_weight(fmt, I, H, 11, E, 200), make_weight(fmt, I, H, 12, E, 200)
    w2 = make_weight(fmt, H, I, 13, E, 200)
    if w3.scale_2 is not None:
        w3.scale_2 = w3.scale_2 * 3  # differs from w1's
    w13 = PackedWeights.concat_rows([w1, w3])
    assert w13.out_features == 2 * I
    for fmt_w in (w1, w3, w2, w13):
        if fmt_w.fmt is WeightFormat.MXFP4:
            fmt_w.scale.clamp_(118, 124)
        if fmt_w.fmt is WeightFormat.FP8_BLOCK:
            fmt_w.scale.clamp_(2**-10, 2**-6)
    counts = [2, 9, 30]
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).int()
    x = torch.randn(sum(counts), H).to(torch.bfloat16)
    y = grouped_expert_ffn(x, offsets, w13, w2, gemv_backend(isa))
    ref, start = torch.zeros_like(x), 0
    for e, end in enumerate(offsets.tolist()):
        xe = x[start:end]
        gate, up = F.linear(xe, w1.dequantize(e, x.dtype)), F.linear(xe, w3.dequantize(e, x.dtype))
        ref[start:end] = F.linear(F.silu(gate) * up, w2.dequantize(e, x.dtype))
        start = end
    torch.testing.assert_close(y, ref, rtol=2**-6, atol=2**-6 * float(ref.abs().max()))


def test_two_threads_under_inference_mode():
    # worker threads of at::parallel_for do not inherit InferenceMode (the many-row path writes y there)
    w = make_weight(WeightFormat.FP8_BLOCK, 512, 256)
    x = torch.randn(40, 256).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            y = linear(x, w)
            y_small = linear(x[:3], w)
    finally:
        torch.set_num_threads(threads)
    _check_products(y, x, w.dequantize(0, torch.bfloat16))
    _check_products(y_small, x[:3], w.dequantize(0, torch.bfloat16))


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_every_row_count_band_remainder_and_negative_scales(isa):
    # bf16 activations, 1..16 rows (the AVX-512 path takes one or two weight rows at a time and up to
    # 8 activation rows per pass), N = 131: a last scale band of 3 rows; every code, negative scales
    # (fp32(q) * s flips the sign), a scale that is an fp32 subnormal and one at the top of the range
    g = torch.Generator().manual_seed(8)
    n, k = 131, 256
    q = _e4m3_codes(n, k, g).view(torch.float8_e4m3fn)
    scale = torch.tensor([[-0.75, 2.0**-3], [1.5 * 2.0**-130, -3.0 * 2.0**100]])
    w = PackedWeights.stack([PackedFP8(q, scale)])
    backend = gemv_backend(isa)
    want = w.dequantize(0, torch.bfloat16)
    got = linear(torch.eye(k, dtype=torch.bfloat16)[:GEMV_ROWS], w, backend)
    want_t = torch.where((want[:, :GEMV_ROWS].T.abs() < 2**-126) & (got == 0), 0, want[:, :GEMV_ROWS].T)
    torch.testing.assert_close(got, want_t, rtol=0, atol=0)
    x = torch.randn(GEMV_ROWS, k, generator=g).to(torch.bfloat16)
    for m in range(1, GEMV_ROWS + 1):
        _check_products(linear(x[:m], w, backend), x[:m], want)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_weights_one_to_nine_rows_and_an_odd_last_row(isa):
    # the AVX-512 BF16 path runs passes of up to 4 activation rows, one weight row at a time for 1-2
    # rows and two at a time for 3-4 (N = 131 leaves an odd last row); 1..9 rows cover every pass
    # shape. Each row's result must not depend on how many rows share the call (bit for bit: the
    # batch-invariant mode relies on it, docs/model.md §7)
    g = torch.Generator().manual_seed(9)
    w = make_weight(WeightFormat.BF16, 131, 256, seed=9)
    backend = gemv_backend(isa)
    eye = torch.eye(256, dtype=torch.bfloat16)
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    alone = [linear(x[i:i + 1], w, backend) for i in range(9)]
    for m in range(1, 10):
        torch.testing.assert_close(linear(eye[:m], w, backend), w.q[0][:, :m].T, rtol=0, atol=0)
        got = linear(x[:m], w, backend)
        _check_products(got, x[:m], w.q[0])
        assert all(torch.equal(got[i:i + 1], alone[i]) for i in range(m)), m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_rows_do_not_depend_on_the_row_count(isa, dtype):
    # FP8 blocks with fp32 dot products decode each weight once for up to 8 activation rows in
    # registers on AVX-512 (csrc/packed_linear.cpp gemv_fp8_f32_avx512): each row's result must be
    # bit-equal to the same row alone, for 1..11 rows (one and two passes of up to 8) and in a grouped
    # call, since a speculative verification step (K + 1 rows) must compute what one-row decode
    # steps compute (docs/serving.md §13). K = 48 with 16-column blocks leaves a last 16 columns after
    # the 32-column steps; the second scale band is 2^125, whose 2^8 multiple overflows fp32 (the
    # other decode); identity rows still read the formula's values bit for bit.
    g = torch.Generator().manual_seed(34)
    n, k = 40, 48
    codes = _e4m3_codes(n, k, g)
    codes[16:32] &= 0xBF  # |q| < 2 in the 2^125 band: its weights stay finite
    q = codes.view(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-20, 21, (3, 3), generator=g).float())
    scale *= 1 + torch.rand(3, 3, generator=g)
    scale[1, :] = 2.0**125
    w = PackedWeights(WeightFormat.FP8_BLOCK, q[None], scale[None], None, 16, 16)
    backend = gemv_backend(isa)
    want = w.dequantize(0, dtype)
    eye = torch.eye(k, dtype=dtype)
    for c in range(0, k, 11):  # every column, through GEMV calls of up to 11 identity rows
        got = linear(eye[c:c + 11], w, backend)
        want_t = want[:, c:c + 11].T
        if dtype == torch.bfloat16:  # as in test_decoded_values_equal_the_formula_bit_for_bit
            want_t = torch.where((want_t.abs() < 2**-126) & (got == 0), 0, want_t)
        torch.testing.assert_close(got, want_t, rtol=0, atol=0, equal_nan=True)
    x = (torch.randn(11, k, generator=g) * 2.0**-125).to(dtype)  # keeps the 2^125 band finite
    alone = [linear(x[i:i + 1], w, backend) for i in range(11)]
    for m in range(1, 12):
        got = linear(x[:m], w, backend)
        _check_products(got, x[:m], want)
        assert all(torch.equal(got[i:i + 1], alone[i]) for i in range(m)), m
    # grouped: rows 0-2 through expert 0, rows 3-10 through expert 1 (the same weight)
    w2 = PackedWeights(WeightFormat.FP8_BLOCK, torch.stack([q, q]), torch.stack([scale, scale]), None, 16, 16)
    got = grouped_linear(x, torch.tensor([3, 11], dtype=torch.int32), w2, backend)
    assert torch.equal(got, torch.cat(alone)), "grouped rows differ from the rows alone"


@pytest.mark.parametrize("isa", ISAS)
def test_mxfp4_exponent_add_range_edges(isa):
    # docs/kernels.md §6: groups with E8M0 exponent in [2, 252] are decoded by adding (e - 127) << 7
    # to the bf16 bits of the E2M1 value; 1 and 253 (and 0, 254) take the fp32 path. Each row mixes
    # groups on both sides of each edge, every nibble in every group; bf16 and fp32 activations
    # must give the formula's values bit for bit (fp32-subnormal weights flush only on the BF16
    # dot-product path, as in test_decoded_values_equal_the_formula_bit_for_bit).
    n, k = 8, 256
    codes = torch.arange(256, dtype=torch.uint8).repeat(n, k // 2 // 256 + 1)[:, : k // 2]
    codes = torch.roll(codes, 1, 1).contiguous()
    edges = torch.tensor([1, 2, 252, 253, 2, 1, 253, 252], dtype=torch.uint8)
    scale = torch.stack([torch.roll(edges, i) for i in range(n)])
    scale[3, 5], scale[6, 2] = 0, 254  # the subnormal scale and the largest, among fast groups
    codes[:, : k // 2] &= torch.where(scale.repeat_interleave(16, 1) >= 253, 0x33, 0xFF).to(torch.uint8)
    w = PackedWeights.stack([PackedFP4(FP4Scheme.MXFP4, codes, scale)])
    backend = gemv_backend(isa)
    for dtype in DTYPES:
        want = w.dequantize(0, dtype)
        eye = torch.eye(k, dtype=dtype)
        for m in (1, 2, 3):
            got = linear(eye[:m], w, backend)
            want_t = want[:, :m].T
            if dtype == torch.bfloat16:
                want_t = torch.where((want_t.abs() < 2**-126) & (got == 0), 0, want_t)
            torch.testing.assert_close(got, want_t, rtol=0, atol=0, equal_nan=True)
