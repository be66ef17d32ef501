"""Kernel-level timing of one bench-config MoE layer's experts: packed kernels vs aten, vs the bound.

One layer of the bench config (hidden 3072, intermediate 1536, 32 experts, top-8) with random
weights in each storage (bf16, FP8 block 128x128, NVFP4 ModelOpt, MXFP4). Per format and thread
count it times :func:`m2serve.kernels.ops.grouped_expert_ffn` on

- decode: batch-1 decode's 8 rows, one per active expert (8 of 32 experts read);
- prefill: 512 tokens x top-8 = 4096 rows over all 32 experts (128 rows each);

and, for reference, the previous path: a loop over active experts of ``F.linear`` (``aten::mm``) on
bf16 weights, and dequantise-then-``F.linear`` per expert for the quantised formats. It prints the
bytes read per call (codes + scales of the active experts), the effective GB/s, and the decode
bound = bytes / streaming read bandwidth measured in the same run (a ``sum`` over 1 GiB).

    python benchmarks/kernels.py [--threads 1 2] [--reps 20]

Timings are medians; the machine may be shared, so run it on an otherwise idle one for figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from m2serve.formats.fp4 import FP4Scheme, PackedFP4
from m2serve.formats.fp8 import PackedFP8
from m2serve.kernels.build import kernel_backend, select_backend
from m2serve.kernels.ops import PackedWeights, grouped_expert_ffn

H, I, E, TOP_K, PREFILL = 3072, 1536, 32, 8, 512


def random_weights(fmt: str, n: int, k: int, g: torch.Generator) -> PackedWeights:
    """E random weights [n, k] of ``fmt`` (values do not matter for timing; scales are sane)."""
    ws = []
    for _ in range(E):
        if fmt == "bf16":
            ws.append((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16))
        elif fmt == "fp8":
            q = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
            ws.append(PackedFP8(q, torch.full((n // 128, k // 128), 1e-3)))
        elif fmt == "nvfp4":
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            scale = torch.full((n, k // 16), 0.5).to(torch.float8_e4m3fn)
            ws.append(PackedFP4(FP4Scheme.NVFP4_MODELOPT, codes, scale, torch.tensor(0.01)))
        else:
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            ws.append(PackedFP4(FP4Scheme.MXFP4, codes, torch.full((n, k // 32), 120, dtype=torch.uint8)))
    return PackedWeights.stack(ws)


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def stream_gbs(reps: int = 5) -> float:
    """Streaming read bandwidth (GB/s): best of ``reps`` sums over a 1 GiB fp32 tensor."""
    x = torch.ones(2**28)
    best = min(median_s(lambda: x.sum(), 1) for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def aten_ffn(x, offsets, w13: PackedWeights, w2: PackedWeights, dense13=None, dense2=None):
    """The previous path: per active expert, (dequantise, then) F.linear through aten::mm."""
    out, start = torch.zeros_like(x), 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            a = dense13[e] if dense13 is not None else w13.dequantize(e, x.dtype)
            b = dense2[e] if dense2 is not None else w2.dequantize(e, x.dtype)
            gate, up = F.linear(x[start:end], a).chunk(2, dim=-1)
            out[start:end] = F.linear(F.silu(gate) * up, b)
        start = end
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8", "nvfp4", "mxfp4"])
    args = p.parse_args()
    backend = kernel_backend()
    print(backend.banner())
    g = torch.Generator().manual_seed(0)
    weights = {f: (random_weights(f, 2 * I, H, g), random_weights(f, H, I, g)) for f in args.formats}
    dense = weights.get("bf16") or (random_weights("bf16", 2 * I, H, g), random_weights("bf16", H, I, g))
    decode_off = torch.tensor([1] * TOP_K + [0] * (E - TOP_K), dtype=torch.int32).cumsum(0).int()
    prefill_off = torch.full((E,), PREFILL * TOP_K // E, dtype=torch.int32).cumsum(0).int()
    x_dec = torch.randn(TOP_K, H).to(torch.bfloat16)
    x_pre = torch.randn(PREFILL * TOP_K, H).to(torch.bfloat16)
    aten = select_backend("none")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bw = stream_gbs()
        print(f"\n{threads} thread(s): streaming read {bw:.1f} GB/s; one layer's experts, bf16 activations")
        print(f"{'format':7}{'path':14}{'MB read':>9}{'decode ms':>11}{'GB/s':>7}{'bound ms':>10}"
              f"{'x bound':>9}{'x aten bf16':>13}{'prefill ms':>12}{'x dequant+mm':>14}")
        base_dec = median_s(lambda: aten_ffn(x_dec, decode_off, *dense, dense[0].q, dense[1].q), args.reps)
        base_pre = median_s(lambda: aten_ffn(x_pre, prefill_off, *dense, dense[0].q, dense[1].q), 3)
        for fmt in args.formats:
            w13, w2 = weights[fmt]
            per_expert = (w13.nbytes + w2.nbytes) / E
            read = per_expert * TOP_K
            dec = median_s(lambda a=w13, b=w2: grouped_expert_ffn(x_dec, decode_off, a, b, backend),
                           args.reps)
            pre = median_s(lambda a=w13, b=w2: grouped_expert_ffn(x_pre, prefill_off, a, b, backend), 3)
            if fmt == "bf16":
                ref_pre = base_pre
            else:
                ref_pre = median_s(lambda a=w13, b=w2: grouped_expert_ffn(x_pre, prefill_off, a, b, aten), 3)
            bound = read / (bw * 1e9)
            print(f"{fmt:7}{backend.name:14}{read / 1e6:9.1f}{dec * 1e3:11.2f}{read / dec / 1e9:7.1f}"
                  f"{bound * 1e3:10.2f}{dec / bound:9.2f}{base_dec / dec:13.2f}{pre * 1e3:12.1f}"
                  f"{ref_pre / pre:14.2f}")
        read = (dense[0].nbytes + dense[1].nbytes) / E * TOP_K
        print(f"{'bf16':7}{'aten::mm':14}{read / 1e6:9.1f}{base_dec * 1e3:11.2f}{read / base_dec / 1e9:7.1f}"
              f"{read / (bw * 1e9) * 1e3:10.2f}{base_dec / (read / (bw * 1e9)):9.2f}{1.0:13.2f}"
              f"{base_pre * 1e3:12.1f}{1.0:14.2f}")


if __name__ == "__main__":
    main()
