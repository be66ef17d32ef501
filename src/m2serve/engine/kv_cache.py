"""Paged KV-cache bookkeeping: pages, reference counts, block tables and the prefix cache.

The tensors themselves are a `KVStorage` (model/batch.py); this module only decides which page ids
each request owns (docs/serving.md §6–§7). Design after vLLM v1's block pool:

* A page holds ``page_size`` consecutive tokens of one sequence. A request's block table is the
  list of its page ids in order; token at position p lives in slot ``table[p // S] * S + p % S``.
* Pages are reference-counted. A page whose count drops to 0 goes to the free queue; if it is a
  full page registered in the prefix cache it stays there (and keeps its hash) until it is reused
  for something else, so a later request can still hit it.
* Prefix caching shares FULL pages only, keyed by a hash chain: hash_i = H(hash_{i-1}, tokens of
  page i). A prefix that ends mid-page therefore reuses the full pages before it and recomputes
  the rest, which keeps it exact (docs/serving.md §7, last paragraph).
* Eviction is LRU over the free queue: freed pages are appended at the tail (a request's pages in
  reverse order, so its tail pages, the least likely to be shared, leave first); pages without a
  hash go to the head, as nothing can reuse them. Allocation pops from the head.

Legend: S page size (tokens per page).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROOT_HASH = b""


def hash_page(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full page: sha256(parent hash ‖ token ids as int64 little-endian).

    ``parent`` is the previous page's hash (``ROOT_HASH`` for the first page). A 32-byte digest
    makes accidental collisions (and so wrong KV reuse) practically impossible.
    """
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


@dataclass(slots=True)
class Page:
    """One KV page: its id (index into the KVStorage pool), reference count and prefix hash."""

    page_id: int
    ref_cnt: int = 0
    hash: bytes | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters: ``queries`` = prompt tokens looked up, ``hits`` = tokens found."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    requests_hit: int = 0


@dataclass(slots=True)
class KVCacheManager:
    """Allocator of KV pages for requests (block tables, refcounts, prefix cache, LRU eviction).

    num_pages: P, pages in the pool; page_size: S tokens per page;
    enable_prefix_caching: register full pages by hash and reuse them across requests;
    lookahead: tokens AFTER a page that its hash also covers (0; 1 with an EAGLE-3 draft, whose K/V
    at position p are computed from token p + 1: a page is then registered once that token is
    computed and reused only by a request whose token after the page is the same,
    docs/serving.md §14).

    Requests are identified by ``request_id``; the manager keeps each one's block table and
    the hashes of its full pages. Methods never raise for lack of memory: ``allocate`` returns
    False and the scheduler preempts.
    """

    num_pages: int
    page_size: int
    enable_prefix_caching: bool = True
    lookahead: int = 0
    pages: list[Page] = field(default_factory=list)
    free_queue: OrderedDict[int, None] = field(default_factory=OrderedDict)
    cached: dict[bytes, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    page_hashes: dict[str, list[bytes]] = field(default_factory=dict)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.num_pages <= 0:
            raise ValueError(f"num_kv_pages={self.num_pages} must be positive")
        if self.page_size <= 0:
            raise ValueError(f"kv_cache_page_size={self.page_size} must be positive")
        self.pages = [Page(i) for i in range(self.num_pages)]
        self.free_queue = OrderedDict((i, None) for i in range(self.num_pages))

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages with no owner (including cached pages that may still be hit)."""
        return len(self.free_queue)

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one request."""
        return self.num_pages - len(self.free_queue)

    def block_table(self, request_id: str) -> list[int]:
        """The request's page ids in order (empty if it holds none)."""
        return self.block_tables.get(request_id, [])

    def pages_needed(self, num_tokens: int) -> int:
        """ceil(num_tokens / S)."""
        return -(-num_tokens // self.page_size)

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full pages that prefixes ``token_ids``.

        At most ``(len - 1) // S`` pages are matched so that at least one token is left to
        compute (its logits give the next token). Returns (page ids, their hashes); does not
        take references (``allocate`` does) and does not update the stats.
        """
        if not self.enable_prefix_caching:
            return [], []
        S, a = self.page_size, self.lookahead
        hits: list[int] = []
        hashes: list[bytes] = []
        parent = ROOT_HASH
        for i in range((len(token_ids) - 1) // S):
            if (i + 1) * S + a > len(token_ids):   # the tokens after the page are not known yet
                break
            h = hash_page(parent, token_ids[i * S:(i + 1) * S + a])
            page_id = self.cached.get(h)
            if page_id is None:
                break
            hits.append(page_id)
            hashes.append(h)
            parent = h
        return hits, hashes

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup: ``num_query_tokens`` looked up, ``num_hit_tokens`` found."""
        self.stats.requests += 1
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens
        self.stats.requests_hit += num_hit_tokens > 0

    def cache_full_pages(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's pages that are now full and computed in the prefix cache.

        ``token_ids`` are the request's tokens (prompt + output), ``num_computed`` how many of
        them have K/V written. A page whose hash is already cached (another request computed the
        same content concurrently) is left unregistered; the cached copy stays canonical.
        """
        if not self.enable_prefix_caching:
            return
        S, a = self.page_size, self.lookahead
        table = self.block_tables[request_id]
        hashes = self.page_hashes.setdefault(request_id, [])
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), max(num_computed - a, 0) // S):   # the lookahead tokens computed too
            h = hash_page(parent, token_ids[i * S:(i + 1) * S + a])
            hashes.append(h)
            page = self.pages[table[i]]
            if page.hash is None and h not in self.cached:
                page.hash = h
                self.cached[h] = page.page_id
            parent = h

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int, hit_pages: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` of ``num_tokens`` tokens with the cached ``hit_pages`` would
        succeed: the pages beyond the request's table and the hits must come from the free queue,
        less the hits that sit in it (a hit held by a running request is shared and costs none)."""
        table = self.block_tables.get(request_id, [])
        hits_free = sum(1 for p in hit_pages if self.pages[p].ref_cnt == 0)
        need = self.pages_needed(num_tokens) - len(table) - len(hit_pages)
        return need <= 0 or need <= len(self.free_queue) - hits_free

    def allocate(self, request_id: str, num_tokens: int,
                 prefix: tuple[list[int], list[bytes]] | None = None) -> bool:
        """Grow the request's block table to hold ``num_tokens`` tokens in total.

        ``prefix`` (first allocation only): cached pages from ``find_cached_prefix``, which are
        taken (refcount + 1, removed from the free queue) before new pages are popped.
        Returns False, changing nothing, when the free queue cannot supply the pages.
        """
        table = self.block_tables.get(request_id, [])
        hit_pages, hit_hashes = prefix if prefix else ([], [])
        if not self.can_allocate(request_id, num_tokens, hit_pages):
            return False
        need = self.pages_needed(num_tokens) - len(table) - len(hit_pages)
        if request_id not in self.block_tables:
            self.block_tables[request_id] = table
        for p in hit_pages:
            page = self.pages[p]
            if page.ref_cnt == 0:
                del self.free_queue[p]
            page.ref_cnt += 1
            table.append(p)
        if hit_hashes:
            self.page_hashes[request_id] = list(hit_hashes)
        for _ in range(max(need, 0)):
            table.append(self._pop_free())
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's pages past the first ``pages_needed(num_tokens)`` (the tail a
        speculative step allocated for drafts that were rejected, docs/serving.md §13). Those pages
        hold no computed full page, so they carry no prefix hash and go to the head of the free
        queue. A table already that short is left as is."""
        table = self.block_tables.get(request_id)
        keep = self.pages_needed(num_tokens)
        if table is None or len(table) <= keep:
            return
        self._release(table[keep:])
        del table[keep:]

    def free(self, request_id: str) -> None:
        """Drop the request's references; pages reaching 0 join the free queue (tail first)."""
        table = self.block_tables.pop(request_id, [])
        self.page_hashes.pop(request_id, None)
        self._release(table)

    def _release(self, pages: list[int]) -> None:
        """Drop one reference to each of ``pages``, tail first; a page reaching 0 joins the free
        queue, at its head when it carries no prefix hash (nothing to reuse), else at its tail."""
        for p in reversed(pages):
            page = self.pages[p]
            page.ref_cnt -= 1
            if page.ref_cnt == 0:
                self.free_queue[p] = None
                if page.hash is None:
                    self.free_queue.move_to_end(p, last=False)

    def _pop_free(self) -> int:
        p, _ = self.free_queue.popitem(last=False)
        page = self.pages[p]
        if page.hash is not None:
            if self.cached.get(page.hash) == p:
                del self.cached[page.hash]
            page.hash = None
        page.ref_cnt = 1
        return p
