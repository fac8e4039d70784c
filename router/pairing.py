"""Turn one client body into the body both legs of a PD pair receive (docs/protocol.md, "One request").

The copy carries the prefill's `bootstrap_host`/`bootstrap_port`, a random 63-bit `bootstrap_room` and
the router's own `rid`, so the decode server can find the prefill's KV and the router can abort both
legs by id. Batched `/generate` carries one entry per item; a scalar room used for several items
(chat `n>1`, batched completions) is drawn low enough that `room + i` stays below 2^63.
"""

from __future__ import annotations

import json
import random
import secrets
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest
from .pool import Pair

ROOM_LIMIT = 2**63
# Ids and rooms need to be unique, not secret (no client sees either): one generator seeded once from the OS, instead
# of uuid4 / secrets per request, whose os.urandom calls took 7% of the router's CPU at c = 64.
_ids = random.Random(secrets.randbits(128))
ROUTER_FIELDS = ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True)
class PairedRequest:
    """What goes to both legs: the same path and body (`prefill_body`: the prefill's, when it is asked for more);
    `rids` are the ids to abort."""

    path: str
    pair: Pair
    body: dict[str, Any]
    rid: str
    rids: tuple[str, ...]
    stream: bool
    prefill_body: dict[str, Any] | None = None


def _is_batch(value: Any) -> bool:
    """A list of prompts (strings or token lists), as opposed to one prompt given as a token list."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))


def _generate_batch_size(body: dict[str, Any]) -> int | None:
    for key in ("text", "input_ids"):
        if _is_batch(body.get(key)):
            return len(body[key])
    return None


def _positive_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _items_sharing_room(path: str, body: dict[str, Any]) -> int:
    """How many server-side requests expand from one scalar room (the server uses room + i)."""
    if path == "/generate":
        params = body.get("sampling_params")
        n = _positive_int(params.get("n")) if isinstance(params, dict) else 1
        return (_generate_batch_size(body) or 1) * n
    prompts = len(body["prompt"]) if _is_batch(body.get("prompt")) else 1
    return prompts * _positive_int(body.get("n"))


def _room(items: int) -> int:
    return _ids.getrandbits(63) if items == 1 else _ids.randrange(ROOM_LIMIT - items + 1)


_JSON_KINDS = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}  # as the client wrote it


def check_body(body: Any) -> dict[str, Any]:
    """The fields the router relies on, checked before any worker sees the request."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {_JSON_KINDS.get(type(body), 'a number')}")
    taken = [k for k in ROUTER_FIELDS if k in body]
    if taken:
        raise InvalidRequest(f"the router sets {taken} itself (PD pairing); remove them from the request")
    if not isinstance(body.get("stream", False), bool):
        raise InvalidRequest(f"'stream' must be true or false, got {json.dumps(body['stream'])}")
    return body


def pair_request(path: str, body: dict[str, Any], pair: Pair,
                 prefill_asks: dict[str, Any] | None = None) -> PairedRequest:
    """The body both legs receive: the client's fields plus bootstrap fields and the router's rid; the prefill's
    also `prefill_asks` (what only its answer needs to carry: `resume.prefill_asks`)."""
    body = check_body(body)
    rid = f"{_ids.getrandbits(128):032x}"
    prefill = pair.prefill
    paired = dict(body)
    batch = _generate_batch_size(body) if path == "/generate" else None
    items = _items_sharing_room(path, body)
    if batch is not None and items == batch:
        rids = tuple(f"{rid}-{i}" for i in range(batch))
        paired.update(
            rid=list(rids),
            bootstrap_host=[prefill.bootstrap_host] * batch,
            bootstrap_port=[prefill.bootstrap_port] * batch,
            bootstrap_room=[_ids.getrandbits(63) for _ in range(batch)],
        )
    else:
        rids = (rid,)
        paired.update(
            rid=rid,
            bootstrap_host=prefill.bootstrap_host,
            bootstrap_port=prefill.bootstrap_port,
            bootstrap_room=_room(items),
        )
    return PairedRequest(path, pair, paired, rid, rids, bool(body.get("stream", False)),
                         {**paired, **prefill_asks} if prefill_asks else None)
