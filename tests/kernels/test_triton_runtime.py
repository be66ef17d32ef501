"""The Triton package sets up the interpreter on a machine without CUDA before any kernel is
defined, keeps an explicit TRITON_INTERPRET, and picks the compute dtype (docs/kernels.md §1).
The interpreter runs a K = 8 ``tl.dot`` that sm_90 compilation refuses (test_triton_compile.py),
which is why both checks exist."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path: Path, **env_over: str) -> str:
    script = tmp_path / "check.py"  # @triton.jit needs its source in a file
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    env.update(env_over)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_without_cuda_the_package_selects_the_interpreter_and_a_kernel_runs_on_cpu(tmp_path):
    out = _run("""
        import os
        import torch
        import triton
        import triton.language as tl
        assert "TRITON_INTERPRET" not in os.environ
        import m2serve.kernels.triton  # sets it before the kernel below is defined
        from m2serve.kernels.triton.runtime import compute_dtype, interpreted

        @triton.jit
        def twice(x, y, n, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
            i = tl.arange(0, BLOCK)
            v = tl.load(x + i, mask=i < n).to(COMPUTE)
            tl.store(y + i, (v * 2).to(y.dtype.element_ty), mask=i < n)

        @triton.jit
        def mm(a, b, c, K: tl.constexpr):  # a K = 8 dot: sm_90 compilation refuses it (compile test)
            i = tl.arange(0, 16)
            k = tl.arange(0, K)
            x = tl.load(a + i[:, None] * K + k[None, :])
            y = tl.load(b + k[:, None] * 16 + i[None, :])
            tl.store(c + i[:, None] * 16 + i[None, :], tl.dot(x, y))

        x = torch.arange(5, dtype=torch.float32)
        y = torch.zeros(5)
        twice[(1,)](x, y, 5, BLOCK=8, COMPUTE=compute_dtype(torch.bfloat16))
        a, b, c = torch.randn(16, 8), torch.randn(8, 16), torch.zeros(16, 16)
        mm[(1,)](a, b, c, K=8)
        ran = bool(torch.allclose(c, a @ b, atol=1e-5))
        print(os.environ["TRITON_INTERPRET"], interpreted(), compute_dtype(torch.bfloat16), y.tolist(), ran)
    """, tmp_path)
    assert out == "1 True fp32 [0.0, 2.0, 4.0, 6.0, 8.0] True"


def test_an_explicit_setting_is_kept_and_gives_the_real_compute_dtype(tmp_path):
    out = _run("""
        import os
        import m2serve.kernels.triton
        from m2serve.kernels.triton.runtime import compute_dtype, interpreted
        import torch
        print(os.environ["TRITON_INTERPRET"], interpreted(), compute_dtype(torch.bfloat16))
    """, tmp_path, TRITON_INTERPRET="0")
    assert out == "0 False bf16"


def test_fp8_is_not_a_compute_dtype_and_unknown_dtypes_are_named():
    from m2serve.kernels.triton.runtime import compute_dtype, tl_dtype

    with pytest.raises(ValueError, match="fp8 is a storage dtype"):
        compute_dtype(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="torch.int8"):
        tl_dtype(torch.int8)
