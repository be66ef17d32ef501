"""The default CPU server's KV pool (issue 16 item 10, issue 26 item 8): sized by min(4 GiB,
min(max_batch_size, 8) x max_length) instead of free RAM, the same on every start, printed in the
banner in pages and GiB, and resident (zero-filled) from the start, so serving does not grow RSS by
touching pages. Expected figures are derived by hand from tiny-random's config (L 2, Hkv 4, D 128,
4096 tokens)."""

from __future__ import annotations

import gc

import pytest
import torch

from m2serve.serve.cli import banner
from m2serve.serve.llm import LLM


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

OPTS = {"host": "127.0.0.1", "port": 8000}


@pytest.mark.slow  # loads the engine with the default pool
def test_default_cpu_pool_is_the_rule_on_every_start(tiny_random_dir):
    page_bytes = 128 * 2 * 2 * 4 * 128 * 2            # S x (K, V) x L x Hkv x D x bf16 = 512 KiB
    want = min(4 * 2**30, 8 * (4096 // 128) * page_bytes) // page_bytes   # = 256 pages, 128 MiB
    pages = []
    for _ in range(2):
        llm = LLM(str(tiny_random_dir), dtype="float32")
        pages.append(llm.engine.stats.kv_pages_total)
        line = banner(llm, OPTS)
        del llm
        gc.collect()
    assert pages == [want, want]
    assert f"KV {want} pages x 128 tokens (bfloat16, {want * page_bytes / 2**30:.2f} GiB)" in line, line


def test_explicit_cpu_pool_size(tiny_random_dir):
    page_bytes = 128 * 2 * 2 * 4 * 128 * 2
    llm = LLM(str(tiny_random_dir), dtype="float32", kv_cache_memory_gib=0.25, max_length=2048)
    assert llm.engine.stats.kv_pages_total == 2**30 // 4 // page_bytes == 512
    assert "512 pages x 128 tokens (bfloat16, 0.25 GiB)" in banner(llm, OPTS)


def test_pool_is_resident_and_zero_from_the_start(tiny_random_dir):
    """Every page of the pool is resident once the engine has started: writing all of it afterwards
    grows RSS by (almost) nothing, where an untouched pool would grow it by 256 MiB (measured this
    way rather than as RSS growth during the start, which memory freed by earlier tests and reused
    by the allocator hides); and every page reads zero before any request."""
    page_bytes = 128 * 2 * 2 * 4 * 128 * 2
    llm = LLM(str(tiny_random_dir), dtype="float32", kv_cache_memory_gib=0.25, max_length=2048)
    assert llm.engine.stats.kv_pages_total * page_bytes == 2**28
    storage = llm.engine.runner.kv_storage
    assert all(not bool(t.any()) for t in (*storage.k, *storage.v))
    before = _rss_bytes()
    for t in (*storage.k, *storage.v):
        t.fill_(1)  # a write faults in any page that was not resident yet
    grown = _rss_bytes() - before
    assert grown < 2**24, f"writing the pool grew RSS by {grown / 2**20:.0f} MiB: it was not resident"
    assert sum(t.numel() * t.element_size() for t in (*storage.k, *storage.v)) == 2**28
    assert all(t.dtype == torch.bfloat16 for t in storage.k)


def test_server_caps_onednn_shape_caches_unless_set():
    from m2serve.serve.cli import bound_onednn_caches

    env: dict[str, str] = {}
    bound_onednn_caches(env)
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
    env = {"LRU_CACHE_CAPACITY": "1024"}
    bound_onednn_caches(env)
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "1024"}
