"""Exact allocator tests in the style of vLLM's tests/v1/core: page ids, refcounts, LRU order.

Spec: issue 4 item 1, docs/serving.md §7 (prefix caching shares full pages only, chained hashes).
Expected values are derived by hand from the allocation rules in engine/kv_cache.py's docstring.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from m2serve.engine.kv_cache import ROOT_HASH, KVCacheManager, hash_page


def refcounts(kv: KVCacheManager) -> list[int]:
    return [p.ref_cnt for p in kv.pages]


def test_hash_chain_is_sha256_of_parent_and_tokens():
    # docs/serving.md §7: hash_i = H(hash_{i-1}, page tokens); independent sha256 here.
    tokens = [1, 2, 3, 4]
    want = hashlib.sha256(b"" + np.array(tokens, dtype="<i8").tobytes()).digest()
    assert hash_page(ROOT_HASH, tokens) == want
    h2 = hash_page(want, [5, 6, 7, 8])
    assert h2 == hashlib.sha256(want + np.array([5, 6, 7, 8], dtype="<i8").tobytes()).digest()
    # Same page content under a different parent is a different key.
    assert hash_page(ROOT_HASH, [5, 6, 7, 8]) != h2


def test_allocate_pops_lowest_ids_first_and_frees_in_reverse():
    kv = KVCacheManager(num_pages=6, page_size=4, enable_prefix_caching=False)
    assert kv.allocate("a", 9)              # 3 pages
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.allocate("b", 4)
    assert kv.block_table("b") == [3]
    assert kv.allocate("a", 12)             # still 3 pages: no change
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.allocate("a", 13)             # grows by one page
    assert kv.block_table("a") == [0, 1, 2, 4]
    assert refcounts(kv) == [1, 1, 1, 1, 1, 0]
    assert kv.num_free_pages == 1 and kv.num_used_pages == 5
    assert not kv.allocate("b", 4 * 3)      # needs 2 more, 1 free: refused, nothing changes
    assert kv.block_table("b") == [3]
    assert kv.num_free_pages == 1
    kv.free("a")
    # Unhashed pages go to the head of the free queue; freed in reverse order: 4, 2, 1, 0
    # each moved to the head, so the queue reads 0, 1, 2, 4, then the never-used 5.
    assert list(kv.free_queue) == [0, 1, 2, 4, 5]
    assert refcounts(kv) == [0, 0, 0, 1, 0, 0]
    kv.free("b")
    assert kv.num_free_pages == 6


def test_prefix_hit_shares_full_pages_and_refcounts():
    S = 4
    kv = KVCacheManager(num_pages=8, page_size=S)
    a = list(range(10))                     # pages [0..3] [4..7] [8, 9]
    assert kv.allocate("a", len(a))
    assert kv.block_table("a") == [0, 1, 2]
    kv.cache_full_pages("a", a, num_computed=10)
    assert len(kv.cached) == 2              # the partial third page is never cached
    assert kv.pages[2].hash is None

    b = list(range(8)) + [99, 98, 97]       # shares two full pages with a
    hits, hashes = kv.find_cached_prefix(b)
    assert hits == [0, 1]
    assert hashes == [hash_page(ROOT_HASH, a[:4]), hash_page(hash_page(ROOT_HASH, a[:4]), a[4:8])]
    assert kv.allocate("b", len(b), (hits, hashes))
    assert kv.block_table("b") == [0, 1, 3]
    assert refcounts(kv)[:4] == [2, 2, 1, 1]

    # Prefix ending mid-page: only the first full page matches.
    c = list(range(6)) + [50, 51, 52]
    assert kv.find_cached_prefix(c)[0] == [0]
    # At least one token is left to compute: an exact 2-page prompt matches only 1 page.
    assert kv.find_cached_prefix(list(range(8)))[0] == [0]
    # A different first page breaks the chain even if page 2 is identical.
    assert kv.find_cached_prefix([7, 1, 2, 3, 4, 5, 6, 7, 0])[0] == []


def test_lookahead_hash_covers_the_token_after_the_page():
    """With an EAGLE-3 draft (lookahead 1, docs/serving.md §14) a page's hash also covers the token
    after it: registered only once that token is computed, reused only when it matches."""
    S = 4
    kv = KVCacheManager(num_pages=8, page_size=S, lookahead=1)
    a = list(range(10))
    assert kv.allocate("a", len(a))
    kv.cache_full_pages("a", a, num_computed=8)    # token 8 (after page 2) not computed: page 2 waits
    assert len(kv.cached) == 1 and kv.pages[1].hash is None
    kv.cache_full_pages("a", a, num_computed=9)
    assert len(kv.cached) == 2
    h1 = hash_page(ROOT_HASH, a[:5])
    assert kv.pages[0].hash == h1 and kv.pages[1].hash == hash_page(h1, a[4:9])
    assert kv.find_cached_prefix(a)[0] == [0, 1]
    assert kv.find_cached_prefix(list(range(8)) + [77, 78])[0] == [0]   # another token after page 2
    assert kv.find_cached_prefix(list(range(9)))[0] == [0, 1]
    assert kv.find_cached_prefix(list(range(8)))[0] == [0]


def test_freed_cached_pages_stay_hittable_and_are_evicted_lru():
    S = 2
    kv = KVCacheManager(num_pages=6, page_size=S)
    x, y = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]
    assert kv.allocate("x", 5) and kv.block_table("x") == [0, 1, 2]
    kv.cache_full_pages("x", x, 5)
    assert kv.allocate("y", 5) and kv.block_table("y") == [3, 4, 5]
    kv.cache_full_pages("y", y, 5)
    kv.free("x")   # reverse order: 2 (unhashed -> head), then 1, 0 (hashed -> tail)
    kv.free("y")   # 5 -> head, then 4, 3 -> tail
    assert list(kv.free_queue) == [5, 2, 1, 0, 4, 3]
    assert kv.num_free_pages == 6

    # A hit on a free cached page takes it out of the queue (refcount 1), counted as free.
    hits = kv.find_cached_prefix([1, 2, 3, 4, 0])
    assert hits[0] == [0, 1]
    assert kv.allocate("z", 5, hits)
    assert kv.block_table("z") == [0, 1, 5]
    assert list(kv.free_queue) == [2, 4, 3]

    # New allocations evict LRU: unhashed 2 first, then y's tail page 4 (its hash forgotten).
    h4 = kv.pages[4].hash
    assert kv.allocate("w", 4) and kv.block_table("w") == [2, 4]
    assert h4 not in kv.cached and kv.pages[4].hash is None
    assert kv.find_cached_prefix(y)[0] == [3]   # y's first page survives
    kv.free("z")
    kv.free("w")
    assert kv.num_free_pages == 6 and all(r == 0 for r in refcounts(kv))


def test_allocate_counts_free_cached_hits_against_capacity():
    kv = KVCacheManager(num_pages=3, page_size=2)
    assert kv.allocate("x", 3)
    kv.cache_full_pages("x", [1, 2, 3], 3)
    kv.free("x")                                 # queue: 1 (unhashed), 0 (cached)
    hits = kv.find_cached_prefix([1, 2, 3, 4, 5, 6, 7])
    assert hits[0] == [0]
    # 7 tokens = 4 pages > 3: refused without touching the hit page.
    assert not kv.allocate("y", 7, hits)
    assert kv.pages[0].ref_cnt == 0 and kv.num_free_pages == 3
    assert kv.allocate("y", 6, hits) and kv.block_table("y") == [0, 1, 2]


def test_duplicate_content_keeps_first_cached_copy():
    kv = KVCacheManager(num_pages=4, page_size=2)
    assert kv.allocate("a", 3) and kv.allocate("b", 3)
    kv.cache_full_pages("a", [1, 2, 3], 3)
    kv.cache_full_pages("b", [1, 2, 4], 3)      # same first page computed twice
    assert kv.find_cached_prefix([1, 2, 9])[0] == [0]
    assert kv.pages[2].hash is None
    kv.free("a")
    kv.free("b")
    assert kv.num_free_pages == 4


@pytest.mark.parametrize("num_pages,page_size", [(0, 4), (4, 0)])
def test_bad_sizes_name_the_field(num_pages, page_size):
    with pytest.raises(ValueError, match="num_kv_pages|kv_cache_page_size"):
        KVCacheManager(num_pages=num_pages, page_size=page_size)
