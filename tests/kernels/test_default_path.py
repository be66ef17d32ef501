"""The default weights path (issue 18 item 4 and "must show"): on a CPU the kernels support, the
default ``weight_dequant="auto"`` keeps the FP8 checkpoint packed and every linear of a decode step
computes from the codes (nothing is dequantised), and the start banner and the LLM's INFO log name
the backend in use; without the kernels ``auto`` dequantises at load and the banner gives the reason.

Observed independently of the code under test: the PackedFP8 dequantisation (formats/) is counted
by a wrapper, the kernels' grouped op by a wrapper around ``cpu_grouped_expert_ffn``'s module binding.
"""

from __future__ import annotations

import logging

import torch

from m2serve.checkpoints import default_model_path
from m2serve.config.engine_args import EngineArgs
from m2serve.engine.sampling import SamplingParams
from m2serve.formats.fp8 import PackedFP8
from m2serve.kernels import build
from m2serve.kernels.build import kernel_backend
from m2serve.model import experts as experts_mod
from m2serve.model.load import load_model, resolve_weight_dequant, weights_banner
from m2serve.serve.cli import banner
from m2serve.serve.llm import LLM


def test_default_path_is_packed_and_banner_names_the_backend(monkeypatch, caplog):
    backend = kernel_backend()
    assert backend.available, backend.banner()  # this machine and CI: a CPU the kernels support
    assert EngineArgs().weight_dequant == "auto"
    with caplog.at_level(logging.INFO, logger="m2serve.serve.llm"):
        llm = LLM(None, num_kv_pages=16, kv_cache_page_size=16)  # every other flag at its default
    model = llm.engine.runner.model
    layers = model.model.layers
    assert all(layer.block_sparse_moe.experts.kernel_weights is not None for layer in layers)
    assert all(layer.self_attn.q_proj.packed for layer in layers)
    assert all(b.dtype != torch.bfloat16 or b.dim() < 3 for b in model.buffers())  # no dense experts

    dequants, grouped = [], []
    real_dequant, real_ffn = PackedFP8.dequantize, experts_mod.cpu_grouped_expert_ffn
    monkeypatch.setattr(PackedFP8, "dequantize", lambda self, dtype: dequants.append(dtype)
                        or real_dequant(self, dtype))
    monkeypatch.setattr(experts_mod, "cpu_grouped_expert_ffn", lambda *a: grouped.append(1) or real_ffn(*a))
    out = llm.generate([[5, 17, 33, 2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert dequants == []  # attention, experts: straight from the codes
    assert len(grouped) == 4 * len(layers)  # prefill + 3 decode steps, one grouped call per layer

    line = banner(llm, {})
    assert f"weights runtime (weight_dequant auto) | {backend.banner()}" in line
    assert backend.name.startswith("cpu-")
    assert any(backend.name in r.getMessage() and "weights runtime" in r.getMessage() for r in caplog.records)


def test_auto_without_kernels_dequantises_at_load_and_says_why(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "none")  # the fallback, as with no compiler or a failed build
    kernel_backend.cache_clear()
    try:
        assert resolve_weight_dequant("auto", "cpu", torch.bfloat16) == "load"
        args = EngineArgs(model=str(default_model_path()))
        assert weights_banner(args) == ("weights load (weight_dequant auto) | CPU linear backend: pytorch "
                                        f"({build.ISA_ENV}=none)")
        model = load_model(default_model_path(), dtype=torch.bfloat16)  # the loader's default: auto
        experts = model.model.layers[0].block_sparse_moe.experts
        assert experts.scheme is None and experts.w13.dtype == torch.bfloat16
    finally:
        kernel_backend.cache_clear()
    monkeypatch.delenv(build.ISA_ENV)
    assert resolve_weight_dequant("auto", "cpu", torch.float32) == "runtime"
    # a GPU keeps codes and scales as stored (issue 30): never dequantised on the host
    assert resolve_weight_dequant("auto", "cuda", torch.bfloat16) == "runtime"
    assert resolve_weight_dequant("load", "cpu", torch.bfloat16) == "load"
