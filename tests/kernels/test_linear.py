"""model/linear.py on CPU: once the choice pass (model/kernel_choice.py) has run, FP8-block and bf16
weights go through the packed kernels (no per-call dequantisation), with the values of dequantise +
F.linear up to the fp32 summation order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from m2serve.formats.fp8 import PackedFP8, quantize_fp8_block
from m2serve.kernels.build import kernel_backend
from m2serve.model.kernel_choice import choose_kernels
from m2serve.model.linear import Linear


def test_fp8_linear_computes_from_codes_without_dequantising(monkeypatch):
    assert kernel_backend().available  # this machine builds them (tests/kernels/test_packed_linear.py)
    q, s = quantize_fp8_block(torch.randn(256, 384))
    lin = Linear(384, 256, torch.bfloat16)
    lin.load("q_proj.weight", PackedFP8(q, s))
    choose_kernels(lin)
    want_w = PackedFP8(q, s).dequantize(torch.bfloat16)

    def forbidden(*args):
        raise AssertionError("dequantised per call")

    monkeypatch.setattr(PackedFP8, "dequantize", forbidden)
    for m in (1, 5, 40):
        x = torch.randn(m, 384).to(torch.bfloat16)
        y = lin(x)
        ref = F.linear(x.double(), want_w.double())
        bound = 384 * 2.0**-24 * (x.double().abs() @ want_w.double().abs().T) + 2.0**-8 * ref.abs()
        assert bool(((y.double() - ref).abs() <= bound).all())


def test_bf16_linear_small_m_uses_kernel_and_matches():
    lin = Linear(320, 96, torch.bfloat16)
    lin.load("o_proj.weight", torch.randn(96, 320))
    choose_kernels(lin)
    x = torch.randn(3, 320).to(torch.bfloat16)
    assert lin.stored_weight() is not None
    ref = F.linear(x.double(), lin.weight.double())
    bound = 320 * 2.0**-24 * (x.double().abs() @ lin.weight.double().abs().T) + 2.0**-8 * ref.abs()
    assert bool(((lin(x).double() - ref).abs() <= bound).all())
    assert lin(torch.randn(40, 320).to(torch.bfloat16)).shape == (40, 96)


def test_fp32_linear_stays_on_aten():
    lin = Linear(64, 32, torch.float32)
    lin.load("w", torch.randn(32, 64))
    assert choose_kernels(lin).counts == {("linear", "dense float32", "torch"): 1}
    x = torch.randn(2, 64)
    assert lin.stored_weight() is None and torch.equal(lin(x), F.linear(x, lin.weight))
