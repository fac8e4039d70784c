"""The embedded prefill's prefix cache: a radix tree over whole pages of prompt tokens, their KV pages shared by
reference, least-recently-used pages evicted when the pool runs short (SGLang's RadixCache, in pages).

Lifecycle of a prompt (engine thread only; prefill/engine.py):
1. `match(tokens)`: the longest run of the prompt's whole pages already in the tree (never all of the prompt: its
   last token is always computed, for the first output token's logits). Those pages become the request's first
   pages and are locked (a locked page is never evicted); prefill starts after them. `allocate(tokens)` does this
   and gives the rest of the prompt new pages, making room first (4. below).
2. Once the prompt's KV is computed, `insert(tokens, pages, locked)` puts its whole pages in the tree (a page whose
   tokens are there already under another page stays the request's own) and locks the whole path instead.
3. When the request ends (its KV sent, or it failed), `unlock` frees the lock; the request's own pages that the
   tree does not hold go back to the pool (`owns`).
4. `evict(pages)` frees unlocked pages until that many are back in the pool, as long runs of consecutive free
   pages: among the least recently used ones, those in the longest stretches of free-or-evictable pages first
   (`allocate` asks when the pool is short or its free pages are scattered); `flush()` evicts every unlocked page
   (`/flush_cache`).
A page's KV depends only on the tokens up to its end, so a matched page holds exactly what prefill would compute.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque

from .pool import KVPool


class RadixNode:
    __slots__ = ("key", "page", "parent", "children", "refs", "last_used")

    def __init__(self, key: tuple[int, ...], page: int, parent: RadixNode | None):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.refs = 0
        self.last_used = time.monotonic()


class PrefixCache:
    HIT_WINDOW = 256   # requests the hit rate is taken over (SGLang reports a recent rate, not a lifetime one)

    def __init__(self, pool: KVPool):
        self.pool, self.page = pool, pool.layout.page_size
        self.root = RadixNode((), -1, None)
        self._pages: dict[int, RadixNode] = {}           # page -> the node holding it
        self._unlocked = 0                               # pages held by nodes nobody locks (evictable)
        self.cached_tokens_total = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.HIT_WINDOW)   # (prompt tokens, cached tokens)
        pool.evictable_pages = lambda: self._unlocked    # the pool's used tokens leave evictable pages out

    # -- 1. match ---------------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> tuple[list[int], list[RadixNode]]:
        """(pages, locked nodes) of the longest whole-page prefix of `tokens` in the tree, leaving at least one
        token to compute; the nodes are locked until `unlock`."""
        node, nodes = self.root, []
        for i in range((len(tokens) - 1) // self.page):
            node = node.children.get(tuple(tokens[i * self.page:(i + 1) * self.page]))
            if node is None:
                break
            nodes.append(node)
        self._lock(nodes)
        return [n.page for n in nodes], nodes

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one prompt that was admitted with `cached_tokens` of it from the tree (the hit rate, the total)."""
        self.cached_tokens_total += cached_tokens
        self._recent.append((prompt_tokens, cached_tokens))

    # -- 2. insert --------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int], locked: list[RadixNode]) -> list[RadixNode]:
        """Put the prompt's whole pages (`pages[i]` holds tokens i*P .. (i+1)*P-1) in the tree; returns the
        locked path, which replaces `locked` (the caller's lock from `match`)."""
        node, path = self.root, []
        for i in range(min(len(tokens) // self.page, len(pages))):
            key = tuple(tokens[i * self.page:(i + 1) * self.page])
            child = node.children.get(key)
            if child is None:
                child = RadixNode(key, pages[i], node)
                node.children[key] = child
                self._pages[child.page] = child
                self._unlocked += 1                      # unlocked until _lock below
            path.append(child)
            node = child
        self._lock(path)
        self.unlock(locked)
        return path

    # -- 3. unlock / ownership --------------------------------------------------------------------
    def _lock(self, nodes: list[RadixNode]) -> None:
        now = time.monotonic()
        for n in nodes:
            if n.refs == 0:
                self._unlocked -= 1
            n.refs += 1
            n.last_used = now

    def unlock(self, nodes: list[RadixNode]) -> None:
        for n in nodes:
            n.refs -= 1
            if n.refs == 0:
                self._unlocked += 1

    def owns(self, page: int) -> bool:
        return page in self._pages

    def holders(self, page: int) -> int:
        """How many requests hold a page of the tree locked (0 for a page the tree does not hold)."""
        node = self._pages.get(page)
        return node.refs if node is not None else 0

    @property
    def evictable_pages(self) -> int:
        return self._unlocked

    @property
    def cached_pages(self) -> int:
        return len(self._pages)

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens over the last HIT_WINDOW prompts (0 before any)."""
        prompt = sum(p for p, _ in self._recent)
        return sum(c for _, c in self._recent) / prompt if prompt else 0.0

    # -- 1 + room + new pages ---------------------------------------------------------------------
    MAX_RUNS = 2          # a request whose new pages would come in more runs makes room for one run first
    RESERVE_SHARE = 16    # evicting, free 1/16 of the pool beyond what the request needs (fewer, longer runs)
    COLD_FACTOR = 4       # evict among the least recently used unlocked pages, 4x as many as asked (at most half)

    def allocate(self, tokens: list[int], follow: list[int] | None = None
                 ) -> tuple[list[int], list[int], list[RadixNode]] | None:
        """A prompt's pages: (all of them, its own new ones, the locked nodes of its cached prefix), or None when
        the pool cannot hold it even after evicting (nothing is held then). When the pool is short, or its free
        pages would give the request more than `MAX_RUNS` runs, cached pages are evicted first: what is short plus
        a reserve of 1/`RESERVE_SHARE` of the pool, as long runs (`evict`), so that the request's KV moves to
        decode in few NIXL descriptors (without this, a full cache handed out the scattered single pages of the
        many prompts it evicted: p50 23 runs in bench/kv_cache_churn.py, against 1 now). `follow`: the decode's
        pages for the whole prompt when it reserved them first (`PageAllocator.alloc`)."""
        cached, nodes = self.match(tokens)
        rest = len(tokens) - len(cached) * self.page
        need = self.pool.pages_for(rest)
        reserve = self.pool.layout.num_pages // self.RESERVE_SHARE
        short = need - self.pool.free_pages
        if short > 0:
            self.evict(short + reserve)
        elif self.pool.runs_for(rest) > self.MAX_RUNS:
            self.evict(max(need, reserve))
        if need > self.pool.free_pages:
            self.unlock(nodes)
            return None
        own = self.pool.alloc(rest, follow[len(cached):] if follow is not None else None)
        return cached + own, own, nodes

    # -- 4. evict ---------------------------------------------------------------------------------
    def evict(self, pages: int) -> int:
        """Free at least `pages` pages (or every unlocked one), as long runs of consecutive free pages: among the
        least recently used unlocked pages (`COLD_FACTOR` times what is asked), those in the longest stretches of
        pages that are free or cold go first, each with its subtree; returns how many pages went back."""
        freed = self._evict_stretches(pages)
        if freed < pages:
            freed += self._evict_lru(pages - freed)
        return freed

    def _evict_stretches(self, pages: int) -> int:
        unlocked = sorted((n for n in self._pages.values() if n.refs == 0), key=lambda n: n.last_used)
        if not unlocked:
            return 0
        # the cold set: COLD_FACTOR times what is asked, but never into the more recently used half unless asked
        cold_pages = max(pages, min(self.COLD_FACTOR * pages, len(unlocked) // 2))
        cutoff = unlocked[min(len(unlocked), cold_pages) - 1].last_used
        # a node is never older than its descendants (a lock takes the whole path): the cold set holds whole subtrees
        cold = {n.page for n in unlocked if n.last_used <= cutoff}
        n_pages = self.pool.layout.num_pages
        free = bytearray(n_pages)
        for start, length in self.pool.free_runs:
            free[start:start + length] = b"\x01" * length
        stretches, start = [], None      # (pages, first) of each stretch of free-or-cold pages holding a cold one
        for p in range(n_pages + 1):
            ok = p < n_pages and (free[p] or p in cold)
            if ok and start is None:
                start = p
            elif not ok and start is not None:
                if any(q in cold for q in range(start, p)):
                    stretches.append((p - start, start))
                start = None
        freed = 0
        for length, first in sorted(stretches, key=lambda st: (-st[0], st[1])):
            for p in range(first, first + length):
                node = self._pages.get(p) if p in cold else None
                if node is not None:
                    freed += self._drop_subtree(node)
                if freed >= pages:
                    return freed
        return freed

    def _drop_subtree(self, node: RadixNode) -> int:
        """Evict an unlocked node and everything under it (all unlocked: a lock takes the whole path)."""
        del node.parent.children[node.key]
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            del self._pages[n.page]
            out.append(n.page)
        self._unlocked -= len(out)
        self.pool.release(out)
        return len(out)

    def _evict_lru(self, pages: int) -> int:
        """Free unlocked leaves, least recently used first, until `pages` went back (or none is left)."""
        order = itertools.count()
        heap = [(n.last_used, next(order), n) for n in self._pages.values() if not n.children and n.refs == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < pages:
            _, _, node = heapq.heappop(heap)
            del node.parent.children[node.key]
            del self._pages[node.page]
            self._unlocked -= 1
            freed.append(node.page)
            parent = node.parent
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, next(order), parent))
        self.pool.release(freed)
        return len(freed)

    def flush(self) -> int:
        """Evict every unlocked page; returns how many."""
        return self.evict(len(self._pages))
