"""The embedded prefill's prefix cache: a radix tree over whole pages of prompt tokens, their KV pages shared by
reference, least-recently-used pages evicted when the pool runs short (SGLang's RadixCache, in pages).

Lifecycle of a prompt (engine thread only; prefill/engine.py):
1. `match(tokens)`: the longest run of the prompt's whole pages already in the tree (never all of the prompt: its
   last token is always computed, for the first output token's logits). Those pages become the request's first
   pages and are locked (a locked page is never evicted); prefill starts after them.
2. Once the prompt's KV is computed, `insert(tokens, pages, locked)` puts its whole pages in the tree (a page whose
   tokens are there already under another page stays the request's own) and locks the whole path instead.
3. When the request ends (its KV sent, or it failed), `unlock` frees the lock; the request's own pages that the
   tree does not hold go back to the pool (`owns`).
4. `evict(pages)` frees unlocked leaves, least recently used first, until that many pages are back in the pool
   (the allocator asks when it is short); `flush()` evicts every unlocked page (`/flush_cache`).
A page's KV depends only on the tokens up to its end, so a matched page holds exactly what prefill would compute.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque

from .kv_pool import KVPool


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

    # -- 4. evict ---------------------------------------------------------------------------------
    def evict(self, pages: int) -> int:
        """Free unlocked leaves, least recently used first, until `pages` pages went back to the pool (or none is
        left to evict); returns how many did."""
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
