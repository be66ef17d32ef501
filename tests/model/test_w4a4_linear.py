"""W4A4 per linear (issue 33 must show; docs/checkpoints.md §9): on identical inputs, m2serve's
quantised-input product equals the reference that applies the library's own fake quantisation to the
input and its own dequantisation to the weight, up to the fp32 summation-order bound.

- MXFP4: weights by amd-quark (``PerBlockMXObserver`` + ``real_quantize_fp4_fp6_per_group`` + ``Pack_fp4``
  + ``to_e8m0_uint8``; reference weight ``dequantize_fp4_fp6_per_group``), input by Quark's dynamic
  MXFP4 input quantiser.
- NVFP4: weights by nvidia-modelopt (``NVFP4QTensor.quantize``; reference weight its ``dequantize``),
  input by modelopt's ``fp4_fake_quant_block`` (tests/formats/modelopt_nvfp4_ref.py, Triton interpreter).

m2serve's paths: ``Linear`` with ``input_quant`` (a quantised linear outside the experts), the
packed-weight product (``quantize_activations`` then kernels ``grouped_linear``, the C++ kernels when
built), and the FP4 x FP4 kernels the experts take on CPU (``cpu_w4a4_grouped_linear``, which
quantise the input themselves; docs/checkpoints.md §9.1), on every path this CPU has. The bound:
|Σ fp32 − Σ exact| <= 2·K·2^-24·Σ|x'·w| (docs/model.md §6 style).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from m2serve.formats.act_quant import ActivationScheme, quantize_activations
from m2serve.formats.fp4 import FP4Scheme, PackedFP4
from m2serve.kernels import build
from m2serve.kernels.ops import PackedWeights, cpu_w4a4_grouped_linear, grouped_linear, w4a4_path
from m2serve.model.linear import Linear

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import (
        dequantize_fp4_fp6_per_group,
        real_quantize_fp4_fp6_per_group,
    )
    from quark.torch.quantization.config.config import OCP_MXFP4Spec
    from quark.torch.quantization.observer.observer import PerBlockMXObserver
    from quark.torch.quantization.tensor_quantize import DynamicScaledFakeQuantize
    from quark.torch.utils.numerics import to_e8m0_uint8
    from quark.torch.utils.pack import Pack_fp4

N, K, R = 96, 512, 9
INPUT_AMAX = 40.0  # NVFP4: the calibrated input amax (input_scale = amax / (6 * 448))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R, K, generator=g) * torch.exp2(torch.randint(-3, 4, (R, 1), generator=g).float())
    w = torch.randn(N, K, generator=g) * 0.05
    return x, w


def _mxfp4(x: torch.Tensor, w: torch.Tensor):
    obs = PerBlockMXObserver(OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec())
    obs(w)
    scale, _ = obs.calculate_qparams()
    q = real_quantize_fp4_fp6_per_group(w, scale, axis=-1, group_size=32, quant_dtype="fp4")
    codes = Pack_fp4("per_group", "fp4").pack(q, reorder=False)
    packed = PackedFP4(FP4Scheme.MXFP4, codes, to_e8m0_uint8(scale))
    w_ref = dequantize_fp4_fp6_per_group(q, scale, axis=-1, group_size=32)
    fq = DynamicScaledFakeQuantize(OCP_MXFP4Spec(ch_axis=-1, is_dynamic=True).to_quantization_spec())
    return packed, w_ref, fq(x), None


def _nvfp4(x: torch.Tensor, w: torch.Tensor, tmp: Path):
    qt, ws, ws2 = NVFP4QTensor.quantize(w, 16)
    packed = PackedFP4(FP4Scheme.NVFP4_MODELOPT, qt._quantized_data, ws, ws2.float())
    w_ref = qt.dequantize(dtype=torch.float32, scale=ws, double_scale=ws2, block_sizes={-1: 16})
    torch.save({"x": {"float32": x}, "amax": [INPUT_AMAX]}, tmp / "in.pt")
    script = Path(__file__).resolve().parents[1] / "formats" / "modelopt_nvfp4_ref.py"
    subprocess.run([sys.executable, str(script), str(tmp / "in.pt"), str(tmp / "out.pt")], check=True,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    x_ref = torch.load(tmp / "out.pt")[("float32", INPUT_AMAX)]
    return packed, w_ref, x_ref, torch.tensor(INPUT_AMAX) / (6.0 * 448.0)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_w4a4_linear_matches_library_reference(fmt, tmp_path):
    x, w = _inputs()
    packed, w_ref, x_ref, input_scale = _mxfp4(x, w) if fmt == "mxfp4" else _nvfp4(x, w, tmp_path)
    scheme = ActivationScheme.MXFP4 if fmt == "mxfp4" else ActivationScheme.NVFP4
    want = (x_ref.double() @ w_ref.double().T)
    bound = 2 * K * 2.0**-24 * (x_ref.double().abs() @ w_ref.double().abs().T) + 1e-30

    lin = Linear(K, N, torch.float32)
    lin.load("w", packed.dequantize(torch.float32))
    lin.input_quant = (scheme, input_scale)
    offsets = torch.tensor([R], dtype=torch.int32)
    xq = quantize_activations(x, scheme, input_scale)
    stacked = PackedWeights.stack([packed])
    grouped = grouped_linear(xq, offsets, stacked)
    act = None if input_scale is None else input_scale.reshape(1).float()
    w4a4 = [cpu_w4a4_grouped_linear(x, offsets, stacked, w4a4_path(build.select_backend(isa).isa), act)
            for isa in build.supported_isas()]
    assert w4a4  # the kernels are built on this machine (scalar at least)
    for got in (lin(x), grouped, *w4a4):
        err = (got.double() - want).abs()
        assert bool((err <= bound).all()), f"{fmt}: max excess {(err - bound).max():.3g}"
    # and the input quantisation matters: the unquantised product is outside the bound
    w16 = (F.linear(x, w_ref).double() - want).abs()
    assert bool((w16 > bound).any())


@pytest.mark.parametrize("scheme", list(ActivationScheme))
def test_grouped_experts_quantise_each_row_with_its_experts_scale(scheme):
    # docs/checkpoints.md §9: the grouped expert path (rows sorted by expert, offsets) quantises every row's
    # w13 input and w2 input with ITS expert's input scale (NVFP4; found on the device), as a plain
    # per-expert computation does: qdq(x) -> w13 -> SwiGLU -> qdq -> w2 (rows past offsets[-1] skipped)
    from m2serve.formats.act_quant import qdq_mxfp4, qdq_nvfp4, qdq_nvfp4_ct
    from m2serve.model.experts import MiniMaxM2Experts

    E, H, I = 4, 64, 32
    g = torch.Generator().manual_seed(5)
    ex = MiniMaxM2Experts(H, I, start=0, num_local=E, dtype=torch.float32)
    ex.w13.data.copy_(torch.randn(E, 2 * I, H, generator=g) * 0.1)
    ex.w2.data.copy_(torch.randn(E, H, I, generator=g) * 0.1)
    s13, s2 = torch.tensor([0.01, 0.002, 0.05, 0.0005]), torch.tensor([0.003, 0.04, 0.0007, 0.02])
    names = {f"experts.{e}.{w}.weight": float(s) for e in range(E)
             for w, s in (("w1", s13[e]), ("w3", s13[e]), ("w2", s2[e]))}
    ex.set_activation_quant(scheme, names)
    x = torch.randn(11, H, generator=g)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 gets no rows; row 10 is not held
    got = ex.grouped_rows(x, offsets)

    def q(t, e, which):
        if scheme is ActivationScheme.MXFP4:
            return qdq_mxfp4(t)
        if scheme is ActivationScheme.NVFP4_CT:  # the table holds global scales then
            return qdq_nvfp4_ct(t, (s13 if which == 0 else s2)[e])
        return qdq_nvfp4(t, (s13 if which == 0 else s2)[e])

    start = 0
    for e, end in enumerate(offsets.tolist()):
        rows = x[start:end]
        gate, up = F.linear(q(rows, e, 0), ex.w13[e]).chunk(2, dim=-1)
        want = F.linear(q(F.silu(gate) * up, e, 1), ex.w2[e])
        torch.testing.assert_close(got[start:end], want, rtol=1e-5, atol=1e-6)
        start = end
    ids = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3, 3])
    torch.testing.assert_close(ex.rows_loop(x[:10], ids), got[:10], rtol=1e-5, atol=1e-6)
