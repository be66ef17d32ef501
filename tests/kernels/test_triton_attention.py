"""The Triton paged attention kernel under the interpreter against the torch reference
(model/attention.py ``attend``: per request, its pages gathered and F.scaled_dot_product_attention),
docs/kernels.md §3.

Every case builds a real step (ForwardBatch, KVStorage with random pages handed out in shuffled
order, StepContext) and runs ``attend`` on it; the kernel reads the same pool through the block
tables. fp32: max |diff| <= 1e-5. bf16 (computed in fp32 under the interpreter, stored by a
truncating cast): within one bf16 ulp of the fp32 reference. head_dim 128 throughout; few heads
to keep the interpreter fast.
"""

from __future__ import annotations

import pytest
import torch

from m2serve.kernels.triton.attention import (
    BLOCK_M_DECODE,
    INTERPRETER_SMS,
    SPLIT_MENU,
    choose_splits,
    kv_bytes_read,
    paged_attention,
)
from m2serve.model.attention import attend
from m2serve.model.batch import ForwardBatch, KVStorage
from m2serve.model.step import RopeCache, StepContext

D = 128
FP32_TOL = 1e-5
# the 3.6 interpreter turns a 1-element array into a loop bound (``range(lo, hi)`` in the kernel)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _step(requests: list[tuple[int, int]], page_size: int, Hq: int, Hkv: int, kv_dtype=torch.float32,
          q_dtype=torch.float32, k_scale=1.0, v_scale=1.0, seed=0):
    """A step over ``requests`` = [(cached, new)]: q [T, Hq, D], the KV pool (random everywhere,
    so rows past a context hold garbage the kernel must not see), the batch and its context."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-(c + n) // page_size) for c, n in requests]
    P = sum(n_pages) + 3
    order = torch.randperm(P, generator=g).tolist()
    kv = KVStorage.allocate(1, P, page_size, Hkv, D, kv_dtype, k_scale=[k_scale], v_scale=[v_scale])
    for pool, s in ((kv.k[0], k_scale), (kv.v[0], v_scale)):  # fp8 holds x / scale, as write_kv stores
        pool.copy_(torch.randn(pool.shape, generator=g) / s)
    width = max(n_pages)
    tables, starts, positions, slots = [], [0], [], []
    for (c, n), k in zip(requests, n_pages, strict=True):
        pages, order = order[:k], order[k:]
        tables.append(pages + [0] * (width - k))
        starts.append(starts[-1] + n)
        positions.extend(range(c, c + n))
        slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(c, c + n))
    T = starts[-1]
    batch = ForwardBatch(tokens=torch.zeros(T, dtype=torch.int64), positions=torch.tensor(positions),
                         input_row_offsets=torch.tensor(starts, dtype=torch.int32),
                         slot_mapping=torch.tensor(slots, dtype=torch.int64),
                         block_tables=torch.tensor(tables, dtype=torch.int32),
                         context_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32))
    q = (torch.randn(T, Hq, D, generator=g) * 2).to(q_dtype)
    step = StepContext.build(batch, page_size, RopeCache(64, 1e4), torch.float32)
    return q, kv, batch, step


def _reference(q, kv, step, scale):
    """attend in fp32 over fp32 copies of q and the pool (fp8 pages are dequantised by attend)."""
    ref_kv = kv if kv.k[0].dtype in (torch.float32, torch.float8_e4m3fn) else KVStorage(
        k=[kv.k[0].float()], v=[kv.v[0].float()], page_size=kv.page_size, k_scale=kv.k_scale,
        v_scale=kv.v_scale)
    return attend(q.float(), ref_kv, 0, step, scale).view(q.shape)


def _kernel(q, kv, batch, step, scale, splits=None):
    host = step.host
    return paged_attention(q, kv.k[0], kv.v[0], batch.block_tables, batch.input_row_offsets,
                           batch.context_lens, scale, max_query_len=max(host.query_lens),
                           max_context_len=max(host.context_lens), k_scale=kv.k_scale[0],
                           v_scale=kv.v_scale[0], splits=splits)


def _max_diff(requests, page_size, Hq, Hkv, splits=None, **kw) -> float:
    q, kv, batch, step = _step(requests, page_size, Hq, Hkv, **kw)
    scale = D ** -0.5
    got = _kernel(q, kv, batch, step, scale, splits)
    assert got.shape == q.shape and got.dtype == q.dtype
    return float((got - _reference(q, kv, step, scale)).abs().max())


def test_ragged_decode_batch_one_kv_head_per_rank():
    # decode rows of contexts 1 .. 1,000 tokens (and a request with no new token), page 16,
    # G = 6 (48 / 8 heads at TP 8)
    assert _max_diff([(0, 1), (16, 1), (4, 0), (63, 1), (299, 1), (999, 1)], 16, Hq=6, Hkv=1) <= FP32_TOL


def test_many_requests_find_their_tiles():
    # 37 requests of 1-3 new tokens: programs find their request by binary search over 38 starts
    g = torch.Generator().manual_seed(7)
    requests = [(int(c), int(n)) for c, n in zip(torch.randint(0, 90, (37,), generator=g),
                                                  torch.randint(1, 4, (37,), generator=g))]
    assert _max_diff(requests, 16, Hq=6, Hkv=1) <= FP32_TOL


@pytest.mark.parametrize("page_size", [16, 128])
def test_prefill_chunk_mid_page_after_a_cached_prefix_mixed_with_decode_rows(page_size):
    # one launch: a chunk of 40 starting at position 37 (mid-page), a decode row over 200, a fresh
    # 21-token prompt; several KV heads per rank (12 / 2: the 48 / 8 heads at TP 4)
    assert _max_diff([(37, 40), (199, 1), (0, 21)], page_size, Hq=12, Hkv=2) <= FP32_TOL


def test_fp8_kv_with_scales():
    # e4m3 pages read as e4m3 · k_scale / v_scale; decode and a chunk after a cached prefix
    assert _max_diff([(50, 1), (30, 19)], 16, Hq=6, Hkv=1, kv_dtype=torch.float8_e4m3fn,
                     k_scale=0.25, v_scale=3.0) <= FP32_TOL


def test_split_k_over_a_few_thousand_tokens():
    # two decode rows over 3,000 and 2,048 tokens: few programs, so the launcher splits the keys;
    # forced split counts (also on a prefill chunk, whose tile rows see different key ranges) agree
    requests = [(2999, 1), (2047, 1)]
    assert choose_splits(2, 1, 3000, INTERPRETER_SMS) > 1
    assert _max_diff(requests, 64, Hq=6, Hkv=1) <= FP32_TOL
    assert _max_diff([(700, 1), (100, 5)], 128, Hq=6, Hkv=1, splits=4) <= FP32_TOL


def test_bf16_within_one_bf16_ulp_of_the_fp32_reference():
    q, kv, batch, step = _step([(37, 12), (90, 1)], 16, Hq=6, Hkv=2, kv_dtype=torch.bfloat16,
                               q_dtype=torch.bfloat16)
    got = _kernel(q, kv, batch, step, D ** -0.5)
    ref = _reference(q, kv, step, D ** -0.5)
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)  # bf16: 8-bit significand
    assert got.dtype == torch.bfloat16
    assert bool(((got.float() - ref).abs() <= ulp + 1e-6).all())


def test_split_choice_and_bandwidth_bytes_follow_their_rules():
    # H200: 132 SMs, so up to 528 programs; 48 / 8 heads on one rank (8 KV heads)
    assert choose_splits(64, 8, 100_000, 132) == 1  # 512 programs already
    assert choose_splits(32, 8, 8_192, 132) == 2  # batch 32: 256 programs
    assert choose_splits(1, 8, 100_000, 132) == 64  # batch 1: 8 programs, menu maximum
    assert choose_splits(1, 8, 1_500, 132) == 2  # short context: >= 512 keys per split
    assert choose_splits(4, 8, 100_000, 132) == 16 and SPLIT_MENU[0] == 1
    assert kv_bytes_read([10, 20], 8, 128, torch.bfloat16) == 2 * 30 * 8 * 128 * 2
    assert kv_bytes_read([10], 8, 128, torch.float8_e4m3fn) == 2 * 10 * 8 * 128


def test_bad_arguments_are_named(monkeypatch):
    q, kv, batch, step = _step([(3, 2)], 16, Hq=6, Hkv=2)
    args = (kv.k[0], kv.v[0], batch.block_tables, batch.input_row_offsets, batch.context_lens, 0.1)
    kw = dict(max_query_len=2, max_context_len=5)
    with pytest.raises(ValueError, match="q heads 5 must be a multiple of KV heads 2"):
        paged_attention(q[:, :5], *args, **kw)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        paged_attention(q, *args[:4], batch.context_lens.long(), 0.1, **kw)
    with pytest.raises(ValueError, match="splits 3 not in"):
        paged_attention(q, *args, splits=3, **kw)
    with pytest.raises(ValueError, match="KV pages torch.bfloat16"):
        paged_attention(q, kv.k[0].bfloat16(), kv.v[0].bfloat16(), *args[2:], **kw)
    assert BLOCK_M_DECODE >= 16  # tl.dot's smallest M
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on CUDA: fp32 activations are the torch path's
    with pytest.raises(ValueError, match="bfloat16 activations on CUDA"):
        paged_attention(q, *args, **kw)
