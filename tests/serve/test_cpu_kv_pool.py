"""The default CPU server's KV pool (issue 16 item 10): sized by min(4 GiB, max_batch_size x
max_length) instead of free RAM, the same on every start, and printed in the banner in pages and
GiB. Expected figures are derived by hand from tiny-random's config (L 2, Hkv 4, D 128, 4096 tokens)."""

from __future__ import annotations

from m2serve.serve.cli import banner
from m2serve.serve.llm import LLM

OPTS = {"host": "127.0.0.1", "port": 8000}


def test_default_cpu_pool_is_the_rule_on_every_start(tiny_random_dir):
    page_bytes = 128 * 2 * 2 * 4 * 128 * 2            # S x (K, V) x L x Hkv x D x bf16 = 512 KiB
    want = min(4 * 2**30, 256 * (4096 // 128) * page_bytes) // page_bytes   # = 8192 pages, 4 GiB
    starts = [LLM(str(tiny_random_dir), dtype="float32") for _ in range(2)]
    assert [llm.engine.stats.kv_pages_total for llm in starts] == [want, want]
    line = banner(starts[0], OPTS)
    assert f"KV {want} pages x 128 tokens (bfloat16, {want * page_bytes / 2**30:.2f} GiB)" in line, line


def test_explicit_cpu_pool_size(tiny_random_dir):
    page_bytes = 128 * 2 * 2 * 4 * 128 * 2
    llm = LLM(str(tiny_random_dir), dtype="float32", kv_cache_memory_gib=0.25, max_length=2048)
    assert llm.engine.stats.kv_pages_total == 2**30 // 4 // page_bytes == 512
    assert "512 pages x 128 tokens (bfloat16, 0.25 GiB)" in banner(llm, OPTS)
