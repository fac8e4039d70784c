"""The `prefix` policy's memory: an approximate radix tree of the prompts each prefill worker has seen.

The router does not tokenize, so, like SGLang's `cache_aware` router, it works on the prompt's text: the text is cut
into blocks of `block_chars` characters and block i is named by a hash chained over blocks 0..i (Python's own 64-bit
hash: the names live in this process only), so a set of names is a radix tree of prompts (a name is in the set iff
that whole prefix was sent). A worker's match for a prompt is how many of its leading blocks the worker's set holds.

- Each worker's set (`WorkerPrefixes`) holds at most `capacity` names and evicts like a prefill's own radix cache:
  least recently used *leaves* first, so a prompt's root blocks outlive its tail and "holds block i" keeps meaning
  "holds blocks 0..i" (what the matching relies on). Its capacity comes from the worker's KV capacity
  (`prefix_policy.PrefixPolicy.names_for`).
- One index over all workers (`PrefixIndex`: name -> which workers hold it, as a bit mask, and how many distinct
  continuations of it any worker holds) finds the longest match among the eligible workers with a binary search over
  the prompt's blocks, and tells a prefix that several prompts went on from (a shared system prompt) from the end of
  one earlier prompt (a session's history): `PrefixIndex.extends_a_leaf`.

Memory: one name costs about `BYTES_PER_NAME` bytes (its entry in one worker's set, its node in the index; measured
with tracemalloc, `tests/router/test_router_prefix.py`), so the memory is bounded by `BYTES_PER_NAME` x the sum of the
workers' capacities, each at most `PrefixPolicy.max_names_per_worker`.
"""

from __future__ import annotations

import heapq
from typing import Any

BYTES_PER_NAME = 400      # measured: ~330 B for a name one worker holds (set entry + index node); stated with margin


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The text a request's prompt starts with, as the prefill will see it in order (chat: each message's role and
    content; completions: the prompt; /generate: the text or the token ids)."""
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):     # OpenAI content parts: their text, in order
                    content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                parts.append(f"<{m.get('role')}>{content}")
        return "".join(parts)
    prompt = body.get("prompt") if path.endswith("/completions") else body.get("text", body.get("input_ids"))
    if isinstance(prompt, list):                  # a batch: its first item (the pair serves the whole batch)
        prompt = prompt[0] if prompt and isinstance(prompt[0], (str, list)) else prompt
    return prompt if isinstance(prompt, str) else ",".join(map(str, prompt or ()))


def block_names(text: str, block_chars: int = 64) -> list[int]:
    """The chained names of the text's whole blocks (a last partial block is not named: it is rarely shared)."""
    names, h = [], 0
    for i in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[i:i + block_chars]))
        names.append(h)
    return names


class PrefixIndex:
    """name -> [bit mask of the workers holding it, how many distinct child names any worker holds]. A child implies
    its parent (every worker's set is prefix-closed), so a node lives while any worker holds it."""

    def __init__(self) -> None:
        self.nodes: dict[int, list[int]] = {}

    def hold(self, name: int, parent: int | None, bit: int) -> None:
        node = self.nodes.get(name)
        if node is None:
            self.nodes[name] = [bit, 0]
            if parent is not None:
                self.nodes[parent][1] += 1
        else:
            node[0] |= bit

    def drop(self, name: int, parent: int | None, bit: int) -> None:
        node = self.nodes[name]
        node[0] &= ~bit
        if not node[0]:
            del self.nodes[name]
            if parent is not None:
                self.nodes[parent][1] -= 1

    def longest(self, names: list[int], mask: int) -> int:
        """How many leading names some worker in `mask` holds (binary search: a worker holding name i holds 0..i)."""
        lo, hi, nodes = 0, len(names), self.nodes
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = nodes.get(names[mid - 1])
            if node is not None and node[0] & mask:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def holders(self, name: int) -> int:
        node = self.nodes.get(name)
        return node[0] if node is not None else 0

    def extends_a_leaf(self, names: list[int], matched: int) -> bool:
        """Whether the prompt's matched part ends where no other prompt went on (its continuation aside): the end of
        one earlier prompt, such as a session's previous turn. False when other prompts branched off there: a prefix
        they share (a system prompt), which says nothing about where this prompt's own part was seen."""
        children = self.nodes[names[matched - 1]][1]
        if matched < len(names) and names[matched] in self.nodes:
            children -= 1                      # the prompt's own next block, held by a worker not eligible now
        return children == 0


class WorkerPrefixes:
    """One worker's set of block names, at most `capacity`, least recently used leaf out first; kept in step with the
    shared `index` under the worker's `bit`."""

    def __init__(self, capacity: int, index: PrefixIndex | None = None, bit: int = 1) -> None:
        self.capacity = capacity
        self._index, self._bit = index or PrefixIndex(), bit
        self._own: dict[int, list] = {}              # name -> [last use, children held here, parent name]
        self._leaves: list[tuple[int, int]] = []     # (last use, name) of leaves; entries go stale, skipped on pop
        self._clock = 0

    def __len__(self) -> int:
        return len(self._own)

    def match(self, names: list[int]) -> int:
        """How many of the leading names are in the set (a chain: once one is missing, the rest are too)."""
        lo, hi, own = 0, len(names), self._own
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if names[mid - 1] in own:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, names: list[int]) -> None:
        """The worker now holds this whole prompt: every name used now, then leaves evicted down to `capacity`."""
        if not names:
            return
        self._clock += 1
        now, own, parent = self._clock, self._own, None
        for name in names:
            entry = own.get(name)
            if entry is None:
                own[name] = [now, 0, parent]
                if parent is not None:
                    own[parent][1] += 1
                self._index.hold(name, parent, self._bit)
            else:
                entry[0] = now
            parent = name
        if own[parent][1] == 0:
            heapq.heappush(self._leaves, (now, parent))
        self._evict()

    def _evict(self) -> None:
        own, leaves = self._own, self._leaves
        while len(own) > self.capacity:
            used, name = heapq.heappop(leaves)
            entry = own.get(name)
            if entry is None or entry[1] or entry[0] != used:
                continue                                   # stale: gone, no longer a leaf, or used since
            del own[name]
            parent = entry[2]
            self._index.drop(name, parent, self._bit)
            if parent is not None:
                up = own[parent]
                up[1] -= 1
                if up[1] == 0:                             # a leaf now, with its own last use
                    heapq.heappush(leaves, (up[0], parent))
        if len(leaves) > 2 * len(own) + 64:                # drop the stale entries
            self._leaves = [(e[0], n) for n, e in own.items() if e[1] == 0]
            heapq.heapify(self._leaves)
