"""One layer's paged attention on this CPU: the three ways of reading the KV pages (issue 17 item 2).

- ``sdpa``:    :func:`m2serve.model.attention.attend`, the chosen path: per request, its pages
               gathered (Σ context rows) and one fused SDPA call (flash kernel on CPU, GQA native).
- ``chunked``: per request, keys in chunks of --chunk tokens read page by page with an online
               softmax in fp32 (the flash recurrence written in torch ops): scratch one chunk.
- ``padded``:  the previous path (legacy switch): every context gathered padded to [B, Lk_max].

Shapes: the bench config's heads (48 query, 8 KV heads, head_dim 128; all on one rank) and page
size 16. Cases: decode of 1 request at 8,192 + 31 at 64 (the issue's memory case), decode of
32 x 512, and a 512-token prefill chunk after 1,024 cached tokens. Prints best-of --repeats ms
per case and the ratio to ``sdpa`` (same process, same threads).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/attention.py [--dtype float32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from m2serve.model.attention import AttentionMetadata, attend, paged_attention, read_pages
from m2serve.model.batch import KVStorage
from m2serve.model.simple_cache import SimpleKVCache
from m2serve.model.step import RopeCache, StepContext

HQ, HKV, D, S = 48, 8, 128, 16
CASES = {  # name -> (cached tokens per request, new tokens per request)
    "decode 1x8192+31x64": ([8192] + [64] * 31, 1),
    "decode 32x512": ([512] * 32, 1),
    "prefill 512 after 1024": ([1024], 512),
}


def chunked(q: torch.Tensor, kv: KVStorage, step: StepContext, scale: float, chunk: int) -> torch.Tensor:
    """Per request, online softmax over key chunks of ``chunk`` tokens (fp32 accumulators)."""
    qs, ctx = step.host.query_starts, step.host.context_lens
    T, Hq, Dh = q.shape
    out = q.new_empty(T, Hq * Dh)
    pages_per_chunk = chunk // kv.page_size
    for b, L in enumerate(ctx):
        s, e = qs[b], qs[b + 1]
        n = e - s
        pages = step.page_ids[step.page_starts[b]: step.page_starts[b + 1]]
        qb = q[s:e].float().transpose(0, 1).reshape(HKV, Hq // HKV * n, Dh)  # [Hkv, G·n, D]
        qpos = (L - n + torch.arange(n)).repeat(Hq // HKV)                   # [G·n]
        m = torch.full((HKV, qb.shape[1], 1), float("-inf"))
        den = torch.zeros(HKV, qb.shape[1], 1)
        acc = torch.zeros(HKV, qb.shape[1], Dh)
        for p0 in range(0, pages.numel(), pages_per_chunk):
            length = min(chunk, L - p0 * kv.page_size)
            K, V = read_pages(kv, 0, pages[p0: p0 + pages_per_chunk], length, torch.float32)
            sc = qb @ K.permute(1, 2, 0) * scale                             # [Hkv, G·n, c]
            kpos = p0 * kv.page_size + torch.arange(length)
            sc = sc.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            w = torch.exp(sc - m_new)
            corr = torch.exp(m - m_new)
            den = den * corr + w.sum(-1, keepdim=True)
            acc = acc * corr + w @ V.permute(1, 0, 2)
            m = m_new
        o = (acc / den).view(HKV, Hq // HKV, n, Dh).permute(2, 0, 1, 3).reshape(n, Hq * Dh)
        out[s:e] = o.to(q.dtype)
    return out


def _setup(cached: list[int], new: int, dtype: torch.dtype):
    pages = sum(-(-(c + new) // S) for c in cached)
    cache = SimpleKVCache(KVStorage.allocate(1, pages, S, HKV, D, dtype), list(range(pages)))
    g = torch.Generator().manual_seed(0)
    cache.storage.k[0].copy_(torch.randn(cache.storage.k[0].shape, generator=g).to(dtype))
    cache.storage.v[0].copy_(torch.randn(cache.storage.v[0].shape, generator=g).to(dtype))
    for i, c in enumerate(cached):
        cache.batch([(i, [0] * c)])
    batch = cache.batch([(i, [1] * new) for i in range(len(cached))])
    q = torch.randn(batch.tokens.numel(), HQ, D, generator=g).to(dtype)
    return cache.storage, batch, q


def _best_ms(fn, args: tuple, repeats: int) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512, help="keys per chunk of the chunked loop")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    scale = D ** -0.5
    print(f"threads {torch.get_num_threads()}, {args.dtype}, Hq {HQ}, Hkv {HKV}, D {D}, page {S}")
    for name, (cached, new) in CASES.items():
        kv, batch, q = _setup(cached, new, dtype)
        step = StepContext.build(batch, S, RopeCache(64, 1e4), dtype)
        meta = AttentionMetadata.from_batch(batch, S, torch.ones(32))
        ref = attend(q, kv, 0, step, scale)
        got = chunked(q, kv, step, scale, args.chunk)
        err = float((got.float() - ref.float()).abs().max())
        runs = {"sdpa": (attend, (q, kv, 0, step, scale)),
                "chunked": (chunked, (q, kv, step, scale, args.chunk)),
                "padded": (paged_attention, (q, kv, 0, meta, scale))}
        times = {k: _best_ms(fn, a, args.repeats) for k, (fn, a) in runs.items()}
        row = ", ".join(f"{k} {v:.2f} ms ({v / times['sdpa']:.2f}x)" for k, v in times.items())
        print(f"{name}: {row}; chunked vs sdpa max |diff| {err:.1e}")


if __name__ == "__main__":
    main()
