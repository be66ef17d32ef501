"""``benchmarks/gpu_check.py --part moe``: the Triton fused MoE on one GPU (issue 31 item 4,
docs/kernels.md §5), at full width: 256 experts, top-8, hidden 3,072, intermediate 1,536 (one
rank, no TP / EP), bf16 activations, every stored format.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --part moe             # on the GPU machine
    PYTHONPATH=src python3 benchmarks/gpu_check.py --part moe --cpu-smoke # interpreter, tiny

Needs torch and triton 3.6 only (config, formats, kernels, model; nothing from serve/ or engine/).
Weights are random codes and scales of each format, sized like the release's experts.

(a) correctness: per format, 16 tokens routed top-8 with a few heavy experts; the kernel's [T, H]
    output against a GPU fp32 reference (the weights dequantised by kernels/ops.py
    ``PackedWeights.dequantize``, i.e. formats/' formulas, then pair by active expert in fp32), next
    to the error of the torch path (MiniMaxM2Experts on the weights dequantised to bf16:
    ``F.grouped_mm``). OK when the kernel's max |diff| <= max(2 x the torch path's error, 2^-7 x
    max |reference|).
(b) speed: decode at batch 1 / 32 / 128 (top-8 of 256, uniform routing): median kernel time (CUDA
    events), tokens per second, and the ratio to the bandwidth bound: the stored bytes of the
    experts the step hits (codes + scales) over the device copy rate measured in the same run;
    beside it the torch path (bf16 experts, grouped_mm) timed the same way, with its bf16 bytes
    bound. Replayed from a CUDA graph too (a capture failure is reported, not fatal).

Figures are printed and, with ``$OUT`` set, written to ``$OUT/gpu_check_moe.json``.
"""

from __future__ import annotations

import torch

from gpu_attention import copy_rate, graph_ms, median_ms
from m2serve.kernels.ops import PackedWeights, WeightFormat
from m2serve.model.experts import MiniMaxM2Experts

E, K_TOP, H, I = 256, 8, 3072, 1536
SMOKE = (16, 4, 64, 32)  # E, top-k, H, I under the interpreter
FORMATS = {"bf16": WeightFormat.BF16, "fp8_block": WeightFormat.FP8_BLOCK,
           "nvfp4_modelopt": WeightFormat.NVFP4_MODELOPT, "nvfp4_ct": WeightFormat.NVFP4_CT,
           "mxfp4": WeightFormat.MXFP4}
BATCHES = (1, 32, 128)
SMOKE_BATCHES = {"mxfp4": (1,)}  # the interpreter is slow: the smoke times one format, batch 1
CHECK_TOKENS = 16


def random_weights(fmt: WeightFormat, e: int, n: int, k: int, device: str, seed: int) -> PackedWeights:
    """Random stored weights [e, n, k] of ``fmt`` whose dequantised values are ~ N(0, 1/k)."""
    g = torch.Generator(device=device).manual_seed(seed)
    amp = k ** -0.5
    if fmt is WeightFormat.BF16:
        return PackedWeights(fmt, (torch.randn(e, n, k, generator=g, device=device) * amp).bfloat16())
    if fmt is WeightFormat.FP8_BLOCK:
        q = (torch.randn(e, n, k, generator=g, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(e, -(-n // 128), -(-k // 128), generator=g, device=device) * amp / 50 + amp / 200
        return PackedWeights(fmt, q, s, None, 128, 128)
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, device=device, dtype=torch.uint8)
    if fmt is WeightFormat.MXFP4:
        # 2^(e - 127) ~ amp / 3: code values reach 6
        mid = 127 + round(torch.log2(torch.tensor(amp / 3)).item())
        s = torch.randint(mid - 1, mid + 2, (e, n, k // 32), generator=g, device=device, dtype=torch.uint8)
        return PackedWeights(fmt, codes, s, None, 1, 32)
    s = (torch.rand(e, n, k // 16, generator=g, device=device) * 0.5 + 0.5).to(torch.float8_e4m3fn)
    s2 = torch.full((e,), amp / 3, device=device)
    if fmt is WeightFormat.NVFP4_CT:
        s2 = 1.0 / s2  # the global scale divides
    return PackedWeights(fmt, codes, s, s2, 1, 16)


def stored_bytes(w: PackedWeights) -> int:
    """Bytes of one expert of ``w`` as stored (codes, block scales, per-expert scalar)."""
    t = [w.q[0], *(x[0] for x in (w.scale, w.scale_2) if x is not None)]
    return sum(x.numel() * x.element_size() for x in t)


def routing(T: int, e: int, k: int, device: str, seed: int, skew: bool):
    g = torch.Generator(device=device).manual_seed(seed)
    p = torch.rand(e, generator=g, device=device) ** (4 if skew else 0)
    ids = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(T)])
    w = torch.rand(T, k, generator=g, device=device)
    return ids, w / w.sum(1, keepdim=True)


def torch_path(w1, w3, w2, e: int, h: int, i: int, device: str) -> MiniMaxM2Experts:
    """MiniMaxM2Experts holding the weights dequantised to bf16 (the grouped_mm path)."""
    m = MiniMaxM2Experts(h, i, 0, e, dtype=torch.bfloat16).to(device)
    for x in range(e):
        m.w13.data[x, :i] = w1.dequantize(x, torch.bfloat16)
        m.w13.data[x, i:] = w3.dequantize(x, torch.bfloat16)
        m.w2.data[x] = w2.dequantize(x, torch.bfloat16)
    return m


def reference(x, ids, tw, w1, w3, w2) -> torch.Tensor:
    """fp32: each active expert's rows through its dequantised fp32 weights, weighted, summed."""
    out = torch.zeros(x.shape[0], w2.q.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        xe = x[t].float()
        y = (torch.nn.functional.silu(xe @ w1.dequantize(e, torch.float32).T)
             * (xe @ w3.dequantize(e, torch.float32).T)) @ w2.dequantize(e, torch.float32).T
        out.index_add_(0, t, y * tw[t, j][:, None])
    return out


def check_format(name: str, fmt: WeightFormat, dims: tuple[int, int, int, int], rate: float, device: str,
                 smoke: bool, iters: int) -> tuple[dict, dict]:
    """(a) and (b) of the module docstring for one format: (correctness row, decode rows)."""
    from m2serve.kernels.triton.moe import fused_moe

    e, k, h, i = dims
    act = torch.bfloat16
    w1, w3 = (random_weights(fmt, e, i, h, device, s) for s in (1, 2))
    w2 = random_weights(fmt, e, h, i, device, 3)
    dense = torch_path(w1, w3, w2, e, h, i, device)
    ids, tw = routing(CHECK_TOKENS, e, k, device, 4, skew=True)
    x = torch.randn(CHECK_TOKENS, h, device=device).to(act)
    ref = reference(x, ids, tw, w1, w3, w2)
    got = fused_moe(x, ids, tw, w1, w3, w2)
    base = dense(x, ids, tw)
    k_err, t_err = float((got - ref).abs().max()), float((base - ref).abs().max())
    res = {"kernel_max_abs_diff": k_err, "torch_bf16_max_abs_diff": t_err,
           "max_abs_ref": float(ref.abs().max())}
    res["ok"] = k_err <= max(2 * t_err, 2**-7 * res["max_abs_ref"])
    print(f"[a] {name}: kernel {k_err:.3e}, torch bf16 {t_err:.3e}, ok {res['ok']}", flush=True)
    per_expert = sum(stored_bytes(w) for w in (w1, w3, w2))
    bf16_expert = 3 * h * i * 2
    decode = {}
    for b in SMOKE_BATCHES.get(name, ()) if smoke else BATCHES:
        ids, tw = routing(b, e, k, device, 5 + b, skew=False)
        x = torch.randn(b, h, device=device).to(act)
        hit = int(ids.unique().numel())
        bound = hit * per_expert / rate * 1e3  # ms

        def kernel(x=x, ids=ids, tw=tw):
            return fused_moe(x, ids, tw, w1, w3, w2)

        def torch_step(x=x, ids=ids, tw=tw):
            return dense(x, ids, tw)

        r = {"experts_hit": hit, "bytes_read": hit * per_expert, "bound_ms": bound,
             "kernel_ms": median_ms(kernel, device, iters),
             "torch_bf16_ms": median_ms(torch_step, device, iters),
             "torch_bf16_bound_ms": hit * bf16_expert / rate * 1e3}
        r["kernel_over_bound"] = r["kernel_ms"] / r["bound_ms"]
        r["kernel_tok_s"] = b / r["kernel_ms"] * 1e3
        r["torch_bf16_tok_s"] = b / r["torch_bf16_ms"] * 1e3
        if device.startswith("cuda"):
            r["kernel_graph_ms"] = graph_ms(kernel, iters)
            r["torch_bf16_graph_ms"] = graph_ms(torch_step, iters)
        decode[f"{name} b{b}"] = r
        print(f"[b] {name} batch {b}: kernel {r['kernel_ms']:.3f} ms ({r['kernel_over_bound']:.2f} x "
              f"bound {bound:.3f} ms, {r['kernel_tok_s']:.0f} tok/s), torch bf16 {r['torch_bf16_ms']:.3f} "
              f"ms; graphs: kernel {r.get('kernel_graph_ms')}, torch {r.get('torch_bf16_graph_ms')}",
              flush=True)
    return res, decode


def check_moe(device: str, smoke: bool) -> dict:
    """Every figure of the module docstring (``smoke``: tiny dims, CPU interpreter)."""
    e, k, h, i = SMOKE if smoke else (E, K_TOP, H, I)
    out: dict = {"experts": e, "top_k": k, "hidden": h, "intermediate": i, "correctness": {}, "decode": {}}
    rate = copy_rate(device, 2**20 if smoke else 2**31)
    out["copy_rate_gb_s"] = rate / 1e9
    print(f"[b] device copy rate {rate / 1e9:.1f} GB/s (read + written)", flush=True)
    iters = 1 if smoke else 20
    for name, fmt in FORMATS.items():
        correctness, decode = check_format(name, fmt, (e, k, h, i), rate, device, smoke, iters)
        out["correctness"][name] = correctness
        out["decode"].update(decode)
    out["ok"] = all(r["ok"] for r in out["correctness"].values())
    return out
