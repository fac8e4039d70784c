"""The KV pool's page allocator: no page handed out twice, every page back after churn, and runs that stay long
under churn (what keeps a request's KV transfer at a few NIXL descriptors in a long-running pool)."""

from __future__ import annotations

import random

import pytest

from dsv4_cluster.workers.kv.pool import KVPool, PoolExhausted, PoolLayout
from dsv4_cluster.workers.kv.page_alloc import PageAllocator, PageAllocatorError
from dsv4_cluster.workers.kv.transfer import page_runs


def _runs(pages: list[int]) -> int:
    return len(page_runs(pages, pages))


def test_best_fit_takes_the_shortest_run_that_holds_the_request():
    a = PageAllocator(20)
    held = a.alloc(20)
    a.release(held[2:5])        # run of 3
    a.release(held[8:16])       # run of 8
    assert a.runs == [(2, 3), (8, 8)]
    assert a.alloc(3) == [2, 3, 4]          # the run of 3, not the front of the run of 8
    assert a.alloc(5) == [8, 9, 10, 11, 12]
    assert a.runs == [(13, 3)]


def test_a_request_larger_than_every_run_takes_the_longest_runs_first():
    a = PageAllocator(30)
    held = a.alloc(30)
    for lo, hi in ((0, 2), (5, 12), (20, 24)):
        a.release(held[lo:hi])
    got = a.alloc(10)
    assert got == [5, 6, 7, 8, 9, 10, 11, 20, 21, 22] and _runs(got) == 2


def test_freed_neighbours_merge_back_into_one_run():
    a = PageAllocator(16)
    pages = [a.alloc(4) for _ in range(4)]
    for i in (1, 3, 0, 2):
        a.release(pages[i])
    assert a.runs == [(0, 16)] and len(a) == 16


def test_bad_releases_are_refused_with_the_page_named():
    a = PageAllocator(8)
    got = a.alloc(4)
    a.release(got[:2])
    with pytest.raises(PageAllocatorError, match="page 0 released while it was free"):
        a.release([0])
    with pytest.raises(PageAllocatorError, match="released twice in one call"):
        a.release([2, 2])
    with pytest.raises(PageAllocatorError, match="outside the pool"):
        a.release([8])
    with pytest.raises(PageAllocatorError, match="page 4 released while it was free"):
        a.release([3, 4])                   # 3 is held, 4 is free: nothing of the call is taken
    with pytest.raises(PageAllocatorError, match="7 pages asked, 6 free"):
        a.alloc(7)
    assert len(a) == 6                      # the refused calls changed nothing


def churn(a: PageAllocator, cycles: int, seed: int, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128)) -> list[list[int]]:
    """Random allocate/free of mixed sizes, the pool kept between ~half and nearly full; returns what is held."""
    rng, held = random.Random(seed), []
    for _ in range(cycles):
        n = rng.choice(sizes)
        if held and (rng.random() < 0.45 or n > len(a)):
            a.release(held.pop(rng.randrange(len(held))))
        elif n <= len(a):
            held.append(a.alloc(n))
    return held


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_churn_hands_no_page_twice_and_gives_every_page_back(seed):
    a = PageAllocator(2048)
    held = churn(a, 5000, seed)
    flat = [p for pages in held for p in pages]
    assert len(flat) == len(set(flat))                      # no page in two requests
    assert len(a) + len(flat) == 2048                       # none lost, none made up
    free = {p for s, n in a.runs for p in range(s, s + n)}
    assert free.isdisjoint(flat) and len(free) == len(a)
    for pages in held:
        a.release(pages)
    assert a.runs == [(0, 2048)]


def test_runs_stay_long_under_churn_where_a_deque_free_list_scatters():
    """After 5,000 cycles, requests of 8 to 128 pages come back as ~1 run; the old deque (pages returned in
    release order, taken from the front) hands the same requests dozens of runs."""
    a = PageAllocator(2048)
    held = churn(a, 5000, seed=7)
    for pages in held[: len(held) // 2]:                    # room for the probes
        a.release(pages)
    probes = [a.alloc(n) for n in (8, 32, 128) if n <= len(a)]
    assert len(probes) == 3 and max(_runs(p) for p in probes) <= 2

    from collections import deque
    rng, dq, held_dq = random.Random(7), deque(range(2048)), []
    for _ in range(5000):                                    # the same workload on a deque free list
        n = rng.choice((1, 2, 3, 4, 8, 16, 32, 64, 128))
        if held_dq and (rng.random() < 0.45 or n > len(dq)):
            dq.extend(held_dq.pop(rng.randrange(len(held_dq))))
        elif n <= len(dq):
            held_dq.append([dq.popleft() for _ in range(n)])
    for pages in held_dq[: len(held_dq) // 2]:
        dq.extend(pages)
    assert _runs([dq.popleft() for _ in range(128)]) > 10


def test_the_pool_uses_the_allocator_and_keeps_its_pad_page_out():
    layout = PoolLayout(page_size=4, num_pages=10, n_layers=1, head_dim=8, index_dim=4, ratio=4, dtype="float32")
    pool = KVPool(layout)
    assert pool.capacity_tokens == 40
    pad = pool.reserve_pad_page()
    assert pad == 9 and pool.capacity_tokens == 36   # capacity = used + available + evictable, as SGLang counts it
    got = pool.alloc(4 * 9)
    assert sorted(got) == list(range(9)) and pool.used_tokens == pool.capacity_tokens
    with pytest.raises(PoolExhausted):
        pool.alloc(1)
    pool.release(got)
    assert pool.used_tokens == 0 and pad not in pool.alloc(4 * 9)


def _churned(seed: int) -> PageAllocator:
    """A pool of 1,024 pages held at ~90% by requests of arbitrary sizes (the KV bench's churn)."""
    a, rng, held = PageAllocator(1024), random.Random(seed), []
    for _ in range(3000):
        n = rng.randint(1, 128)
        if held and (1024 - len(a) + n > 920 or rng.random() < 0.3):
            a.release(held.pop(rng.randrange(len(held))))
        elif n <= len(a):
            held.append(a.alloc(n))
    return a


def test_following_the_peers_pages_breaks_only_where_the_peer_does():
    """Both pools churned: a request no free run holds, allocated blind, moves in the breaks of both sides;
    allocated following the peer's pages, in no more descriptors, and in the peer's runs alone where this side's
    free runs can hold those (a constructed case: free runs 6, 5, 4 here, the peer's 4 + 6 + 5)."""
    total_blind = total_followed = 0
    for seed in range(8):
        src, dst = _churned(seed), _churned(100 + seed)
        longest = max(length for _, length in src.runs)
        n = min(len(src), len(dst), 2 * longest)
        assert n > longest                                   # no free run on this side holds it
        peer = dst.alloc(n)
        blind = src.alloc(n)
        src.release(blind)
        followed = src.alloc(n, follow=peer)
        assert len(followed) == n and len(set(followed)) == n and set(followed).isdisjoint(p for s, k in src.runs
                                                                                          for p in range(s, s + k))
        descs, descs_blind = len(page_runs(followed, peer)), len(page_runs(blind, peer))
        assert _runs(peer) <= descs <= descs_blind
        total_blind, total_followed = total_blind + descs_blind, total_followed + descs
    assert total_followed < total_blind

    a = PageAllocator(20)
    held = a.alloc(20)
    for lo, hi in ((0, 6), (8, 13), (15, 19)):
        a.release(held[lo:hi])
    peer = [*range(100, 104), *range(40, 46), *range(60, 65)]
    blind = a.alloc(15)
    a.release(blind)
    got = a.alloc(15, follow=peer)
    assert got == [15, 16, 17, 18, 0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12]
    assert len(page_runs(got, peer)) == 3 < len(page_runs(blind, peer)) == 5


def test_following_never_moves_in_more_descriptors_than_not_following():
    """Random pools and peer layouts: following the peer is kept only where it is no worse than the blind
    allocation (it can be: the peer's runs 10, 7, 4 against free runs that fit them badly), else undone."""
    for seed in range(2000):
        rng = random.Random(seed)
        size = rng.randint(8, 40)
        a = PageAllocator(size)
        a.release([p for p in a.alloc(size) if rng.random() < 0.6])
        n = rng.randint(2, max(2, len(a)))
        if len(a) < 2 or any(k >= n for _, k in a.runs):
            continue
        peer: list[int] = []
        while len(peer) < n:
            start = rng.randrange(1000) * 100
            peer += range(start, start + rng.randint(1, n))
        peer, before = peer[:n], a.runs
        blind = a.alloc(n)
        a.release(blind)
        assert a.runs == before
        got = a.alloc(n, follow=peer)
        assert sorted(got) == sorted(set(got)) and len(got) == n
        assert len(page_runs(got, peer)) <= len(page_runs(blind, peer)), seed


def test_a_peer_run_no_free_run_holds_is_split_and_nothing_is_lost():
    a = PageAllocator(20)
    held = a.alloc(20)
    for lo, hi in ((0, 3), (5, 9), (12, 14)):
        a.release(held[lo:hi])                               # free runs of 3, 4, 2
    got = a.alloc(8, follow=[100, 101, 102, 50, 51, 52, 53, 54])   # peer runs of 3 and 5: the 5 fits nowhere
    assert got[:3] == [0, 1, 2] and sorted(got[3:]) == [5, 6, 7, 8, 12] and len(a) == 1
    a.release(got)
    assert a.alloc(9) and len(a) == 0
