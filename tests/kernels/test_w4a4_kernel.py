"""The FP4 x FP4 CPU kernels (csrc/w4a4_linear.cpp, docs/checkpoints.md §9.1) against
quantise-then-matmul: formats/act_quant.py's quantise-dequantise (bit-equal to amd-quark and
nvidia-modelopt, tests/formats/test_act_quant.py) and formats/' fp32 dequantised weight.

Every path is run: AVX-512 VNNI, AVX2 and scalar, each as ``M2SERVE_CPU_ISA`` = avx512 / avx2 /
scalar selects it (build.select_backend, then ops.w4a4_path), where the CPU has it.

1. The kernel's quantised activations (its codes times its scales, ``w4a4_quantized_inputs``)
   equal the quantise-dequantise in fp32 bit for bit, on random and adversarial rows (zeros,
   all-equal groups, every rounding tie, values at and beyond 6 · scale, subnormal and huge
   amax, inf and NaN, non-positive and NaN input scales).
2. Products, derived bound. Write a_k, w_k for the exact dequantised values (E2M1 · scale) and
   S = Σ_k |a_k · w_k|. The kernel sums L ≤ K/8 + 1 fp32 terms t_i = P_i · fl(s_x · s_w) (P_i an
   exact int32 partial dot product of 8 columns, or of a tail group), each with 2 roundings, in
   some order: |ŷ − Σ a_k w_k| ≤ γ_{L+1} · Σ|t_i| ≤ γ_{L+1} · S (Higham, Accuracy and Stability
   of Numerical Algorithms, §3.1 and §4.2: γ_n = n·u / (1 − n·u), u = 2⁻²⁴). The reference r
   sums the fp32 values a'_k = a_k(1+δ), w'_k = w_k(1+δ'), |δ|, |δ'| ≤ u (rounded for NVFP4,
   exact for MXFP4) in float64: |r − Σ a_k w_k| ≤ (2u + u² + K·2⁻⁵³(1+u)²)·S. Both together, with
   S ≤ S'/(1−u)² (S' = Σ|a'_k w'_k|, what the test computes): |ŷ − r| ≤ (γ_{L+1} + 3u)·S'/(1−u)²
   ≤ γ_{K/8+6}·S' for K ≤ 2¹⁶ (γ_n + γ_m ≤ γ_{n+m}). Plus (K + K/8 + 4)·2⁻¹⁴⁹ for results in
   the fp32 subnormals (one half-ulp of the smallest subnormal per rounding), plus 2⁻⁸·(|r| + bound)
   (one rounding to bf16) for bf16 outputs. One wrong E2M1 code changes y by about |w|·s/2, some
   hundred times that bound on these shapes (a wrong lane in the AVX-512 block transpose fails it).
"""

from __future__ import annotations

import pytest
import torch
from test_packed_linear import make_weight  # tests/kernels is on sys.path (pytest rootdir mode)

from m2serve.formats.act_quant import E2M1_MAGNITUDES, ActivationScheme, qdq_mxfp4, qdq_nvfp4, qdq_nvfp4_ct
from m2serve.kernels import build
from m2serve.kernels.choice import LinearImpl, choose_impl
from m2serve.kernels.ops import (
    PackedWeights,
    W4A4Path,
    WeightFormat,
    cpu_w4a4_grouped_linear,
    w4a4_path,
    w4a4_quantized_inputs,
)

ISAS = build.supported_isas()
FP4 = [WeightFormat.MXFP4, WeightFormat.NVFP4_MODELOPT, WeightFormat.NVFP4_CT]
#: (weight format, activation rule): Quark MXFP4, ModelOpt NVFP4, compressed-tensors NVFP4 (docs §9)
CASES = [(WeightFormat.MXFP4, ActivationScheme.MXFP4), (WeightFormat.NVFP4_MODELOPT, ActivationScheme.NVFP4),
         (WeightFormat.NVFP4_CT, ActivationScheme.NVFP4), (WeightFormat.NVFP4_CT, ActivationScheme.NVFP4_CT)]
CASE_IDS = ["mxfp4", "nvfp4-modelopt", "nvfp4-ct-weights", "nvfp4-ct-rules"]
U = 2.0**-24


def _path(isa: str) -> W4A4Path:
    return w4a4_path(build.select_backend(isa).isa)


def test_every_path_is_reached():
    # avx512 -> VNNI where the CPU has it, avx2 -> AVX2, scalar -> scalar: M2SERVE_CPU_ISA forces each
    assert _path("scalar") is W4A4Path.SCALAR
    if "avx2" in ISAS:
        assert _path("avx2") is W4A4Path.AVX2
    if "avx512" in ISAS:
        want = W4A4Path.AVX512_VNNI if torch.ops.m2serve_kernels.w4a4_path_supported(2) else W4A4Path.AVX2
        assert _path("avx512") is want


def _qdq(x: torch.Tensor, act: ActivationScheme, gs: torch.Tensor | None) -> torch.Tensor:
    """The reference's fp32 values (compressed-tensors: its amax/6 in x's dtype, fp32 output)."""
    if act is ActivationScheme.MXFP4:
        return qdq_mxfp4(x.float())
    if act is ActivationScheme.NVFP4_CT:
        return qdq_nvfp4_ct(x, gs, torch.float32)
    return qdq_nvfp4(x.float(), gs)


def _adversarial(fmt: WeightFormat, k: int) -> torch.Tensor:
    """Rows of width k (a multiple of 64): each a case of docs/checkpoints.md §9's rounding rules."""
    g = 32 if fmt is WeightFormat.MXFP4 else 16
    s = 1.0 if fmt is WeightFormat.MXFP4 else 2.0  # the group scale the anchor 6·s sets (NVFP4: gs = 1)
    mags = torch.tensor(E2M1_MAGNITUDES)
    ties = (mags[1:] + mags[:-1]) / 2
    grid = torch.cat([mags, ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(9.0)),
                      torch.tensor([6.5, 7.0, 100.0])])  # beyond 6: saturates (the anchor keeps the scale)
    rows = []

    def row_of(vals: torch.Tensor) -> torch.Tensor:
        r = vals.repeat(-(-k // len(vals)))[:k].clone()
        r[::g] = 6.0 * s  # one anchor per group: the scale is s
        return r

    rows.append(row_of(grid * s))
    rows.append(row_of(-grid * s))  # negative ties and -0 / small negatives
    rows.append(torch.zeros(k))
    rows.append(torch.full((k,), 3.25))  # all-equal groups
    rows.append(torch.full((k,), -1e-40))  # subnormal amax
    rows.append(torch.full((k,), 2.0**-130) * torch.arange(k) % 7)
    rows.append(torch.full((k,), 3.0e38) * torch.linspace(-1, 1, k))  # huge: amax rounds past fp32
    rows.append(torch.full((k,), 1.7e38))
    inf = torch.randn(k)
    inf[3], inf[g + 5] = float("inf"), float("-inf")
    nan = torch.randn(k)
    nan[g + 1] = float("nan")
    rows += [inf, nan]
    return torch.stack(rows)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("fmt", "act"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_quantisation_is_the_qdq_bit_for_bit(isa, fmt, act, dtype):
    # under each path: the layouts differ (AVX-512 VNNI adds the 16-group blocks), and a wrong position
    # in a layout reads back as a wrong value
    g = torch.Generator().manual_seed(0)
    for k in (1024, 384, 160, 64):
        spread = torch.exp2(torch.randint(-20, 20, (6, 1), generator=g).float())
        rand = torch.randn(6, k, generator=g) * spread
        x = torch.cat([rand, _adversarial(fmt, k)]).to(dtype)
        nv = fmt is not WeightFormat.MXFP4
        # NVFP4: one input scale per expert: 1, a tiny one, 0 and negative (ModelOpt: -> 1e-12), NaN
        # (ModelOpt: -> 1e-12); compressed-tensors (a global scale): 1, large ones, 0 (s = inf: all NaN)
        scales = ([1.0, 1e-3, 1e-9, 0.0, -2.0, float("nan")] if act is ActivationScheme.NVFP4
                  else [1.0, 67.2, 3e5, 0.0] if nv else [0.0])
        for gs in scales:
            scale = torch.tensor([gs]) if nv else None
            one = torch.tensor([x.shape[0]], dtype=torch.int32)
            got = w4a4_quantized_inputs(x, one, fmt, scale, _path(isa), act)
            want = _qdq(x, act, scale[0] if nv else None)
            where = f"{fmt.name} K={k} gs={gs}"
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, where=where: f"{where}: {m}")
            # every zero +0, as Quark and ModelOpt give (a NaN's sign bit carries nothing); compressed-tensors
            # gives -0 for small negatives, which an integer code cannot hold (the products are the same)
            num = ~want.isnan() & ((want != 0) | (act is not ActivationScheme.NVFP4_CT))
            assert torch.equal(got.signbit()[num], want.signbit()[num])


def _check(y: torch.Tensor, xq: torch.Tensor, wd: torch.Tensor) -> None:
    """y [M, N] vs the float64 sum of the fp32 values xq [M, K] · wd [N, K]ᵀ within the module's bound."""
    k = xq.shape[1]
    ref = xq.double() @ wd.double().T
    n = k // 8 + 6
    bound = n * U / (1 - n * U) * (xq.double().abs() @ wd.double().abs().T) + (k + k // 8 + 4) * 2.0**-149
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (ref.abs() + bound)
    err = (y.double() - ref).abs()
    finite = ref.isfinite()
    assert bool((err[finite] <= bound[finite]).all()), \
        f"max err/bound {float((err[finite] / bound[finite]).max()):.3g}"
    torch.testing.assert_close(y[~finite].double(), ref[~finite], rtol=0, atol=0, equal_nan=True)


# AVX-512 VNNI: 16-group blocks (512 columns MXFP4, 256 NVFP4), then 128-column chunks, then groups:
# 1152 = 2 blocks + 1 chunk (MXFP4) / 4 blocks + 1 chunk (NVFP4); 384 = chunks only (MXFP4) / one block
# + one chunk (NVFP4); 160 = chunk + tail; 96 = tail only. The other paths: chunks, then groups.
SHAPES = [(32, 1152), (64, 384), (40, 160), (24, 96)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("fmt", "act"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_within_the_summation_bound(isa, fmt, act, dtype):
    path = _path(isa)
    g = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        if k % 32 and fmt is WeightFormat.MXFP4:
            continue
        w = make_weight(fmt, n, k, seed=n + k, experts=3, top_e8m0=160)
        counts = [5, 0, 13]  # an empty expert; 13 rows: one block of 8 and one of 5
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).int()
        x = (torch.randn(sum(counts) + 2, k, generator=g) * 4).to(dtype)  # 2 rows past offsets[-1]
        scale = None if fmt is WeightFormat.MXFP4 else torch.tensor([0.02, 5.0, 1e-3])
        if act is ActivationScheme.NVFP4_CT:
            scale = 1 / scale  # global scales
        y = cpu_w4a4_grouped_linear(x, offsets, w, path, scale, act)
        assert y.dtype == dtype and y.shape == (x.shape[0], n)
        assert y[-2:].eq(0).all()
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                xq = _qdq(x[start:end], act, scale[e] if scale is not None else None)
                _check(y[start:end], xq, w.dequantize(e, torch.float32))
            start = end


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("fmt", "act"), CASES, ids=CASE_IDS)
def test_adversarial_rows_within_the_bound_or_as_the_reference(isa, fmt, act):
    # rounding ties, saturation, zeros, subnormal amax; inf and NaN rows take the fp32 path and give the
    # reference's inf / NaN (weights with moderate scales so that finite sums stay finite)
    k, n = 384, 32
    w = make_weight(fmt, n, k, seed=7)
    if fmt is WeightFormat.MXFP4:
        w.scale.clamp_(120, 130)
    x = _adversarial(fmt, k)
    x = x[(x.abs().amax(1) < 1e30) | ~x.isfinite().all(1)]  # huge finite rows would overflow the sums
    scale = torch.tensor([1.0]) if fmt is not WeightFormat.MXFP4 else None
    y = cpu_w4a4_grouped_linear(x, torch.tensor([x.shape[0]], dtype=torch.int32), w, _path(isa), scale, act)
    _check(y, _qdq(x, act, scale[0] if scale is not None else None), w.dequantize(0, torch.float32))


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_result_does_not_depend_on_the_batch(isa):
    # batch invariance (docs/model.md §7): each row is summed in the same order whatever the call holds
    w = make_weight(WeightFormat.MXFP4, 48, 256, seed=2, top_e8m0=140)
    x = torch.randn(13, 256).to(torch.bfloat16)
    one = torch.tensor([1], dtype=torch.int32)
    full = cpu_w4a4_grouped_linear(x, torch.tensor([13], dtype=torch.int32), w, _path(isa))
    for r in (0, 7, 12):
        alone = cpu_w4a4_grouped_linear(x[r:r + 1], one, w, _path(isa))
        torch.testing.assert_close(alone, full[r:r + 1], rtol=0, atol=0)


def test_bad_inputs_are_refused_naming_the_field():
    w = make_weight(WeightFormat.NVFP4_MODELOPT, 16, 64)
    x = torch.randn(2, 64)
    off = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="NVFP4 needs a contiguous act_scale f32 \\[E\\]"):
        cpu_w4a4_grouped_linear(x, off, w, W4A4Path.SCALAR)
    with pytest.raises(RuntimeError, match="q holds K = 64 columns, x has 32"):
        cpu_w4a4_grouped_linear(x[:, :32], off, w, W4A4Path.SCALAR, torch.ones(1))
    bf16 = PackedWeights(WeightFormat.BF16, torch.zeros(1, 16, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="q must be a contiguous uint8"):
        cpu_w4a4_grouped_linear(x, off, bf16, W4A4Path.SCALAR)


def test_choice_takes_the_w4a4_kernels_only_for_fp4_experts_with_matching_inputs():
    from m2serve.formats.act_quant import ActivationScheme as A

    backend = build.select_backend("scalar")
    c = choose_impl("cpu", WeightFormat.MXFP4, torch.bfloat16, backend, grouped=True, act_scheme=A.MXFP4)
    assert (c.impl, c.isa, c.label) == (LinearImpl.CPU_W4A4, int(W4A4Path.SCALAR), "cpu-w4a4-scalar")
    for fmt in (WeightFormat.NVFP4_CT, WeightFormat.NVFP4_MODELOPT):
        for scheme in (A.NVFP4, A.NVFP4_CT):
            c = choose_impl("cpu", fmt, torch.float32, backend, grouped=True, act_scheme=scheme)
            assert c.impl is LinearImpl.CPU_W4A4
    mx, nv = WeightFormat.MXFP4, WeightFormat.NVFP4_MODELOPT
    for fmt, scheme, grouped in ((mx, None, True), (mx, A.NVFP4, True), (nv, A.MXFP4, True),
                                 (mx, A.MXFP4, False), (WeightFormat.FP8_BLOCK, A.MXFP4, True)):
        assert choose_impl("cpu", fmt, torch.bfloat16, backend, grouped=grouped,
                           act_scheme=scheme).impl is LinearImpl.CPU_PACKED
    none = build.select_backend("none")
    assert choose_impl("cpu", WeightFormat.MXFP4, torch.bfloat16, none, grouped=True,
                       act_scheme=A.MXFP4).impl is LinearImpl.TORCH


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("fmt", "act"), CASES, ids=CASE_IDS)
def test_experts_module_runs_the_kernel_with_each_experts_scales(isa, fmt, act):
    # model/experts.py with the CPU_W4A4 choice: rows sorted by expert, each quantised with ITS expert's
    # input scales (NVFP4: w13's and w2's), equal to the module's reference loop (qdq + dequantised
    # weights, rows_loop) within a loose bound (two products and a bf16-free SwiGLU in fp32)
    from m2serve.formats.fp4 import FP4Scheme, PackedFP4
    from m2serve.model.experts import MiniMaxM2Experts

    E, H, I = 3, 256, 128
    ex = MiniMaxM2Experts(H, I, start=0, num_local=E, dtype=torch.float32)
    scheme = {WeightFormat.MXFP4: FP4Scheme.MXFP4, WeightFormat.NVFP4_MODELOPT: FP4Scheme.NVFP4_MODELOPT,
              WeightFormat.NVFP4_CT: FP4Scheme.NVFP4_CT}[fmt]
    for which, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
        w = make_weight(fmt, n, k, seed=len(which) + n, experts=E)
        if fmt is WeightFormat.MXFP4:
            w.scale.clamp_(118, 126)
        for e in range(E):
            s2 = None if w.scale_2 is None else w.scale_2[e]
            ex.load_expert(e, which, PackedFP4(scheme, w.q[e], w.scale[e], s2, f"experts.{e}.{which}.weight"))
    ex.pack_for_kernels()
    s13, s2 = [0.02, 0.5, 0.004], [0.01, 0.003, 0.2]
    if act is ActivationScheme.NVFP4_CT:  # global scales
        s13, s2 = [1 / v for v in s13], [1 / v for v in s2]
    ex.set_activation_quant(act, {f"experts.{e}.{w}.weight": (s2 if w == "w2" else s13)[e]
                                  for e in range(E) for w in ("w1", "w3", "w2")})
    ex.set_choice(choose_impl("cpu", fmt, torch.float32, build.select_backend(isa), grouped=True,
                              act_scheme=act))
    assert ex.choice.impl is LinearImpl.CPU_W4A4 and ex.choice.isa == int(_path(isa))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, H, generator=g)
    ids = torch.tensor([0, 0, 2, 2, 2, 1, 0, 2, 1])
    got = ex.rows(x, ids)
    want = ex.rows_loop(x, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
