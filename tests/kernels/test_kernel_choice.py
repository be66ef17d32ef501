"""Issue 30 items 1-2: each module's implementation is picked once after loading (nothing asked per
call), and a GPU target gets its codes and scales as stored, dequantised (if at all) on the device.

Observed independently of the code under test: the backend query is counted by replacing the
``KernelBackend.available`` property (and ``kernel_backend``) with counting wrappers; the host
dequantiser by wrapping formats/fp8.py's ``dequantize_fp8_block`` and recording the device of the
codes it gets. The "meta" device stands in for a GPU (no memory, no data: what matters is which
device the formula runs on). The table of choices is hand-written from the rules.
"""

from __future__ import annotations

import pytest
import torch

from m2serve.formats import fp8 as fp8_mod
from m2serve.kernels import build
from m2serve.kernels import choice as choice_mod
from m2serve.kernels import ops as ops_mod
from m2serve.kernels.build import KernelBackend, kernel_backend
from m2serve.kernels.choice import LinearImpl, choose_impl
from m2serve.kernels.ops import WeightFormat
from m2serve.model.kernel_choice import choose_kernels
from m2serve.model.load import load_model, resident_weight_bytes
from m2serve.model.simple_cache import SimpleKVCache

AVX512 = KernelBackend("cpu-avx512", build.ISA_CODES["avx512"], "test")
NO_KERNELS = KernelBackend("pytorch", None, "test")


@pytest.mark.parametrize(("device", "fmt", "dtype", "backend", "want"), [
    ("cpu", WeightFormat.FP8_BLOCK, torch.bfloat16, AVX512, LinearImpl.CPU_PACKED),
    ("cpu", WeightFormat.BF16, torch.bfloat16, AVX512, LinearImpl.CPU_PACKED),
    ("cpu", WeightFormat.MXFP4, torch.float32, AVX512, LinearImpl.CPU_PACKED),
    ("cpu", WeightFormat.FP8_BLOCK, torch.float16, AVX512, LinearImpl.TORCH),  # no fp16 kernels
    ("cpu", WeightFormat.FP8_BLOCK, torch.bfloat16, NO_KERNELS, LinearImpl.TORCH),
    ("cpu", None, torch.float32, AVX512, LinearImpl.TORCH),  # dense fp32 weight: aten
    ("cuda", WeightFormat.FP8_BLOCK, torch.bfloat16, AVX512, LinearImpl.TRITON),  # the Triton FP8 linear
    ("cuda", WeightFormat.FP8_BLOCK, torch.float32, AVX512, LinearImpl.TORCH),  # bf16 activations only
    ("cuda", WeightFormat.NVFP4_MODELOPT, torch.bfloat16, AVX512, LinearImpl.TORCH),
    ("cuda", WeightFormat.BF16, torch.bfloat16, AVX512, LinearImpl.TORCH),
    ("meta", WeightFormat.FP8_BLOCK, torch.bfloat16, AVX512, LinearImpl.TORCH),
])
def test_choice_table(device, fmt, dtype, backend, want):
    choice = choose_impl(device, fmt, dtype, backend)
    assert choice.impl is want
    assert (choice.isa == backend.isa) if want is LinearImpl.CPU_PACKED else choice.isa is None
    assert choice.label == {LinearImpl.CPU_PACKED: backend.name, LinearImpl.TRITON: "triton-w8a16",
                            LinearImpl.TORCH: "torch"}[want]
    # a layer's experts held as stored take the Triton fused MoE on CUDA with bf16 activations
    grouped = choose_impl(device, fmt, dtype, backend, grouped=True)
    fused = device == "cuda" and fmt is not None and dtype == torch.bfloat16
    assert grouped.impl is (LinearImpl.TRITON if fused else want)
    assert grouped.label == ("triton-moe" if fused else choice.label)


def test_w8a8_needs_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(choice_mod, "device_capability", lambda device: (8, 0))  # A100
    with pytest.raises(ValueError, match=r"fp8_linear=w8a8 needs FP8 tensor cores.*\(8, 0\): use w8a16"):
        choose_impl("cuda", WeightFormat.FP8_BLOCK, torch.bfloat16, AVX512, "w8a8")
    assert choose_impl("cuda", WeightFormat.FP8_BLOCK, torch.bfloat16, AVX512, "w8a16").mode == "w8a16"
    monkeypatch.setattr(choice_mod, "device_capability", lambda device: (9, 0))  # H100 / H200
    c = choose_impl("cuda", WeightFormat.FP8_BLOCK, torch.bfloat16, AVX512, "w8a8")
    assert (c.impl, c.label, c.mode) == (LinearImpl.TRITON, "triton-w8a8", "w8a8")
    with pytest.raises(ValueError, match="fp8_linear='w4a16' is not supported"):
        choose_impl("cpu", WeightFormat.FP8_BLOCK, torch.bfloat16, AVX512, "w4a16")


def _generate(model, steps: int) -> list[int]:
    cache = SimpleKVCache.create(model.config, num_pages=8, page_size=8, dtype=model.dtype)
    prompt = [5, 17, 33, 2, 9]
    out = []
    with torch.inference_mode():
        logits = model(cache.batch([("a", prompt)]), cache.storage)
        for _ in range(steps):
            tok = int(logits[-1].argmax())
            out.append(tok)
            prompt = prompt + [tok]
            logits = model(cache.batch([("a", prompt)]), cache.storage)
    return out


def test_no_backend_query_per_call(tiny_random_fp8_dir, monkeypatch):
    # issue 30 item 1: after load_model's one pass, a prefill and decode steps never ask the backend
    backend = kernel_backend()
    assert backend.available, backend.banner()  # this machine and CI build the kernels
    model = load_model(tiny_random_fp8_dir, dtype=torch.bfloat16)  # auto: FP8 kept packed on CPU
    L = model.config.num_hidden_layers
    label = backend.name
    assert model.kernel_summary.counts == {("linear", "FP8_BLOCK", label): 4 * L,
                                           ("linear", "BF16", label): 1,  # the bf16 head
                                           ("experts", "FP8_BLOCK", label): L}
    assert "kernels: experts FP8_BLOCK" in model.kernel_summary.banner()

    calls = []
    real = KernelBackend.available
    monkeypatch.setattr(KernelBackend, "available", property(lambda self: calls.append(1) or real.fget(self)))
    monkeypatch.setattr(ops_mod, "kernel_backend", lambda: calls.append(1) or backend)
    monkeypatch.setattr(build, "kernel_backend", lambda: calls.append(1) or backend)
    ops = []
    real_cpu = ops_mod.cpu_grouped_linear
    monkeypatch.setattr(ops_mod, "cpu_grouped_linear", lambda *a: ops.append(1) or real_cpu(*a))
    fast = _generate(model, 3)
    assert calls == []  # the per-call query of before (1,344 in one 48-token request) is gone
    assert len(ops) > 0  # and the kernels did run

    # the same model with every module set to the torch reference gives the same greedy tokens
    monkeypatch.undo()
    choose_kernels(model, NO_KERNELS)
    assert set(model.kernel_summary.counts.values()) and all(
        label == "torch" for (_, _, label) in model.kernel_summary.counts)
    assert _generate(model, 3) == fast


def _dequant_devices(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = fp8_mod.dequantize_fp8_block
    monkeypatch.setattr(fp8_mod, "dequantize_fp8_block",
                        lambda q, s, dtype, *rest: seen.append(q.device.type) or real(q, s, dtype, *rest))
    return seen


def test_gpu_target_never_dequantises_on_the_host(tiny_random_fp8_dir, monkeypatch):
    # issue 30 item 2, the loader's device seam on CPU: "meta" stands in for the GPU
    seen = _dequant_devices(monkeypatch)
    model = load_model(tiny_random_fp8_dir, dtype=torch.bfloat16, device="meta")  # auto
    assert seen == []  # auto on a non-CPU device keeps codes and scales as stored
    held = {b.dtype for b in model.buffers() if b.dim() >= 2}
    assert torch.float8_e4m3fn in held and all(b.device.type == "meta" for b in model.buffers())
    assert all(label == "torch" for (_, _, label) in model.kernel_summary.counts)  # meta: the reference

    model = load_model(tiny_random_fp8_dir, dtype=torch.bfloat16, device="meta", weight_dequant="load")
    assert seen and set(seen) == {"meta"}  # dequantised, but on the target device
    assert all(p.device.type == "meta" for p in model.parameters())

    seen.clear()  # control: a CPU target does dequantise on the host, so the observer can fail
    load_model(tiny_random_fp8_dir, dtype=torch.bfloat16, device="cpu", weight_dequant="load")
    assert seen and set(seen) == {"cpu"}


def test_resident_bytes_as_stored(tiny_random_fp8_dir):
    # FP8 held as stored: 1 byte per code + 4 per 128x128 block, against 2 bytes per weight as bf16
    packed = load_model(tiny_random_fp8_dir, dtype=torch.bfloat16, device="meta")
    dense = load_model(tiny_random_fp8_dir, dtype=torch.bfloat16, device="meta", weight_dequant="load")
    fp8_codes = sum(b.numel() for b in packed.buffers() if b.dtype == torch.float8_e4m3fn)
    scales = sum(b.numel() for b in packed.buffers() if b.dtype == torch.float32 and b.dim() >= 2)
    assert fp8_codes > 0 and scales > 0
    diff = resident_weight_bytes(dense) - resident_weight_bytes(packed)
    assert diff == 2 * fp8_codes - (fp8_codes + 4 * scales)


def test_banner_model_of_a_multi_rank_handle():
    # serve/cli.py's banner lists rank 0's picks for a multi-rank model (parallel/worker.py's
    # DistributedModel holds rank 0's module as .model)
    from types import SimpleNamespace

    from m2serve.model.load import local_model

    lin = torch.nn.Linear(2, 2)
    assert local_model(lin) is lin
    assert local_model(SimpleNamespace(model=lin)) is lin
    assert local_model(None) is None and local_model(SimpleNamespace(model=3)) is None
