"""``benchmarks/gpu_check.py --part attention``: the Triton paged attention kernel on one GPU
(issue 28 item 5, docs/kernels.md §3), < 6 min on one H200.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --part attention             # on the GPU machine
    PYTHONPATH=src python3 benchmarks/gpu_check.py --part attention --cpu-smoke # interpreter, tiny

Needs torch and triton 3.6 (the image of torch 2.11) only: it imports the kernel package and the
model's attention (config, formats, kernels, model), nothing from serve/, text/ or engine/, so
no pydantic, fastapi or llguidance. Heads of the full model on one rank (48 query, 8 KV heads,
head_dim 128), pages of 16 tokens handed out in shuffled order, bf16.

(a) correctness: the kernel against ``model/attention.py attend`` in fp32 (fp32 copies of the
    same q and pages) on mixed steps (decode rows, a chunk starting mid-page after a cached
    prefix, a fresh prompt; pages of 16 and 128; fp8 pages with scales; forced split-K), next to
    the error of ``attend`` itself in bf16. OK when the kernel's max |diff| <= max(2 x attend's
    bf16 error, 2^-7 x max |reference|) (the second: one bf16 ulp at the largest output; under the
    interpreter the kernel's bf16 store truncates, docs/kernels.md §1).
(b) speed: decode of batch 1 / 32 / 128 over long contexts (65,536 / 8,192 / 8,192 tokens;
    bf16 pages, and fp8 pages at batch 32): median kernel time (CUDA events) and the same step
    through ``attend``; each as a ratio to the bandwidth bound, the KV bytes the step must read
    (``kv_bytes_read``) over the device copy rate measured in the same run (``copy_`` of a 2 GiB
    buffer, bytes read + written per second). Timed eagerly (CUDA events around each call, the
    host's launch cost included) and replayed from a CUDA graph (device time; a capture failure is
    reported, not fatal).

Figures are printed and, with ``$OUT`` set, written to ``$OUT/gpu_check_attention.json``.
"""

from __future__ import annotations

import time

import torch

from m2serve.model.attention import attend
from m2serve.model.batch import ForwardBatch, KVStorage
from m2serve.model.step import RopeCache, StepContext

HQ, HKV, D = 48, 8, 128
PAGE = 16
CHECKS = {  # name -> ([(cached, new)], page size, kv dtype, forced splits)
    "mixed page16": ([(37, 40), (199, 1), (0, 21), (5000, 1)], 16, torch.bfloat16, None),
    "mixed page128": ([(37, 40), (199, 1), (0, 21), (5000, 1)], 128, torch.bfloat16, None),
    "mixed fp8 page16": ([(37, 40), (199, 1), (0, 21), (5000, 1)], 16, torch.float8_e4m3fn, None),
    "decode split4": ([(3000, 1), (700, 1)], 16, torch.bfloat16, 4),
}
DECODE = {"b1": (1, 65536, torch.bfloat16), "b32": (32, 8192, torch.bfloat16),
          "b128": (128, 8192, torch.bfloat16), "b32 fp8": (32, 8192, torch.float8_e4m3fn)}
SMOKE_HEADS = (6, 1)
SMOKE_CHECKS = {"mixed page16": ([(37, 9), (99, 1), (0, 5)], 16, torch.bfloat16, None),
                "mixed fp8 page16": ([(37, 9), (99, 1)], 16, torch.float8_e4m3fn, None),
                "decode split4": ([(700, 1)], 16, torch.bfloat16, 4)}
SMOKE_DECODE = {"b1": (1, 256, torch.bfloat16), "b4": (4, 128, torch.bfloat16)}
K_SCALE, V_SCALE = 0.25, 3.0  # fp8 pages


def build_step(requests: list[tuple[int, int]], hq: int, hkv: int, page_size: int, kv_dtype: torch.dtype,
               device: str, seed: int = 0):
    """q [T, hq, D] bf16, a one-layer pool (random everywhere; fp8 holds x / scale), the batch and
    its StepContexts (bf16, fp32) for ``requests`` = [(cached, new)], pages in shuffled order."""
    g = torch.Generator(device=device).manual_seed(seed)
    n_pages = [-(-(c + n) // page_size) for c, n in requests]
    P = sum(n_pages) + 1
    scales = (K_SCALE, V_SCALE) if kv_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    kv = KVStorage.allocate(1, P, page_size, hkv, D, kv_dtype, device, [scales[0]], [scales[1]])
    for pool, s in ((kv.k[0], scales[0]), (kv.v[0], scales[1])):
        pool.copy_(torch.randn(pool.shape, generator=g, device=device, dtype=torch.bfloat16) / s)
    order = torch.randperm(P, generator=g, device=device).to(torch.int32)
    width = max(n_pages)
    tables = torch.zeros(len(requests), width, dtype=torch.int32, device=device)
    starts, positions, slots, at = [0], [], [], 0
    for b, ((c, n), k) in enumerate(zip(requests, n_pages, strict=True)):
        tables[b, :k] = order[at: at + k]
        at += k
        starts.append(starts[-1] + n)
        positions.extend(range(c, c + n))
    T = starts[-1]
    pos = torch.tensor(positions, device=device)
    req = torch.repeat_interleave(torch.arange(len(requests), device=device),
                                  torch.tensor([n for _, n in requests], device=device))
    slots = tables[req, pos // page_size].long() * page_size + pos % page_size
    batch = ForwardBatch(tokens=torch.zeros(T, dtype=torch.int64, device=device), positions=pos,
                         input_row_offsets=torch.tensor(starts, dtype=torch.int32, device=device),
                         slot_mapping=slots, block_tables=tables,
                         context_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32,
                                                   device=device))
    q = (torch.randn(T, hq, D, generator=g, device=device) * 2).to(torch.bfloat16)
    steps = {dt: StepContext.build(batch, page_size, RopeCache(64, 1e4), dt) for dt in (torch.bfloat16,
                                                                                       torch.float32)}
    return q, kv, batch, steps  # a step context per activation dtype (attend's masks take q's dtype)


def run_kernel(q, kv, batch, splits=None):
    from m2serve.kernels.triton.attention import paged_attention

    host = batch.host
    return paged_attention(q, kv.k[0], kv.v[0], batch.block_tables, batch.input_row_offsets,
                           batch.context_lens, D ** -0.5, max_query_len=max(host.query_lens),
                           max_context_len=max(host.context_lens), k_scale=kv.k_scale[0],
                           v_scale=kv.v_scale[0], splits=splits)


def fp32_copy(kv: KVStorage) -> KVStorage:
    """The pool in fp32 (fp8 pages stay fp8: attend dequantises them exactly)."""
    if kv.k[0].dtype == torch.float8_e4m3fn:
        return kv
    return KVStorage(k=[kv.k[0].float()], v=[kv.v[0].float()], page_size=kv.page_size,
                     k_scale=kv.k_scale, v_scale=kv.v_scale)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(fn, device: str, iters: int) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on a GPU), after 2 warm-up calls."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_ms(fn, iters: int) -> float | str:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (device time without the host's
    launch cost), or the capture error as a string (reported, not fatal)."""
    try:
        fn()  # compiled and warm before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return median_ms(graph.replay, "cuda", iters)
    except Exception as e:  # the point is to learn what does not capture
        return f"{type(e).__name__}: {str(e)[:200]}"


def copy_rate(device: str, nbytes: int) -> float:
    """Device copy rate in bytes/s (read + written) of ``dst.copy_(src)`` over ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, 10)
    return 2 * nbytes / (ms / 1e3)


def time_decode(batch_size: int, context: int, kv_dtype: torch.dtype, hq: int, hkv: int, rate: float,
                device: str, iters: int) -> dict:
    """One decode step of ``batch_size`` requests over ``context`` tokens each: kernel and attend
    median ms, and both over the bandwidth bound (KV bytes read / ``rate`` bytes/s)."""
    from m2serve.kernels.triton.attention import kv_bytes_read

    q, kv, batch, steps = build_step([(context - 1, 1)] * batch_size, hq, hkv, PAGE, kv_dtype, device)
    kernel = lambda: run_kernel(q, kv, batch)  # noqa: E731
    torch_path = lambda: attend(q, kv, 0, steps[torch.bfloat16], D ** -0.5)  # noqa: E731
    kernel_ms, torch_ms = median_ms(kernel, device, iters), median_ms(torch_path, device, iters)
    bound_ms = kv_bytes_read([context] * batch_size, hkv, D, kv_dtype) / rate * 1e3
    res = {"batch": batch_size, "context": context, "kv_dtype": str(kv_dtype), "kernel_ms": kernel_ms,
           "attend_ms": torch_ms, "bound_ms": bound_ms, "kernel_over_bound": kernel_ms / bound_ms,
           "attend_over_bound": torch_ms / bound_ms}
    if device.startswith("cuda"):  # the same calls replayed from CUDA graphs: device time only
        for name, fn in (("kernel", kernel), ("attend", torch_path)):
            ms = graph_ms(fn, iters)
            res[f"{name}_graph_ms"] = ms
            if isinstance(ms, float):
                res[f"{name}_graph_over_bound"] = ms / bound_ms
    return res


def check_attention(device: str, smoke: bool) -> dict:
    """Every figure of the module docstring (``smoke``: tiny heads and contexts, CPU interpreter)."""
    hq, hkv = SMOKE_HEADS if smoke else (HQ, HKV)
    out: dict = {"heads": [hq, hkv], "head_dim": D, "correctness": {}, "decode": {}}
    for name, (requests, page, kv_dtype, splits) in (SMOKE_CHECKS if smoke else CHECKS).items():
        q, kv, batch, steps = build_step(requests, hq, hkv, page, kv_dtype, device)
        ref = attend(q.float(), fp32_copy(kv), 0, steps[torch.float32], D ** -0.5).view(q.shape)
        got = run_kernel(q, kv, batch, splits).float()
        torch_bf16 = attend(q, kv, 0, steps[torch.bfloat16], D ** -0.5).view(q.shape).float()
        k_err, t_err = float((got - ref).abs().max()), float((torch_bf16 - ref).abs().max())
        res = {"kernel_max_abs_diff": k_err, "attend_bf16_max_abs_diff": t_err,
               "max_abs_ref": float(ref.abs().max())}
        res["ok"] = k_err <= max(2 * t_err, 2**-7 * res["max_abs_ref"])
        out["correctness"][name] = res
        print(f"[a] {name}: kernel {k_err:.3e}, attend bf16 {t_err:.3e}, ok {res['ok']}", flush=True)
    rate = copy_rate(device, 2**20 if smoke else 2**31)
    out["copy_rate_gb_s"] = rate / 1e9
    print(f"[b] device copy rate {rate / 1e9:.1f} GB/s (read + written)", flush=True)
    iters = 3 if smoke else 20
    for name, (batch_size, context, kv_dtype) in (SMOKE_DECODE if smoke else DECODE).items():
        res = time_decode(batch_size, context, kv_dtype, hq, hkv, rate, device, iters)
        out["decode"][name] = res
        print(f"[b] decode {name} x {context}: kernel {res['kernel_ms']:.3f} ms "
              f"({res['kernel_over_bound']:.2f} x bound {res['bound_ms']:.3f} ms), attend "
              f"{res['attend_ms']:.3f} ms ({res['attend_over_bound']:.2f} x); graphs: kernel "
              f"{res.get('kernel_graph_ms')} ms, attend {res.get('attend_graph_ms')} ms", flush=True)
    out["ok"] = all(r["ok"] for r in out["correctness"].values())
    return out
