"""Where the kernels' GEMV path stops (docs/kernels.md §6 "Where the GEMV stops"): past
``GEMV_ROWS`` (16) rows a bf16 linear runs ``F.linear`` and an expert decodes tiles for ``at::mm``;
for bf16 weights with bf16 activations on a CPU whose oneDNN runs AMX-BF16 tiles the limit is
``GEMV_ROWS_AMX`` (4).
The limit is part of the backend (chosen once per process) and of each module's KernelChoice,
never asked per call.

Observed independently of the code under test: the AMX probe against the kernel's own CPU flags
(``/proc/cpuinfo``, which Linux clears when it does not enable AMX state) and against the GEMM
oneDNN itself reports running (``ONEDNN_VERBOSE``) under its ISA caps; which GEMM runs by a
dispatch mode (ops called from Python) and the profiler (``aten::mm`` called inside the C++ op);
the values against ``F.linear`` on the weights dequantised by formats/ (the spec formula).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from m2serve.formats.fp8 import PackedFP8
from m2serve.kernels import build
from m2serve.kernels import ops as ops_mod
from m2serve.kernels.build import GEMV_ROWS, GEMV_ROWS_AMX, GEMV_ROWS_ENV, KernelBackend, kernel_backend
from m2serve.kernels.choice import LinearImpl, choose_impl
from m2serve.kernels.ops import PackedWeights, WeightFormat, cpu_grouped_linear, cpu_linear
from m2serve.model.kernel_choice import choose_kernels
from m2serve.model.load import load_model

GEMM_OPS = ("aten.mm", "aten.addmm", "aten.linear")


class OpNames(TorchDispatchMode):
    """Records the name of every aten op dispatched from Python while active."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_row_limit_rule(monkeypatch):
    monkeypatch.delenv(GEMV_ROWS_ENV, raising=False)
    assert (build.bf16_gemv_rows(amx=True), build.bf16_gemv_rows(amx=False)) == (4, 16)
    monkeypatch.setenv(GEMV_ROWS_ENV, "8")
    assert build.bf16_gemv_rows(amx=True) == build.bf16_gemv_rows(amx=False) == 8
    for bad in ("0", "four", "-2"):
        monkeypatch.setenv(GEMV_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=rf"{GEMV_ROWS_ENV}='{bad}': use a positive integer"):
            build.bf16_gemv_rows()
    # fp32 activations and packed formats keep 16 whatever the bf16 limit (AMX has no fp32 tiles; a
    # packed weight's tile decode costs more than the tiles save)
    backend = KernelBackend("cpu-avx512", build.ISA_CODES["avx512"], "test", bf16_gemv_rows=GEMV_ROWS_AMX)
    assert backend.gemv_rows(True, torch.bfloat16) == 4
    assert backend.gemv_rows(True, torch.float32) == GEMV_ROWS == 16
    assert backend.gemv_rows(False, torch.bfloat16) == GEMV_ROWS
    assert "bf16 GEMV up to 4 rows" in backend.banner()
    # the process's backend takes its limit from the rule, env override included
    monkeypatch.delenv(GEMV_ROWS_ENV, raising=False)
    assert build.select_backend("").bf16_gemv_rows == build.bf16_gemv_rows()
    monkeypatch.setenv(GEMV_ROWS_ENV, "7")
    assert build.select_backend("").bf16_gemv_rows == 7


def test_amx_probe_follows_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    cpuinfo = Path("/proc/cpuinfo")  # Linux, as this machine and CI
    flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split()
    assert build.amx_bf16_usable() == ("amx_bf16" in flags and torch.backends.mkldnn.is_available())
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": False})
    assert build.amx_bf16_usable() is False  # the probe reads the CPUID answer, not a constant


def test_onednn_isa_cap_names():
    assert build.onednn_isa_allows_amx({})
    assert build.onednn_isa_allows_amx({"ONEDNN_MAX_CPU_ISA": "all"})
    assert build.onednn_isa_allows_amx({"ONEDNN_MAX_CPU_ISA": "AVX10_1_512_AMX_FP16"})
    assert not build.onednn_isa_allows_amx({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"})
    assert not build.onednn_isa_allows_amx({"DNNL_MAX_CPU_ISA": "AVX2"})


_ONEDNN_PROBE = """
import torch, torch.nn.functional as F
from m2serve.kernels.build import amx_bf16_usable
F.linear(torch.ones(64, 512, dtype=torch.bfloat16), torch.ones(512, 512, dtype=torch.bfloat16))
print("usable", amx_bf16_usable())
"""


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["", "AVX512_CORE_BF16", "AVX512_CORE_AMX"])
def test_amx_probe_agrees_with_the_gemm_onednn_runs(cap):
    """oneDNN's verbose log names the ISA of the matmul it ran (``brg_matmul:avx10_1_512_amx`` or
    ``brg_matmul:avx512_core_bf16``): the probe says AMX exactly when that name does, with oneDNN's ISA
    capped or not (on a CPU without AMX both say no under every cap)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "ONEDNN_MAX_CPU_ISA": cap, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    matmuls = [line.split(",")[6] for line in out.splitlines() if ",exec,cpu,matmul," in line]
    assert matmuls, out[-2000:]  # the bf16 F.linear ran through oneDNN
    usable = out.strip().splitlines()[-1] == "usable True"
    assert usable == ("amx" in matmuls[0]), (cap, matmuls, usable)


def test_each_choice_carries_the_limit_of_its_format_and_dtype():
    amx = KernelBackend("cpu-avx512", build.ISA_CODES["avx512"], "test", bf16_gemv_rows=4)
    for fmt, grouped in ((WeightFormat.BF16, False), (WeightFormat.BF16, True),
                         (WeightFormat.FP8_BLOCK, False), (WeightFormat.MXFP4, True),
                         (WeightFormat.NVFP4_MODELOPT, True)):
        bf16 = choose_impl("cpu", fmt, torch.bfloat16, amx, grouped=grouped)
        fp32 = choose_impl("cpu", fmt, torch.float32, amx, grouped=grouped)
        assert bf16.impl is fp32.impl is LinearImpl.CPU_PACKED
        # only a bf16 weight (read by at::mm as it is) with bf16 activations gets the AMX limit
        assert (bf16.gemv_rows, fp32.gemv_rows) == ((4 if fmt is WeightFormat.BF16 else 16), 16)


def _needs_kernels() -> int:
    backend = kernel_backend()
    assert backend.available, backend.banner()  # this machine and CI build the kernels
    return backend.isa


def test_bf16_linear_past_the_limit_runs_f_linear():
    isa = _needs_kernels()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    packed = PackedWeights(WeightFormat.BF16, w[None])
    want = F.linear(x.float(), w.float())
    with OpNames() as past:
        y_past = cpu_linear(x, packed, isa, gemv_rows=4)
    with OpNames() as within:
        y_within = cpu_linear(x, packed, isa, gemv_rows=16)
    assert any(n in GEMM_OPS for n in past.names), past.names
    assert not any(n in GEMM_OPS for n in within.names) and "m2serve_kernels.grouped_linear" in within.names
    torch.testing.assert_close(y_past, F.linear(x, w), rtol=0, atol=0)  # it is F.linear
    for y in (y_past, y_within):  # both within bf16 rounding of the exact fp32 products
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)


def test_expert_past_the_limit_runs_at_mm_inside_the_op():
    isa = _needs_kernels()
    g = torch.Generator().manual_seed(1)
    experts = [PackedFP8((torch.randn(128, 256, generator=g) * 64).to(torch.float8_e4m3fn),
                         torch.rand(1, 2, generator=g) * 1e-3 + 1e-4) for _ in range(3)]
    w = PackedWeights.stack(experts)
    offsets = torch.tensor([2, 7, 9], dtype=torch.int32)  # 2, 5 and 2 rows
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    want = ops_mod.torch_grouped_linear(x.float(), offsets, w)  # fp32 products of the formula's weights
    for rows, mm in ((4, True), (16, False)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = cpu_grouped_linear(x, offsets, w, isa, gemv_rows=rows)
        names = {e.name for e in prof.events()}
        assert ("aten::mm" in names) is mm, (rows, sorted(names))
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_at_mm_tiles_cover_every_output_column(dtype):
    """The at::mm path in tiles of ``mm_tile_n`` weight rows (the whole expert, or 48 + 48 + 32, or
    7-row tiles), one call after another through the op's kept tile buffer (large, then smaller):
    every output column equals dequantise-then-F.linear (formats/, the spec formula) up to the
    summation order, and the rows past offsets[-1] stay 0."""
    isa = _needs_kernels()
    g = torch.Generator().manual_seed(2)
    experts = [PackedFP8((torch.randn(128, 256, generator=g) * 64).to(torch.float8_e4m3fn),
                         torch.rand(1, 2, generator=g) * 1e-3 + 1e-4) for _ in range(3)]
    w = PackedWeights.stack(experts)
    offsets = torch.tensor([6, 6, 15], dtype=torch.int32)  # 6, 0 and 9 rows: both past the limit of 4
    x = torch.randn(17, 256, generator=g).to(dtype)
    want = ops_mod.torch_grouped_linear(x.float(), offsets, w)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=1e-2, atol=2e-2)
    for mm_tile_n in (4096, 128, 48, 7):
        y = torch.ops.m2serve_kernels.grouped_linear(
            x, offsets, w.q, w.scale, w.scale_2, int(w.fmt), w.block_n, w.block_k, isa, ops_mod.TILE_N, 4,
            mm_tile_n)
        assert y.dtype is dtype and y.shape == (17, 128)
        torch.testing.assert_close(y.float(), want, **tol, msg=lambda m, t=mm_tile_n: f"mm_tile_n {t}: {m}")
        assert not y[15:].any()


def test_modules_pass_their_choice_to_the_kernels(tiny_random_dir, monkeypatch):
    _needs_kernels()
    model = load_model(tiny_random_dir, dtype=torch.bfloat16)
    choose_kernels(model, dataclasses.replace(kernel_backend(), bf16_gemv_rows=3))
    seen: list[int] = []
    real = ops_mod.cpu_grouped_linear
    import m2serve.model.experts as experts_mod

    def spy(*a):
        seen.append(a[5])
        return real(*a)

    monkeypatch.setattr(ops_mod, "cpu_grouped_linear", spy)
    monkeypatch.setattr(experts_mod, "cpu_grouped_linear", spy)
    cfg = model.config
    x = torch.randn(2, cfg.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        for module in model.modules():
            choice = getattr(module, "choice", None)
            if choice is not None and choice.impl is LinearImpl.CPU_PACKED:
                assert choice.gemv_rows == 3
        model.model.layers[0].self_attn.q_proj(x)  # a linear: its choice's limit reaches the op
        assert seen == [3]
        model.model.layers[0].block_sparse_moe(x)  # the experts: w13 and w2, both with the limit
    assert len(seen) >= 3 and set(seen) == {3}, seen
