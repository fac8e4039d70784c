"""The router's `prefix` policy for prefill workers (router/prefix_tree.py): what text it keys on, the stated rule
(longest match above the threshold unless that worker is much busier; else the least loaded), the LRU memory,
and the settings that allow it only for prefill."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dsv4_cluster.core import Role
from dsv4_cluster.router.policies import Chooser
from dsv4_cluster.router.prefix_tree import BLOCK_CHARS, PrefixChooser, WorkerPrefixes, block_names, prompt_text
from dsv4_cluster.router.settings import RouterSettings
from dsv4_cluster.router.worker import Worker

SYSTEM = "You are a careful assistant who answers in one sentence. " * 8      # 8 x 57 chars: 7 whole blocks


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
    chooser = PrefixChooser(threshold=0.5, balance_abs=4)
    seen = {chooser.choose(workers, f"{i} " + "unrelated text " * 30).name for i in range(3)}
    assert seen == {w.name for w in workers}                      # all loads equal: round robin among the least
    owner = chooser.choose(workers, SYSTEM + " question A")
    assert chooser.choose(workers, SYSTEM + " question B") is owner   # shares > half of the blocks
    owner.in_flight = 5                                            # 5 more than the least loaded: too busy
    other = chooser.choose(workers, SYSTEM + " question C")
    assert other is not owner and other.load == 0
    assert chooser.choose(workers, SYSTEM + " question D") is other   # both hold it now: the less loaded
    other.in_flight, owner.in_flight = 6, 4                        # owner within balance_abs of the idle third
    assert chooser.choose(workers, SYSTEM + " question E") is owner
    assert chooser.choose(workers, "z" * 20) in workers           # shorter than a block: least loaded, not remembered


def test_a_small_shared_part_is_below_the_threshold():
    workers = _prefills(2)
    chooser = PrefixChooser(threshold=0.5)
    owner = chooser.choose(workers, SYSTEM)
    workers[1 - workers.index(owner)].in_flight = 0
    owner.in_flight = 1                                            # owner a little busier
    long_tail = SYSTEM[:BLOCK_CHARS * 2] + "a different conversation " * 40   # 2 shared blocks of ~17
    assert chooser.choose(workers, long_tail) is not owner


def test_the_memory_keeps_the_most_recently_used_names():
    tree = WorkerPrefixes(capacity=4)
    a, b = block_names("a" * 3 * BLOCK_CHARS), block_names("b" * 3 * BLOCK_CHARS)
    tree.add(a)
    assert tree.match(a) == 3
    tree.add(b)                                                    # 6 names into 4: a's oldest two go
    assert len(tree) == 4 and tree.match(b) == 3 and tree.match(a) == 0


def test_prefix_is_a_prefill_policy_only():
    workers = {"model_name": "dsv4-tiny",
               "prefill": [{"name": "p", "url": "http://127.0.0.1:1", "bootstrap_host": "127.0.0.1"}],
               "decode": [{"name": "d", "url": "http://127.0.0.1:2"}]}
    assert RouterSettings(**workers, prefill_policy="prefix").prefill_policy == "prefix"
    with pytest.raises(ValidationError, match="decode_policy 'prefix' is for prefill workers"):
        RouterSettings(**workers, decode_policy="prefix")
