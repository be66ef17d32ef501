"""Every registered Triton kernel variant compiles for sm_90 ahead of time, without a GPU
(docs/kernels.md §2), and the check can fail: Triton 3.6 refuses a K = 8 ``tl.dot`` that its
interpreter runs.

Compiling needs ``@triton.jit`` functions, so each check runs in a subprocess started with
``TRITON_INTERPRET=0`` and a fresh Triton cache (a cached cubin would not prove this Triton
compiles the source).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path: Path) -> dict:
    script = tmp_path / "check.py"  # @triton.jit needs its source in a file
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_registered_variant_compiles_for_sm90(tmp_path):
    res = _run("""
        import json
        from m2serve.kernels.triton.aot import KERNEL_MODULES, all_variants, compile_sm90
        out = {}
        for v in all_variants():
            k = compile_sm90(v)
            out[v.name] = {"cubin": len(k.asm["cubin"]), "arch": k.metadata.target.arch,
                           "shared": k.metadata.shared, "module": v.fn.__module__}
        print(json.dumps({"modules": list(KERNEL_MODULES), "variants": out}))
    """, tmp_path)
    for name, v in res["variants"].items():
        assert v["cubin"] > 0 and v["arch"] == 90, name
        assert v["shared"] <= 227 * 1024, (name, v["shared"])  # sm_90's shared memory per block
    # every kernel module registered at least one variant
    assert {v["module"] for v in res["variants"].values()} == set(res["modules"])


def test_compile_refuses_what_the_interpreter_accepts_and_register_checks_signatures(tmp_path):
    res = _run("""
        import json
        import triton
        import triton.language as tl
        from m2serve.kernels.triton.aot import Variant, compile_sm90, register

        @triton.jit
        def mm(a, b, c, K: tl.constexpr):
            i = tl.arange(0, 16)
            k = tl.arange(0, K)
            x = tl.load(a + i[:, None] * K + k[None, :])
            y = tl.load(b + k[:, None] * 16 + i[None, :])
            tl.store(c + i[:, None] * 16 + i[None, :], tl.dot(x, y))

        sig = {"a": "*fp32", "b": "*fp32", "c": "*fp32", "K": "constexpr"}
        out = {}
        for K in (16, 8):
            try:
                compile_sm90(Variant(f"mm/k{K}", mm, sig, {"K": K}))
                out[K] = "ok"
            except Exception as e:
                out[K] = type(e).__name__
        errors = []
        for bad in (Variant("x", mm, {"a": "*fp32", "b": "*fp32", "K": "constexpr"}, {"K": 16}),
                    Variant("y", mm, sig, {})):
            try:
                register(bad)
            except ValueError as e:
                errors.append(str(e))
        print(json.dumps({"compiled": out, "errors": errors}))
    """, tmp_path)
    assert res["compiled"] == {"16": "ok", "8": "CompilationError"}
    assert "kernel parameters are ['a', 'b', 'c', 'K']" in res["errors"][0]
    assert "constexprs ['K'] have no value" in res["errors"][1]
