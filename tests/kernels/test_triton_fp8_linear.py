"""The Triton block-scaled FP8 linear under the interpreter (docs/kernels.md §1, §4): fp32 compute
against formats/fp8.py's bit-exact dequantiser + a float64 matmul, on TP slices whose rows or
columns start inside a 128-wide scale band. W8A8 is judged under the interpreter only on activations its
quantiser maps exactly (the interpreter's fp8 rounding is not the GPU's); the quantiser itself is
checked on CPU in torch against hand-derived values. The sm_90 compile of every variant is
tests/kernels/test_triton_compile.py (the module is in aot.KERNEL_MODULES).
"""

from __future__ import annotations

import pytest
import torch

from m2serve.formats.fp8 import E4M3_MAX, dequantize_fp8_block, quantize_fp8_act_groups, quantize_fp8_block

fp8_linear = pytest.importorskip("m2serve.kernels.triton.fp8_linear")  # the test extra pins triton


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]  # per-row magnitudes differ
    return quantize_fp8_block(w)


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    w = dequantize_fp8_block(q, s, torch.float32)  # the bit-exact dequantiser (docs/checkpoints.md §6)
    return x.double() @ w.double().T


@pytest.mark.parametrize("m", [1, 5, 20])
def test_w8a16_whole_weight(m):
    q, s = _weights(192, 384, 0)  # N not a multiple of 64 or 128: partial tiles and a partial band
    x = torch.randn(m, 384).to(torch.bfloat16).float()
    y = fp8_linear.fp8_linear(x, q, s)
    ref = _reference(x, q, s)
    assert y.dtype == torch.float32 and y.shape == (m, 192)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize(("start", "end"), [(64, 256), (192, 320), (0, 96), (128, 384)])
def test_w8a16_tp_row_slices_split_a_scale_band(start, end):
    # a rank's rows [start, end) of a [384, 256] weight: the codes of its rows, the scale bands
    # covering them, row0 = start % 128 (e.g. I = 1,536 over 8 ranks: 192 rows, band 1 split)
    q, s = _weights(384, 256, 1)
    x = torch.randn(3, 256).to(torch.bfloat16).float()
    band0, band1 = start // 128, -(-end // 128)
    y = fp8_linear.fp8_linear(x, q[start:end], s[band0:band1], row0=start % 128)
    ref = _reference(x, q, s)[:, start:end]
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_w8a16_k_slice_and_leading_dims():
    # a row-parallel rank: columns [128, 384) of the weight (K slices start on a block)
    q, s = _weights(128, 512, 2)
    x = torch.randn(2, 3, 256).to(torch.bfloat16).float()
    y = fp8_linear.fp8_linear(x, q[:, 128:384], s[:, 1:3])
    ref = _reference(x.view(6, 256), q[:, 128:384], s[:, 1:3]).view(2, 3, 128)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize(("rows", "cols"), [((0, 128), (64, 384)), ((0, 192), (192, 448)),
                                            ((0, 64), (320, 384)), ((64, 256), (192, 448))])
def test_w8a16_tp_column_slices_split_a_scale_band(rows, cols):
    # issue 30: a row-parallel rank's columns [c0, c1) may start inside a 128-column band (w2 at
    # I = 1,536 over 8 ranks, o_proj of 64-wide heads): col0 = c0 % 128 and the scale columns of the
    # bands the slice touches; with a row slice too (both offsets). Against the same rows and columns
    # of the whole weight's bit-exact dequantisation.
    q, s = _weights(256, 512, 7)
    (r0, r1), (c0, c1) = rows, cols
    x = torch.randn(3, c1 - c0).to(torch.bfloat16).float()
    y = fp8_linear.fp8_linear(x, q[r0:r1, c0:c1], s[r0 // 128:-(-r1 // 128), c0 // 128:-(-c1 // 128)],
                              row0=r0 % 128, col0=c0 % 128)
    w = dequantize_fp8_block(q, s, torch.float32)[r0:r1, c0:c1]
    ref = x.double() @ w.double().T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _exact_activations(m: int, k: int, seed: int) -> torch.Tensor:
    # each 128-column group: e4m3 values times 2^j with one entry at +-448 * 2^j, so the quantiser's
    # scale is exactly 2^j and x / s is an e4m3 value (no rounding anywhere)
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=g) * 64).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    codes[:, ::128] = E4M3_MAX
    j = torch.randint(-6, 4, (m, k // 128), generator=g).float()
    return codes * torch.exp2(j).repeat_interleave(128, 1)


def test_w8a8_structure_on_exactly_quantised_activations():
    q, s = _weights(320, 256, 3)
    x = _exact_activations(4, 256, 4)
    xq, xs = quantize_fp8_act_groups(x)
    assert torch.equal(xq.float() * xs.repeat_interleave(128, 1), x)  # the premise: exact
    for start, end in ((0, 320), (64, 256)):
        y = fp8_linear.fp8_linear(x, q[start:end], s[start // 128: -(-end // 128)], start % 128, mode="w8a8")
        ref = _reference(x, q, s)[:, start:end]
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_w8a8_column_slice_groups_follow_the_weight_bands():
    # with col0 the activation groups are the weight's bands: columns [64, 448) of 512 are the groups
    # [64, 128), [128, 256), [256, 384), [384, 448). Each holds its band's +-448 * 2^j entry (column 64
    # copies column 0's), so the quantisation is exact and W8A8 equals x · dequant(W)ᵀ.
    q, s = _weights(192, 512, 8)
    x = _exact_activations(4, 512, 9)
    x[:, 64] = x[:, 0]
    x = x[:, 64:448]
    y = fp8_linear.fp8_linear(x, q[:, 64:448], s, col0=64, mode="w8a8")
    ref = x.double() @ dequantize_fp8_block(q, s, torch.float32)[:, 64:448].double().T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_activation_quantiser_hand_values():
    # one row, two groups of 128: amax 896 -> s = 2, 7 / 2 = 3.5 (exact); 0.3 / 2 = 0.15 rounds to
    # the nearest e4m3 (0.15 lies between 0.140625 and 0.15625: nearest 0.15625); an all-zero group: s = 1
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1], x[0, 2] = 896.0, 7.0, 0.3
    q, s = quantize_fp8_act_groups(x)
    assert s.tolist() == [[2.0, 1.0], [1.0, 1.0]]
    assert q.float()[0, :3].tolist() == [448.0, 3.5, 0.15625]
    assert q.float()[0, 128:].abs().sum() == 0 and q.float()[1].abs().sum() == 0
    # every value within half an e4m3 step of x / s (3 mantissa bits: relative 2^-4), normals only
    x = torch.randn(8, 512) * 3
    q, s = quantize_fp8_act_groups(x)
    scaled = x.view(8, 4, 128) / s[..., None]
    err = (q.float().view(8, 4, 128) - scaled).abs()
    normal = scaled.abs() >= 2.0 ** -6
    assert bool((err[normal] <= scaled.abs()[normal] * 2.0 ** -4).all())
    assert float(q.float().abs().amax()) == E4M3_MAX
    with pytest.raises(ValueError, match="not a multiple of the 128-column group"):
        quantize_fp8_act_groups(torch.zeros(1, 100))


def test_bad_shapes_name_the_mismatch():
    q, s = _weights(128, 256, 5)
    with pytest.raises(ValueError, match="activation width 128 does not match"):
        fp8_linear.fp8_linear(torch.zeros(1, 128), q, s)
    with pytest.raises(ValueError, match=r"grid \[1, 2\] does not match weight \[128, 256\] at row0 64"):
        fp8_linear.fp8_linear(torch.zeros(1, 256), q, s, row0=64)
    with pytest.raises(ValueError, match="fp8_linear mode='w4a4'"):
        fp8_linear.fp8_linear(torch.zeros(1, 256), q, s, mode="w4a4")


def test_both_modes_are_registered_for_the_sm90_compile():
    from m2serve.kernels.triton.aot import KERNEL_MODULES, all_variants

    assert "m2serve.kernels.triton.fp8_linear" in KERNEL_MODULES
    names = {v.name for v in all_variants() if v.name.startswith("fp8_linear/")}
    assert names == {f"fp8_linear/{mode}/bf16/m{bm}" for mode in ("w8a16", "w8a8") for bm in (16, 64)}


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_linear_module_runs_the_triton_choice(mode):
    # model/linear.py with the choice a GPU gets (kernels/choice.py), run here under the interpreter
    from m2serve.formats.fp8 import PackedFP8
    from m2serve.kernels.choice import KernelChoice, LinearImpl
    from m2serve.model.linear import Linear

    q, s = _weights(256, 384, 6)
    lin = Linear(384, 256, torch.float32)
    lin.load("q_proj.weight", PackedFP8(q, s))
    lin.set_choice(KernelChoice(LinearImpl.TRITON, None, f"triton-{mode}", mode))
    x = _exact_activations(3, 384, 7) / 64 if mode == "w8a8" else torch.randn(3, 384)
    ref = _reference(x, q, s)
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    dense = Linear(384, 256, torch.float32)
    with pytest.raises(ValueError, match="triton-w8a16: this linear is not held in FP8"):
        dense.set_choice(KernelChoice(LinearImpl.TRITON, None, "triton-w8a16", "w8a16"))


def test_linear_given_the_triton_choice_passes_its_slice_offsets():
    # model/linear.py: a Linear loaded with a TP slice that splits a band (rows from 64, columns from
    # 192) hands its row0 / col0 to the kernel; against its own dequantised weight + a float64 matmul
    from m2serve.formats.fp8 import PackedFP8
    from m2serve.kernels.choice import KernelChoice, LinearImpl
    from m2serve.model.linear import Linear

    q, s = _weights(384, 512, 10)
    lin = Linear(320, 256, dtype=torch.float32)
    lin.load("w", PackedFP8(q[64:320, 192:512], s[0:3, 1:4], "w", 64, 64))
    assert (lin.row0, lin.col0) == (64, 64)
    lin.set_choice(KernelChoice(LinearImpl.TRITON, None, "triton-w8a16", "w8a16"))
    x = torch.randn(4, 320).to(torch.bfloat16).float()
    ref = x.double() @ dequantize_fp8_block(q, s, torch.float32)[64:320, 192:512].double().T
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
