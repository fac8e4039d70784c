"""The router's `prefix` policy for prefill workers (router/prefix_policy.py, router/prefix_tree.py): what text it keys
on, the stated rule (a history's longest match above the threshold unless that worker is much busier; a shared
prefix pulls nobody; else the least loaded), the leaf-first memory sized from the KV capacity and its stated bound,
and the settings that allow it only for prefill."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dsv4_cluster.core import Role
from dsv4_cluster.router.policies import Chooser
from dsv4_cluster.router.prefix_policy import PrefixChooser, PrefixPolicy
from dsv4_cluster.router.prefix_tree import BYTES_PER_NAME, WorkerPrefixes, block_names, prompt_text
from dsv4_cluster.router.settings import RouterSettings
from dsv4_cluster.router.worker import Worker

SYSTEM = "You are a careful assistant who answers in one sentence. " * 8      # 8 x 57 chars: 7 whole blocks
BLOCK_CHARS = PrefixPolicy().block_chars


def _prefills(n: int) -> list[Worker]:
    return [Worker(Role.PREFILL, f"prefill-{i}", f"http://127.0.0.1:{9000 + i}", "127.0.0.1", 8998 + i)
            for i in range(n)]


def test_the_key_is_the_prompt_text_in_the_order_the_prefill_sees_it():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "hi"}]}]}
    assert prompt_text("/v1/chat/completions", chat) == "<system>S<user>hi"
    assert prompt_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert prompt_text("/generate", {"text": "abc"}) == "abc"
    assert prompt_text("/generate", {"input_ids": [1, 2, 3]}) == "1,2,3"
    names = block_names("x" * (3 * BLOCK_CHARS + 5))
    assert len(names) == 3 and block_names("x" * (2 * BLOCK_CHARS)) == names[:2]     # a chain: prefixes share names
    assert block_names("y" + "x" * (3 * BLOCK_CHARS))[0] != names[0]


def test_a_session_stays_on_the_prefill_that_has_its_history():
    workers, chooser = _prefills(4), Chooser("prefix")
    history = SYSTEM
    first = chooser.choose(workers, history)
    for turn in range(5):
        history += f" user turn {turn}: tell me more about page {turn}." * 3
        assert chooser.choose(workers, history) is first          # each turn resends a growing history


def test_new_prompts_spread_over_the_least_loaded_and_a_busy_owner_is_passed_over():
    workers = _prefills(3)
    chooser = PrefixChooser(PrefixPolicy(threshold=0.5, balance_abs=4))
    seen = {chooser.choose(workers, f"{i} " + "unrelated text " * 30).name for i in range(3)}
    assert seen == {w.name for w in workers}                      # all loads equal: round robin among the least
    history = SYSTEM + " question A" * 20
    owner = chooser.choose(workers, history)
    history += " and a follow-up" * 10
    assert chooser.choose(workers, history) is owner              # its history: the same prefill
    owner.in_flight = 5                                            # 5 more than the least loaded: too busy
    history += " and another" * 10
    other = chooser.choose(workers, history)
    assert other is not owner and other.load == 0
    history += " and a third" * 10
    assert chooser.choose(workers, history) is other              # the longest history is there now
    other.in_flight, owner.in_flight = 4, 6                        # other within balance_abs of the idle third
    history += " and a fourth" * 10
    assert chooser.choose(workers, history) is other
    other.in_flight = 5                                            # past it: the idle third, which holds none of it
    third = chooser.choose(workers, history + " and a fifth" * 10)
    assert third not in (owner, other) and third.load == 0
    assert chooser.choose(workers, "z" * 20) in workers           # shorter than a block: least loaded, not remembered


def test_a_shared_system_prompt_draws_new_sessions_only_within_its_tighter_balance():
    workers, chooser = _prefills(4), Chooser("prefix")           # balance_abs 2, shared_balance_abs 1

    def session(s: int) -> str:
        return SYSTEM + f"<user>session {s}: " + "my own question " * 12

    first = chooser.choose(workers, session(0))
    assert chooser.choose(workers, session(1)) is first           # all idle: the one that holds the system prompt
    first.in_flight = 2                                            # past shared_balance_abs, within balance_abs
    new = chooser.choose(workers, session(2))
    assert new is not first and new.load == 0                      # the shared prefix does not queue it behind
    new.in_flight = 1
    assert chooser.choose(workers, session(3)) is new             # warm and within 1: before an idle cold one
    again = session(0) + "<assistant>an answer<user>more " * 4
    assert chooser.choose(workers, again) is first                 # a history follows its holder within balance_abs


def test_a_small_shared_part_is_below_the_threshold():
    workers = _prefills(2)
    chooser = PrefixChooser(PrefixPolicy(threshold=0.5))
    owner = chooser.choose(workers, SYSTEM)
    workers[1 - workers.index(owner)].in_flight = 0
    owner.in_flight = 1                                            # owner a little busier
    long_tail = SYSTEM[:BLOCK_CHARS * 2] + "a different conversation " * 40   # 2 shared blocks of ~17
    assert chooser.choose(workers, long_tail) is not owner


def test_the_memory_evicts_least_recently_used_leaves_first():
    tree = WorkerPrefixes(capacity=4)
    a, b = block_names("a" * 3 * BLOCK_CHARS), block_names("b" * 3 * BLOCK_CHARS)
    tree.add(a)
    assert tree.match(a) == 3
    tree.add(b)                                                    # 6 names into 4: a's two deepest go, its root stays
    assert len(tree) == 4 and tree.match(b) == 3 and tree.match(a) == 1
    shared = "s" * 2 * BLOCK_CHARS
    tree = WorkerPrefixes(capacity=5)
    x, y, z = (block_names(shared + c * 2 * BLOCK_CHARS) for c in "xyz")
    tree.add(x)
    tree.add(y)                                                    # 2 shared + 2 + 2 = 6 names: x's leaf goes first
    assert len(tree) == 5 and tree.match(x) == 3 and tree.match(y) == 4
    tree.add(x)                                                    # x used again: y's leaf is the oldest now
    tree.add(z)
    assert tree.match(z) == 4 and tree.match(x) == 3 and tree.match(y) == 2   # the shared root outlives them all


def test_the_memory_is_sized_from_the_workers_kv_capacity_and_its_bound_holds():
    import tracemalloc

    policy, worker = PrefixPolicy(), _prefills(1)[0]
    chooser = PrefixChooser(policy)
    assert chooser.tree(worker).capacity == policy.max_names_per_worker     # until /server_info said
    worker.kv_tokens = 32_768
    assert chooser.tree(worker).capacity == 32_768 * 4 // 64 == 2048       # tokens x chars per token / block chars
    for i in range(40):
        chooser.choose([worker], f"{i:04d}" + "prompt text " * 500)        # ~94 blocks each: 3,760 names into 2,048
    assert chooser.names() == 2048 and len(chooser.index.nodes) == 2048
    worker.kv_tokens = None                                                # sized by the cap alone
    tracemalloc.start()
    big = PrefixChooser(PrefixPolicy(max_names_per_worker=20_000))
    for i in range(200):
        big.choose([worker], f"{i:04d}" + "other text " * 1000)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"{used / big.names():.0f} B per name")
    assert big.names() == 20_000 and used / big.names() <= BYTES_PER_NAME   # the bound docs/router.md states


def test_prefix_is_a_prefill_policy_only():
    workers = {"model_name": "dsv4-tiny",
               "prefill": [{"name": "p", "url": "http://127.0.0.1:1", "bootstrap_host": "127.0.0.1"}],
               "decode": [{"name": "d", "url": "http://127.0.0.1:2"}]}
    assert RouterSettings(**workers, policy={"prefill": "prefix"}).policy.prefill == "prefix"
    with pytest.raises(ValidationError, match="decode policy 'prefix' is for prefill workers"):
        RouterSettings(**workers, policy={"decode": "prefix"})


def test_a_prefills_load_ends_when_its_leg_does():
    """The stream goes on at the decode after P answered: P's in-flight count (its load for least_load, power_of_two
    and prefix) drops then, and P is part of the request no more (losing it ends nothing), the decode's at release;
    either way each count drops once."""
    from dsv4_cluster.router.worker import Pair

    p, d = _prefills(1)[0], Worker(Role.DECODE, "decode-0", "http://127.0.0.1:9100")
    pair = Pair(p, d)
    assert (p.in_flight, d.in_flight) == (1, 1)
    pair.prefill_finished()
    pair.prefill_finished()
    assert (p.in_flight, d.in_flight) == (0, 1) and pair not in p.pairs and pair in d.pairs
    pair.release()
    pair.release()
    assert (p.in_flight, d.in_flight) == (0, 0) and pair not in p.pairs
    other = Pair(p, d)
    other.release()                                   # P never answered (failed, aborted): counted down at release
    assert (p.in_flight, d.in_flight) == (0, 0)


def test_the_health_checks_read_each_prefills_kv_capacity_for_the_prefix_policy():
    from dsv4_cluster.router.app import build_app
    from tests.helpers import wait_for
    from tests.servers import StubThread, UvicornThread, bound_socket

    with StubThread("prefill", bound_socket()) as p, StubThread("decode", bound_socket()) as d:
        settings = RouterSettings(model_name="stub", policy={"prefill": "prefix"}, health_check_interval_s=0.1,
                                  prefill=[{"name": "p", "url": p.url, "bootstrap_host": "127.0.0.1"}],
                                  decode=[{"name": "d", "url": d.url}])
        app = build_app(settings)
        with UvicornThread(app):
            state = app.api.state.router
            wait_for(lambda: state.pool.prefill[0].kv_tokens, 5, "the prefill's /server_info read")
            assert state.pool.prefill[0].kv_tokens == 1 << 20 and state.pool.decode[0].kv_tokens is None
            chooser = state.pool.chooser(Role.PREFILL).state
            assert chooser.tree(state.pool.prefill[0]).capacity == min(
                settings.policy.prefix.max_names_per_worker, (1 << 20) * 4 // 64)


def test_a_prefill_whose_server_info_hangs_stays_healthy_and_the_memory_keeps_its_cap():
    import asyncio
    import time

    from fastapi import FastAPI

    from dsv4_cluster.router.app import build_app
    from tests.servers import UvicornThread

    bare = FastAPI()                                   # /health answers, /server_info outlasts the check's timeout
    bare.get("/health")(lambda: {})

    @bare.get("/server_info")
    async def server_info():
        await asyncio.sleep(1)
        return {"max_total_num_tokens": 4096}

    with UvicornThread(bare) as worker:
        settings = RouterSettings(model_name="stub", policy={"prefill": "prefix"}, health_check_interval_s=0.1,
                                  health_check_timeout_s=0.2, health_failures_to_unhealthy=1,
                                  prefill=[{"name": "p", "url": worker.url, "bootstrap_host": "127.0.0.1"}],
                                  decode=[{"name": "d", "url": worker.url}])
        app = build_app(settings)
        with UvicornThread(app):
            state = app.api.state.router
            prefill = state.pool.prefill[0]
            time.sleep(1.0)                            # several rounds, each asking /server_info again
            assert prefill.healthy and prefill.health_failures == 0 and prefill.kv_tokens is None
            assert state.pool.chooser(Role.PREFILL).state.tree(prefill).capacity == \
                settings.policy.prefix.max_names_per_worker


def test_the_memory_stays_a_consistent_radix_tree_under_random_prompts():
    """Many workers, small capacities, prompts that share prefixes at random depths: every set stays prefix-closed
    and within its capacity, and the index's holders and child counts are exactly what the sets hold."""
    import random

    from dsv4_cluster.router.prefix_tree import PrefixIndex

    rng = random.Random(7)
    index = PrefixIndex()
    trees = [WorkerPrefixes(capacity, index, 1 << i) for i, capacity in enumerate((5, 9, 17, 40))]
    stems = ["".join(rng.choices("ab", k=BLOCK_CHARS * 4)) for _ in range(3)]
    for _ in range(400):
        text = rng.choice(stems)[:BLOCK_CHARS * rng.randint(0, 4)] + "".join(rng.choices("abc", k=BLOCK_CHARS * 6))
        names = block_names(text[:BLOCK_CHARS * rng.randint(1, 10)])
        rng.choice(trees).add(names)
        for tree in trees:
            own = tree._own
            assert len(own) <= tree.capacity
            for name, (_, kids, parent) in own.items():
                assert parent is None or parent in own                       # prefix-closed
                assert kids == sum(1 for e in own.values() if e[2] == name)  # its children here
        held = {}
        for tree in trees:
            for name in tree._own:
                held[name] = held.get(name, 0) | tree._bit
        assert {n: node[0] for n, node in index.nodes.items()} == held
        parents = {}
        for tree in trees:
            for name, (_, _, parent) in tree._own.items():
                parents[name] = parent
        for name, node in index.nodes.items():                               # distinct children over all sets
            assert node[1] == sum(1 for child, parent in parents.items() if parent == name)
