"""benchmarks/gpu_check.py (issue 17 item 5) runs without a GPU: it imports only the model
layers, exits cleanly with a message, and its CPU-runnable parts (--cpu-smoke) work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from m2serve.checkpoints.tiny_random import TINY_DIMS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(*args: str, out: Path | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    if out is not None:
        env["OUT"] = str(out)
    cmd = [sys.executable, "-c", code] if code else [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.slow  # runs the script in a subprocess
def test_imports_nothing_above_the_model_and_exits_cleanly_without_cuda():
    code = (f"import runpy, sys; sys.argv = ['gpu_check']; sys.path.insert(0, {str(SCRIPT.parent)!r});"
            "import gpu_check; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pydantic', 'fastapi', 'tokenizers', 'transformers') or m.startswith(('m2serve.serve', "
            "'m2serve.engine', 'm2serve.text', 'm2serve.parallel', 'm2serve.checkpoints'))); print(bad)")
    r = _run(code=code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    r = _run()
    assert r.returncode == 0 and "no CUDA device" in r.stdout, (r.stdout, r.stderr)


@pytest.mark.slow  # runs the script in a subprocess
def test_cpu_smoke_checks_logits_counts_no_read_backs_and_writes_json(tmp_path):
    r = _run("--cpu-smoke", out=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["ok"] and res["device"] == "cpu"
    fp32 = res["logits_tiny"]["fp32"]
    assert fp32["rows_within"] == 1.0 and fp32["max_abs_diff"] == 0.0  # same device, same path
    assert res["syncs"]["read_back_ops"] == [] and res["syncs"]["dispatched_ops"] > 0
    assert set(res["speed_bf16"]) >= {"decode_b1_tok_s", "decode_b4_tok_s", "legacy_decode_b4_tok_s"}


def _assert_imports_no_server_stack(*modules: str) -> None:
    """Importing gpu_check and ``modules`` pulls in no server stack (the GPU image has torch, triton
    and transformers only)."""
    code = (f"import sys; sys.argv = ['gpu_check']; sys.path.insert(0, {str(SCRIPT.parent)!r});"
            f"import gpu_check, {', '.join(modules)}; bad = sorted(m for m in "
            "sys.modules if m.split('.')[0] in ('pydantic', 'fastapi', 'llguidance', 'tokenizers', "
            "'transformers') or m.startswith(('m2serve.serve', 'm2serve.engine', 'm2serve.text', "
            "'m2serve.parallel', 'm2serve.checkpoints'))); print(bad)")
    r = _run(code=code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.slow
def test_attention_part_imports_no_server_stack_and_its_cpu_smoke_runs_under_the_interpreter(tmp_path):
    # --part attention (issue 28 item 5): the GPU image has torch, triton and transformers only
    _assert_imports_no_server_stack("gpu_attention", "m2serve.kernels.triton.attention")
    r = _run("--part", "attention", "--cpu-smoke", out=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "gpu_check_attention.json").read_text())
    assert res["ok"] and res["device"] == "cpu" and res["copy_rate_gb_s"] > 0
    assert set(res["correctness"]) == {"mixed page16", "mixed fp8 page16", "decode split4"}
    for c in res["correctness"].values():  # bf16 outputs within a bf16 ulp or two of fp32 attend
        assert c["kernel_max_abs_diff"] <= 2**-6 * c["max_abs_ref"], c
    for d in res["decode"].values():
        assert d["bound_ms"] > 0 and d["kernel_over_bound"] == d["kernel_ms"] / d["bound_ms"]


@pytest.mark.slow
def test_weights_part_cpu_smoke(tmp_path):
    # --part weights on tiny dims: the Triton FP8 linear under the interpreter vs the fp32
    # reference, decode of the bf16 and FP8 models, and a synthetic FP8 checkpoint's load
    r = _run("--part", "weights", "--cpu-smoke", out=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "gpu_check_weights.json").read_text())
    assert res["ok"] and res["device"] == "cpu"
    assert all(v["w8a16"]["rel_vs_ref"] <= 1e-5 for v in res["fp8_linear"].values())  # fp32 compute
    assert set(res["decode"]) == {"bf16", "fp8_w8a16", "fp8_w8a8"}
    assert res["decode"]["fp8_w8a16"]["resident_gib"] < res["decode"]["bf16"]["resident_gib"]
    assert res["load"]["host_dequantisations"] == 0 and "FP8_BLOCK" in res["load"]["kernels"]


def test_dims_are_the_tiny_random_and_bench_dims():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import forward
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert {k: v for k, v in gpu_check.TINY.items() if k != "vocab_size"} == TINY_DIMS
    assert {k: v for k, v in gpu_check.BENCH.items() if k != "max_position_embeddings"} == forward.BENCH_DIMS


@pytest.mark.slow
def test_engine_part_cpu_smoke_times_decode_against_the_bound(tmp_path):
    # --part engine (issue 29 item 4): eager decode steps built into the persistent buffers; no
    # graphs on CPU (the GPU run adds graph_tok_s), each figure next to its bandwidth bound
    r = _run("--part", "engine", "--cpu-smoke", out=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "gpu_check_engine.json").read_text())
    assert res["device"] == "cpu" and res["attention_backend"] == "torch" and res["copy_rate_gb_s"] > 0
    assert set(res["decode"]) == {"b1", "b4"}
    for d in res["decode"].values():
        assert d["eager_tok_s"] > 0 and d["eager_over_bound"] == d["eager_tok_s"] / d["bound_tok_s"]
        assert "graph_tok_s" not in d


@pytest.mark.slow
def test_moe_part_imports_no_server_stack_and_its_cpu_smoke_runs_under_the_interpreter(tmp_path):
    # --part moe (issue 31 item 4): torch and triton only; the smoke runs every format at tiny dims
    _assert_imports_no_server_stack("gpu_moe", "m2serve.kernels.triton.moe")
    r = _run("--part", "moe", "--cpu-smoke", out=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "gpu_check_moe.json").read_text())
    assert res["ok"] and res["device"] == "cpu" and res["copy_rate_gb_s"] > 0
    assert set(res["correctness"]) == {"bf16", "fp8_block", "nvfp4_modelopt", "nvfp4_ct", "mxfp4"}
    for c in res["correctness"].values():  # bf16 activations: within bf16 rounding of the fp32 reference
        assert c["kernel_max_abs_diff"] <= 2**-6 * c["max_abs_ref"], c
    for d in res["decode"].values():
        assert d["bound_ms"] > 0 and d["kernel_over_bound"] == d["kernel_ms"] / d["bound_ms"]
        assert d["bytes_read"] == d["experts_hit"] * 3 * 64 * 32 // 2 + d["experts_hit"] * 3 * 64 * 32 // 32
