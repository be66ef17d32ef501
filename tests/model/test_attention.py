"""Paged attention through block tables / slot mapping (docs/model.md §3 steps 6-7, §6)."""

from __future__ import annotations

import torch

from m2serve.model.attention import (
    AttentionMetadata,
    GatherScratch,
    MiniMaxM2Attention,
    paged_attention,
    write_kv,
)
from m2serve.model.batch import KVStorage
from m2serve.model.load import load_model
from m2serve.model.norm import rms_norm
from m2serve.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from m2serve.model.simple_cache import SimpleKVCache
from m2serve.model.step import RopeCache, StepContext


def _attention(Hq=6, Hkv=2, D=16, H=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ident = lambda x: x  # noqa: E731
    a = MiniMaxM2Attention(H, Hq, Hkv, D, Hq * D, Hkv * D, D ** -0.5, 1e-6, ident)
    for p in a.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() == 2 else 1))
    return a


def test_cache_holds_roped_normed_k_and_raw_v():
    # docs/model.md §6: K in the cache = RoPE(k_norm(k_proj(h))), V = v_proj(h)
    a = _attention()
    cache = SimpleKVCache(KVStorage.allocate(1, 4, 4, 2, 16, torch.float32), [2, 0, 3, 1])
    batch = cache.batch([("s", [1, 2, 3, 4, 5, 6])])
    inv = rope_inv_freq(8, 1e4)
    step = StepContext.build(batch, 4, RopeCache(8, 1e4), torch.float32)
    h = torch.randn(6, 32)
    a(h, step, cache.storage, 0)
    k = rms_norm(h @ a.k_proj.weight.T, a.k_norm.weight, 1e-6).view(6, 2, 16)
    cos, sin = rope_cos_sin(torch.arange(6), inv)
    flat_k = cache.storage.k[0].view(-1, 2, 16)[batch.slot_mapping]
    flat_v = cache.storage.v[0].view(-1, 2, 16)[batch.slot_mapping]
    torch.testing.assert_close(flat_k, apply_rope(k, cos, sin))
    torch.testing.assert_close(flat_v, (h @ a.v_proj.weight.T).view(6, 2, 16))


def test_gqa_query_head_reads_kv_head_h_over_group():
    # docs/model.md §6: query head h uses KV head h // (Hq/Hkv); softmax over causal keys
    Hq, Hkv, D, T = 6, 2, 8, 5
    kv = KVStorage.allocate(1, 2, 4, Hkv, D, torch.float32)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    q = torch.randn(T, Hq, D, generator=g)
    cache = SimpleKVCache(kv, [1, 0])  # pages in reverse order
    batch = cache.batch([("s", list(range(T)))], return_n_logits=T)
    meta = AttentionMetadata.from_batch(batch, 4, rope_inv_freq(4, 1e4))
    write_kv(kv, 0, k, v, meta.slot_mapping)
    out = paged_attention(q, kv, 0, meta, 0.3).view(T, Hq, D)
    for h in range(Hq):
        kh, vh = k[:, h // 3], v[:, h // 3]
        s = (q[:, h] @ kh.T) * 0.3
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        torch.testing.assert_close(out[:, h], torch.softmax(s, -1) @ vh)


def test_reused_gather_scratch_matches_per_head_reference_fp8_and_shrinking_batches():
    # docs/model.md §3 step 7 + model/batch.py fp8 contract: reads are e4m3 x scale; a scratch buffer
    # reused by a larger step first, then a smaller mixed step, leaks nothing between steps
    Hq, Hkv, D, S = 6, 2, 8, 4
    kv = KVStorage.allocate(1, 8, S, Hkv, D, torch.float8_e4m3fn, k_scale=[0.25], v_scale=[3.0])
    g = torch.Generator().manual_seed(5)
    scratch = GatherScratch()
    cache = SimpleKVCache(kv, [5, 2, 7, 0, 3, 1, 6, 4])
    steps = [[("a", list(range(9))), ("b", list(range(6))), ("c", list(range(5)))],
             [("a", [1]), ("b", [2, 3, 4])]]  # B·Lk 27, then 20
    hist = {"a": [], "b": [], "c": []}  # per request: (k, v) rows as the cache holds them (dequantised)
    for step in steps:
        batch = cache.batch(step)
        T = batch.tokens.numel()
        k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
        q = torch.randn(T, Hq, D, generator=g)
        meta = AttentionMetadata.from_batch(batch, S, rope_inv_freq(4, 1e4), scratch)
        write_kv(kv, 0, k, v, meta.slot_mapping)
        out = paged_attention(q, kv, 0, meta, 0.3).view(T, Hq, D)
        row = 0
        for seq, new in step:
            n = len(new)
            kq = (k[row:row + n] / 0.25).to(torch.float8_e4m3fn).float() * 0.25
            vq = (v[row:row + n] / 3.0).to(torch.float8_e4m3fn).float() * 3.0
            hist[seq].append((kq, vq))
            K, V = (torch.cat([x[i] for x in hist[seq]]) for i in (0, 1))
            L = K.shape[0]
            causal = torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None]
            for h in range(Hq):
                s = (q[row:row + n, h] @ K[:, h // 3].T * 0.3).masked_fill(causal, float("-inf"))
                torch.testing.assert_close(out[row:row + n, h], torch.softmax(s, -1) @ V[:, h // 3])
            row += n


def test_fp8_kv_cache_stores_scaled_e4m3():
    # model/batch.py contract: fp8 pages hold e4m3(x / scale); reads multiply by the scale
    kv = KVStorage.allocate(1, 1, 4, 1, 4, torch.float8_e4m3fn, k_scale=[0.5], v_scale=[2.0])
    k = torch.tensor([[[1.0, -3.0, 100.0, 0.1]]])
    v = torch.tensor([[[8.0, 1.0, -2.5, 600.0]]])
    write_kv(kv, 0, k, v, torch.tensor([2]))
    assert torch.equal(kv.k[0][0, 2].float(), (k[0] / 0.5).to(torch.float8_e4m3fn).float())
    assert torch.equal(kv.v[0][0, 2].float(), (v[0] / 2.0).to(torch.float8_e4m3fn).float())


def test_mixed_prefill_chunk_and_decode_in_one_step(tiny_random_dir):
    import transformers  # a test extra (pyproject.toml); only the oracle tests need it
    # docs/serving.md §6: chunked prefill and decodes share a step; each request sees all its pages
    ours = load_model(tiny_random_dir)
    ref = transformers.MiniMaxM2ForCausalLM.from_pretrained(tiny_random_dir, dtype=torch.float32).eval()
    a, b = [3, 14, 15, 92, 65, 35, 89, 79, 32], [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28, 74]
    cache = SimpleKVCache.create(ours.config, num_pages=16, page_size=4)
    ours(cache.batch([("a", a[:-1]), ("b", b[:5])]), cache.storage)
    out = ours(cache.batch([("a", a[-1:]), ("b", b[5:])], return_n_logits=10**6), cache.storage)
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([a])).logits[0, -1:], ref(torch.tensor([b])).logits[0, 5:]])
    assert out.shape == want.shape
    torch.testing.assert_close(out, want.float(), rtol=1e-4, atol=1e-4)


def test_bf16_and_fp8_kv_forward_close_to_fp32_oracle(tiny_random_dir):
    # docs/model.md §6: bf16 paths against the fp32 oracle with a loose bound only
    ref = load_model(tiny_random_dir)
    fp32_logits = None
    for dtype, kv_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                            (torch.bfloat16, torch.float8_e4m3fn)):
        m = ref if dtype == torch.float32 else load_model(tiny_random_dir, dtype=dtype)
        cache = SimpleKVCache.create(m.config, num_pages=8, page_size=8, dtype=kv_dtype)
        out = m(cache.batch([("s", list(range(1, 20)))]), cache.storage)
        assert out.dtype == torch.float32
        if fp32_logits is None:
            fp32_logits = out
        else:
            rel = (out - fp32_logits).abs().max() / fp32_logits.abs().max()
            assert rel < 0.1, f"{dtype}/{kv_dtype}: relative error {rel:.3f}"
