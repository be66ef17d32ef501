"""The bytes-read-per-decode-token rule the format benchmarks print (benchmarks/formats.py
``decode_bytes``, used by formats.py and llama_cpp_peer.py), against sums done by hand; and
llama_cpp_peer.py's skip without llama-cpp-python."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _formats():
    spec = importlib.util.spec_from_file_location("bench_formats", BENCH / "formats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gguf_mxfp4_moe_bench_config_matches_the_hand_sum():
    # The tensors of llama.cpp's MXFP4_MOE GGUF of the bench config (hidden 3072, 48 x 128 q heads,
    # 8 x 128 kv heads, 32 experts of 1536, 2 layers, vocab 32000): Q8_0 = 34 bytes per 32 values,
    # MXFP4 = 17 bytes per 32, norms / router / bias f32.
    q8, fp4, f32 = 34 / 32, 17 / 32, 4
    tensors = [("token_embd.weight", int(32000 * 3072 * q8)), ("output_norm.weight", 3072 * f32),
               ("output.weight", int(32000 * 3072 * q8))]
    for b in range(2):
        tensors += [(f"blk.{b}.attn_norm.weight", 3072 * f32), (f"blk.{b}.ffn_norm.weight", 3072 * f32),
                    (f"blk.{b}.attn_q.weight", int(6144 * 3072 * q8)),
                    (f"blk.{b}.attn_k.weight", int(1024 * 3072 * q8)),
                    (f"blk.{b}.attn_v.weight", int(1024 * 3072 * q8)),
                    (f"blk.{b}.attn_output.weight", int(3072 * 6144 * q8)),
                    (f"blk.{b}.attn_q_norm.weight", 6144 * f32), (f"blk.{b}.attn_k_norm.weight", 1024 * f32),
                    (f"blk.{b}.ffn_gate_inp.weight", 32 * 3072 * f32),
                    (f"blk.{b}.exp_probs_b.bias", 32 * f32)]
        tensors += [(f"blk.{b}.ffn_{w}_exps.weight", int(32 * 1536 * 3072 * fp4))
                    for w in ("gate", "up", "down")]
    # by hand, per layer: attention 2 x 20,054,016 + 2 x 3,342,336 = 46,792,704; norms 53,248;
    # router 393,216 + 128; experts 3 x 80,216,064 x 8/32 = 60,162,048 -> 107,401,344;
    # two layers 214,802,688 + output norm 12,288 + output 104,448,000; no token_embd
    assert _formats().decode_bytes(tensors, top_k=8, num_experts=32) == 319_262_976


def test_hub_names_leave_out_the_embedding_and_share_the_experts():
    tensors = [("model.embed_tokens.weight", 1000), ("lm_head.weight", 7),
               ("model.layers.0.block_sparse_moe.gate.weight", 3),
               ("model.layers.0.block_sparse_moe.experts.5.w1.weight", 100),
               ("model.layers.0.block_sparse_moe.experts.5.w1.weight_scale", 20)]
    # 7 + 3 + (100 + 20) x 8 / 32 = 40
    assert _formats().decode_bytes(tensors, top_k=8, num_experts=32) == 40


def test_llama_cpp_peer_skips_with_the_install_command_without_llama_cpp_python():
    code = ("import importlib.util, runpy, sys; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'llama_cpp' else real(n, *a); "
            f"sys.argv = ['llama_cpp_peer.py']; runpy.run_path({str(BENCH / 'llama_cpp_peer.py')!r}, "
            "run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "skipped, llama-cpp-python is not installed" in done.stdout
    assert 'CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" pip install llama-cpp-python==0.3.36' in done.stdout


def test_machine_line_names_cpu_isa_and_load():
    # every benchmark figure is stated with the CPU model, its ISA flags and the load average
    bench = _formats()
    fields = {}
    for ln in Path("/proc/cpuinfo").read_text().splitlines():
        k, _, v = ln.partition(":")
        fields.setdefault(k.strip(), v.strip())
    cpu, isa, cpus, load = bench.machine_line().split(" | ")
    assert cpu == f"CPU: {fields['model name']}"
    assert isa.removeprefix("ISA: ").split() == [f for f in bench.ISA_FLAGS if f in fields["flags"].split()]
    assert cpus == f"{os.cpu_count()} CPUs" and load.startswith("load average ")
    assert all(float(x) >= 0 for x in load.removeprefix("load average ").split())


def test_llama_cpp_peer_reports_the_median_of_per_round_ratios():
    # the alternating rounds are summarised per pair: the median of m2serve / llama.cpp per round
    # (so that a slow round of both cancels), not the ratio of the medians
    spec = importlib.util.spec_from_file_location("bench_llama_peer", BENCH / "llama_cpp_peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    # per-round ratios 2, 0.5, 3 -> 2; the ratio of the medians would be 20 / 10 = 2 too, so a
    # second case where they differ: ratios 1, 1, 4 -> 1, medians 20 / 10 = 2
    assert peer.median_pair_ratio([10, 20, 30], [5, 40, 10]) == 2
    assert peer.median_pair_ratio([10, 20, 40], [10, 20, 10]) == 1
    with pytest.raises(ValueError):
        peer.median_pair_ratio([1, 2], [1])
    prompts = peer.decode_prompts(32000, 16, 0)
    assert len(prompts) == 16 and len({tuple(p) for p in prompts}) == 16  # B distinct prompts
    assert all(len(p) == peer.formats.PROMPT for p in prompts)
    assert peer.decode_prompts(32000, 16, 1) != prompts  # each round its own
