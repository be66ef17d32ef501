"""W4A4 activation quantisation bit for bit against the reference libraries' own functions (issue 33).

docs/checkpoints.md §9. References, run on CPU:

- MXFP4: amd-quark's ``DynamicScaledFakeQuantize`` built from ``OCP_MXFP4Spec(is_dynamic=True)`` (the
  module Quark puts on a linear's input for the MXFP4 release's ``input_tensors``). fp32 inputs take
  its ``forward``; bf16 inputs take its ``fake_quantize`` (observer + ``scaled_fake_quantize``, CPU
  kernel), because the fused bf16 route (``kernel_ext.qdq_mxfp4``) is implemented on CUDA only.
- NVFP4 (compressed-tensors checkpoints): compressed-tensors' own ``forward_quantize`` of a linear's
  input under the ``NVFP4`` preset scheme's ``input_activations`` (dynamic ``tensor_group``, group 16,
  e4m3 scales) with the module's ``input_global_scale``, on CPU.
- NVFP4: nvidia-modelopt's ``fp4_fake_quant_block`` (the dynamic-block NVFP4 input quantiser of
  ``mtq.NVFP4_DEFAULT_CFG`` on Hopper and later), a Triton kernel, run here by the Triton
  interpreter in a separate process (modelopt_nvfp4_ref.py). Two interpreter casts are not the
  GPU's: float32 -> float8e4nv rounds ties up and drops subnormals, float32 -> bfloat16 truncates
  (PTX ``cvt.rn`` rounds to nearest even in both). The script replaces exactly those two casts by
  torch's round-to-nearest-even ones; every other operation is modelopt's kernel as written.
  ``torch.cuda.device`` (its launch guard) becomes a no-op. Not run on a GPU.

Equality is bitwise (int views: -0 and +0 differ, NaN payloads compared as NaN positions).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from m2serve.formats.act_quant import (
    ActivationScheme,
    mxfp4_scale,
    qdq_mxfp4,
    qdq_nvfp4,
    qdq_nvfp4_ct,
    quantize_activations,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from quark.torch.quantization.config.config import OCP_MXFP4Spec
    from quark.torch.quantization.tensor_quantize import DynamicScaledFakeQuantize

K = 256
GRID = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 5.5,  # ties
        6.5, 7.0, 7.9, 0.1, 0.3, 2.2, 4.5, 5.01, 4.99, 0.2499, 0.7501, 1.2501, 1.7499, 2.4999, 3.5001, 6.0]


def inputs() -> torch.Tensor:
    """[R, K] fp32: random rows over 40 binades; the E2M1 grid, its rounding ties and values past 6
    at scales 2^-130 .. 2^127 (both signs); zeros, -0, all-equal groups, inf, NaN, huge, subnormal."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(64, K, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    grid = torch.tensor(GRID)
    ties = [torch.cat([grid] * (K // len(GRID))) * sgn * 2.0 ** k
            for k in (-130, -126, -20, 0, 20, 100, 126, 127) for sgn in (1, -1)]
    sp = torch.zeros(8, K)
    sp[1] = -0.0
    sp[2] = 3.0                                   # all-equal groups
    sp[3] = 1.7
    sp[3, 5] = float("inf")                       # one inf in a group
    sp[4] = 1.0
    sp[4, 7] = float("nan")                       # one NaN in a group
    sp[5] = 3.4e38                                # huge (amax rounds past fp32 max)
    sp[5, ::3] = 1.0
    sp[6] = 1e-40                                 # subnormal
    sp[6, ::2] = -2e-45
    sp[7] = -float("inf")
    sp[7, ::2] = 1e-3
    return torch.cat([rand, torch.stack(ties), sp])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_bit_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    nan = ref.isnan()
    assert torch.equal(ours.isnan(), nan)
    diff = (bits(ours) != bits(ref)) & ~nan
    assert not bool(diff.any()), f"{int(diff.sum())} differ, first at {diff.nonzero()[0].tolist()}"


# ---- MXFP4: amd-quark ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quark_input_quantizer():
    return DynamicScaledFakeQuantize(OCP_MXFP4Spec(ch_axis=-1, is_dynamic=True).to_quantization_spec())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_quark(dtype, quark_input_quantizer):  # docs/checkpoints.md §9 MXFP4
    x = inputs().to(dtype)
    fq = quark_input_quantizer
    ref = fq(x) if dtype == torch.float32 else fq.fake_quantize(x)
    assert_bit_equal(qdq_mxfp4(x), ref)
    assert_bit_equal(quantize_activations(x, ActivationScheme.MXFP4), ref)


def test_mxfp4_special_groups_as_quark(quark_input_quantizer):  # docs/checkpoints.md §9: say what happens
    x = inputs()
    y = qdq_mxfp4(x)
    sp = y[-8:]
    assert not bool(torch.signbit(sp[1]).any()) and bool((sp[1] == 0).all())  # -0 -> +0
    assert bool((sp[2] == 3.0).all())                                          # all-equal: exact
    assert sp[3, 5] == float("inf") and bool((sp[3, :32][torch.arange(32) != 5] == 0).all())  # inf group
    assert bool(sp[4, :32].isnan().all()) and bool((sp[4, 32:] == 1.0).all())   # NaN: its group NaN
    # the scale rule at its edges: 0 and subnormal -> 2^-127, inf / past-max -> 2^127
    amax = torch.tensor([0.0, 1e-40, 6.0, 7.0, 3.4e38, float("inf"), 1.75, 1.7499999])
    want = torch.tensor([2.0**-127, 2.0**-127, 1.0, 2.0, 2.0**127, 2.0**127, 0.5, 0.25])
    assert torch.equal(mxfp4_scale(amax), want)
    assert bool(mxfp4_scale(torch.tensor([float("nan")])).isnan().all())


def test_width_not_multiple_of_group_names_it():
    with pytest.raises(ValueError, match=r"activation width 48 is not a multiple of the FP4 group size 32"):
        qdq_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match=r"NVFP4 activation quantisation needs the linear's input_scale"):
        quantize_activations(torch.zeros(2, 32), ActivationScheme.NVFP4)
    x = torch.randn(3, 64)
    assert quantize_activations(x, None) is x


# ---- NVFP4: nvidia-modelopt ---------------------------------------------------------------------

AMAXES = [2.0**-30 * 2688, 0.0123, 1.0, 2688.0, 2.0**20]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def modelopt_reference(tmp_path_factory):
    """{(dtype name, global amax): modelopt's fake-quantised inputs()}, computed by
    modelopt_nvfp4_ref.py in its own process (the interpreter must be on before triton loads)."""
    d = tmp_path_factory.mktemp("modelopt")
    torch.save({"x": {n: inputs().to(dt) for n, dt in DTYPES.items()}, "amax": AMAXES}, d / "in.pt")
    script = Path(__file__).with_name("modelopt_nvfp4_ref.py")
    subprocess.run([sys.executable, str(script), str(d / "in.pt"), str(d / "out.pt")], check=True,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    return torch.load(d / "out.pt")


# global amax of the calibrated input (input_scale = amax / (6 * 448), what ModelOpt exports)
@pytest.mark.slow
@pytest.mark.parametrize("amax", AMAXES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nvfp4_matches_modelopt(amax, dtype, modelopt_reference):  # docs/checkpoints.md §9 NVFP4
    x = inputs().to(DTYPES[dtype])
    ref = modelopt_reference[(dtype, amax)]
    input_scale = torch.tensor(amax).float() / (6.0 * 448.0)
    assert_bit_equal(qdq_nvfp4(x, input_scale), ref)
    # one input scale per row (each row's expert) gives the same values row by row
    per_row = input_scale.expand(x.shape[0], 1)
    assert_bit_equal(quantize_activations(x, ActivationScheme.NVFP4, per_row), ref)


def test_nvfp4_special_groups():  # docs/checkpoints.md §9: say what happens
    x = inputs()[-8:]
    s = torch.tensor(1.0 / 2688)
    y = qdq_nvfp4(x, s)
    assert not bool(torch.signbit(y[1]).any())            # -0 -> +0
    assert bool((y[2] == y[2, 0]).all())                  # all-equal groups stay all-equal
    assert bool(y[4, 7].isfinite()) and y[4, 7] < 0       # NaN -> a negative full-scale value
    assert not bool(y[4].isnan().any()) and bool((y[4, 16:] == y[4, 16]).all())


# ---- NVFP4, compressed-tensors rules: compressed-tensors' own function ---------------------------

def _ct_reference(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """compressed-tensors' input fake quantisation of x for a linear with ``input_global_scale``."""
    from compressed_tensors.quantization import QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    module = torch.nn.Linear(x.shape[-1], 1)
    module.quantization_status = QuantizationStatus.FROZEN
    module.input_global_scale = torch.nn.Parameter(torch.tensor([global_scale]), requires_grad=False)
    return forward_quantize(module, x, "input", preset_name_to_scheme("NVFP4", ["Linear"]).input_activations)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amax", [40.0, 3.0, 1e4])  # the calibrated input amax: global = 448·6 / amax
def test_nvfp4_ct_matches_compressed_tensors(amax, dtype):  # docs/checkpoints.md §9 NVFP4 (c-t)
    x = inputs().to(dtype)
    gs = 448.0 * 6.0 / amax
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _ct_reference(x, gs)
    assert_bit_equal(qdq_nvfp4_ct(x, torch.tensor(gs)), ref)
    assert_bit_equal(quantize_activations(x, ActivationScheme.NVFP4_CT, torch.tensor(gs)), ref)
    # per row (each row its expert's global scale), as the grouped experts call it
    rows = x[:4]
    per_row = torch.tensor([[gs], [gs / 3], [gs * 5], [gs]])
    want = torch.cat([_ct_reference(r[None], float(v)) for r, v in zip(rows, per_row[:, 0])])
    assert_bit_equal(qdq_nvfp4_ct(rows, per_row), want)


def test_nvfp4_ct_and_modelopt_rules_differ():  # docs/checkpoints.md §9: why the two NVFP4 functions
    # the same calibration under both rules: compressed-tensors divides by the global scale where
    # ModelOpt multiplies by its reciprocal (and floors zero scales differently), so some elements
    # differ in their last bits; a checkpoint is quantised with its own library's rules
    x = inputs()[:64]
    gs = torch.tensor(448.0 * 6.0 / 40.0)
    ct, mo = qdq_nvfp4_ct(x, gs), qdq_nvfp4(x, 1.0 / gs)
    differ = ct != mo
    assert bool(differ.any())
    assert float(((ct - mo).abs() / mo.abs().clamp_min(1e-30))[differ].max()) < 2.0**-20
