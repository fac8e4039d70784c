"""The KV pool's page allocator: free pages as runs of consecutive pages, handed out as few runs as possible.

A request's KV moves as one NIXL descriptor per run (`transfer.page_runs`), each costing a fixed few
microseconds; a free list in arrival order scatters under churn. `alloc(n)` takes the shortest free run that holds
n (best fit), else whole runs longest first; freed pages coalesce. Every operation is O(free runs) list work (a
followed allocation, below, O((its runs + free runs) x log free runs) besides).
"""

from __future__ import annotations

import bisect
import itertools


class PageAllocatorError(ValueError):
    """A page released twice, or one outside the pool: a bug in the caller, never a client's doing."""


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._starts: list[int] = [0] if num_pages else []   # sorted starts of the free runs
        self._length: dict[int, int] = {0: num_pages} if num_pages else {}
        self._free = num_pages

    def __len__(self) -> int:
        """Free pages."""
        return self._free

    @property
    def runs(self) -> list[tuple[int, int]]:
        """The free runs, (first page, pages), in page order."""
        return [(s, self._length[s]) for s in self._starts]

    def alloc(self, n: int, follow: list[int] | None = None) -> list[int]:
        """n pages as few runs as the free runs allow (the caller checked `len(self) >= n`); when no free run
        holds n and `follow` gives the other side's pages for the same tokens, broken where those are."""
        if n > self._free:
            raise PageAllocatorError(f"{n} pages asked, {self._free} free (check len() first)")
        if n <= 0:
            return []
        fits = [s for s in self._starts if self._length[s] >= n]
        if fits:
            return self._take(min(fits, key=lambda s: (self._length[s], s)), n)
        if follow is None or len(follow) < n:
            return self._longest_first(n)
        peer_runs = _run_lengths(follow[:n])
        peer = _breaks(peer_runs)
        blind = len(peer | _breaks(self._longest_first_lengths(n))) + 1
        pages = self._follow(peer_runs)
        if len(peer | _breaks(_run_lengths(pages))) + 1 <= blind:    # descriptors: stretches unbroken on both sides
            return pages
        self.release(pages)    # the free runs are the free pages' stretches: as they were before
        return self._longest_first(n)

    def _follow(self, lengths: list[int]) -> list[int]:
        """One free run per piece of `lengths` (the other side's runs, in token order), longest piece first, best
        fit (a length-sorted copy of the free runs: O(pieces x log runs) searches); the pieces no free run then
        holds are split over the longest runs left, in one pass. Returned in token order."""
        by_len = sorted((self._length[s], s) for s in self._starts)
        got: dict[int, list[int]] = {}
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            j = bisect.bisect_left(by_len, (lengths[i], -1))
            if j < len(by_len):
                length, start = by_len.pop(j)
                got[i] = self._take(start, lengths[i])
                if length > lengths[i]:
                    bisect.insort(by_len, (length - lengths[i], start + lengths[i]))
        rest = [i for i in range(len(lengths)) if i not in got]
        pages, k = self._longest_first(sum(lengths[i] for i in rest)), 0
        for i in rest:
            got[i], k = pages[k:k + lengths[i]], k + lengths[i]
        return [p for i in range(len(lengths)) for p in got[i]]

    def _longest_first_lengths(self, n: int) -> list[int]:
        """The pieces `_longest_first(n)` would take, in order (every free run's, if n is more than is free)."""
        out, got = [], 0
        for length in sorted((self._length[s] for s in self._starts), reverse=True):
            out.append(min(n - got, length))
            got += out[-1]
            if got >= n:
                break
        return out

    def _longest_first(self, n: int) -> list[int]:
        pages: list[int] = []
        for start in sorted(self._starts, key=lambda s: (-self._length[s], s)):
            pages += self._take(start, min(n - len(pages), self._length[start]))
            if len(pages) == n:
                break
        return pages

    def runs_for(self, n: int) -> int:
        """How many runs `alloc(n)` would hand out now (0 for n <= 0; the caller checked `len(self) >= n`)."""
        return len(self._longest_first_lengths(n)) if n > 0 else 0

    def take_last(self) -> int:
        """One page from the end of the last free run (kept out of the pool by the caller for good)."""
        if not self._free:
            raise PageAllocatorError("no free page")
        start = self._starts[-1]
        page = start + self._length[start] - 1
        self._remove(start)
        if page > start:
            self._add(start, page - start)
        self._free -= 1
        return page

    def release(self, pages: list[int]) -> None:
        """Give pages back; runs of consecutive pages merge with their free neighbours."""
        runs = _runs(sorted(pages))
        for start, length in runs:          # all checked before any is taken: a refused call changes nothing
            self._check_free(start, length)
        for start, length in runs:
            self._insert(start, length)
            self._free += length

    def _take(self, start: int, n: int) -> list[int]:
        length = self._length[start]
        self._remove(start)
        if length > n:
            self._add(start + n, length - n)
        self._free -= n
        return list(range(start, start + n))

    def _check_free(self, start: int, length: int) -> None:
        if start < 0 or start + length > self.num_pages:
            raise PageAllocatorError(f"pages {start}..{start + length - 1} lie outside the pool of "
                                     f"{self.num_pages} pages")
        i = bisect.bisect_right(self._starts, start + length - 1) - 1
        if i >= 0:
            s = self._starts[i]
            if s + self._length[s] > start:
                raise PageAllocatorError(f"page {max(s, start)} released while it was free (released twice?)")

    def _insert(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i > 0:                                         # merge with the run just before
            prev = self._starts[i - 1]
            if prev + self._length[prev] == start:
                length += self._length[prev]
                self._remove(prev)
                start = prev
        nxt = start + length
        if nxt in self._length:                           # merge with the run just after
            length += self._length[nxt]
            self._remove(nxt)
        self._add(start, length)

    def _add(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._length[start] = length

    def _remove(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._length[start]


def _breaks(run_lengths: list[int]) -> set[int]:
    """The offsets in a request's page list, made of runs of `run_lengths`, where a new run starts (0 not counted)."""
    return set(itertools.accumulate(run_lengths[:-1]))


def _run_lengths(pages: list[int]) -> list[int]:
    return [length for _, length in _runs_in_order(pages)]


def _runs_in_order(pages: list[int]) -> list[tuple[int, int]]:
    """(first, length) of each stretch of consecutive pages, in the list's order (unsorted: a request's pages)."""
    out: list[list[int]] = []
    for p in pages:
        if out and p == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return [(s, n) for s, n in out]


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted pages -> (first, length) of each stretch of consecutive pages; a repeated page is an error."""
    runs = _runs_in_order(pages)
    for (start, length), (nxt, _) in zip(runs, runs[1:]):
        if nxt < start + length:
            raise PageAllocatorError(f"page {nxt} released twice in one call")
    return runs
