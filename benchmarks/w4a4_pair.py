"""W4A4 vs W4A16 on one bench-config MoE layer's MXFP4 experts, side by side in one run.

One layer of the bench config (hidden 3072, intermediate 1536, 32 experts, top-8; kernels.py's
shapes) with random MXFP4 weights (Quark layout). Three ways to run the experts (bf16
activations), timed alternately call by call so that all see the same machine load:

- ``w4a16``: today's W4A16 MXFP4 path (``--activation-quant none``): kernels/ops.py
  ``cpu_grouped_expert_ffn`` on the packed weights;
- ``qdq+w4a16``: W4A4 numerics before the FP4 x FP4 kernel: ``quantize_activations`` (MXFP4) on
  each product's input, then the same W4A16 kernel;
- ``w4a4``: the FP4 x FP4 kernel (``cpu_w4a4_expert_ffn``, csrc/w4a4_linear.cpp,
  docs/checkpoints.md §9.1), which quantises the inputs itself.

Shapes: decode = batch-1 decode's 8 rows, one per active expert (8 of 32 experts read); prefill =
``--prefill`` tokens x top-8 rows over all 32 experts. Printed per way: median ms per call, tokens/s,
and the ratio of w4a4's speed to each other way's (from the medians, and the median of the per-rep
ratios); above the table the bytes each call reads (codes + E8M0 scales of the experts it touches)
and the FLOPs per token (2 · 3 · H · I · top-k multiply-adds counted as 2). First and last line:
the machine (formats.py ``machine_line``: CPU model, ISA flags, load average).

    python benchmarks/w4a4_pair.py [--threads 1] [--reps 30] [--prefill 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from formats import machine_line
from kernels import TOP_K, E, H, I, random_weights
from m2serve.formats.act_quant import ActivationScheme, quantize_activations
from m2serve.kernels.build import kernel_backend
from m2serve.kernels.ops import cpu_grouped_expert_ffn, cpu_grouped_linear, cpu_w4a4_expert_ffn, w4a4_path


def qdq_w4a16(x, offsets, w13, w2, isa):
    """W4A4 numerics through the W4A16 kernel: quantise-dequantise each product's input first."""
    q = ActivationScheme.MXFP4
    gate, up = cpu_grouped_linear(quantize_activations(x, q), offsets, w13, isa).chunk(2, dim=-1)
    return cpu_grouped_linear(quantize_activations(F.silu(gate) * up, q), offsets, w2, isa)


def interleaved(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, called in turn ``reps`` times after one warm-up round."""
    times = {k: [] for k in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--prefill", type=int, default=128, help="prefill tokens (x top-8 rows)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    backend = kernel_backend()
    if not backend.available:
        raise SystemExit(f"the CPU kernels are not available: {backend.banner()}")
    path = w4a4_path(backend.isa)
    print(machine_line())
    print(f"{backend.banner()}; W4A4 path {path.name.lower()}; {args.threads} thread(s)")
    g = torch.Generator().manual_seed(0)
    w13, w2 = random_weights("mxfp4", 2 * I, H, g), random_weights("mxfp4", H, I, g)
    per_expert = (w13.nbytes + w2.nbytes) / E
    flops = 2 * 3 * H * I * TOP_K
    shapes = {
        "decode": (torch.tensor([1] * TOP_K + [0] * (E - TOP_K), dtype=torch.int32).cumsum(0).int(), 1),
        "prefill": (torch.full((E,), args.prefill * TOP_K // E, dtype=torch.int32).cumsum(0).int(),
                    args.prefill),
    }
    print(f"MXFP4 experts: {per_expert / 1e6:.2f} MB per expert (w13 + w2 codes and E8M0 scales); "
          f"{flops / 1e6:.1f} MFLOP per token (8 experts x 3 products of {H} x {I})")
    for shape, (offsets, tokens) in shapes.items():
        rows = int(offsets[-1])
        x = (torch.randn(rows, H, generator=g)).to(torch.bfloat16)
        read = per_expert * int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())
        fns = {"w4a16": lambda x=x, o=offsets: cpu_grouped_expert_ffn(x, o, w13, w2, backend.isa),
               "qdq+w4a16": lambda x=x, o=offsets: qdq_w4a16(x, o, w13, w2, backend.isa),
               "w4a4": lambda x=x, o=offsets: cpu_w4a4_expert_ffn(x, o, w13, w2, path)}
        reps = args.reps if shape == "decode" else max(3, args.reps // 5)
        t = interleaved(fns, reps)
        print(f"\n{shape}: {tokens} token(s), {rows} rows, {read / 1e6:.1f} MB of weights read per call, "
              f"{reps} interleaved reps")
        print(f"{'way':11}{'ms/call':>9}{'tok/s':>9}{'GFLOP/s':>9}{'w4a4 speedup':>14}{'(per-rep)':>11}")
        for name, ts in t.items():
            med = statistics.median(ts)
            ratio = med / statistics.median(t["w4a4"])
            pair = statistics.median(a / b for a, b in zip(ts, t["w4a4"]))
            print(f"{name:11}{med * 1e3:9.2f}{tokens / med:9.1f}{flops * tokens / med / 1e9:9.1f}"
                  f"{ratio:14.2f}{pair:11.2f}")
    print("\n" + machine_line())


if __name__ == "__main__":
    main()
