"""Local TCP ports: is one free, and find free ones below the ephemeral range (after a load test the ephemeral
range is full of TIME_WAIT sockets, and binding one fails).

A port found free is bound later, by the process it is for: two callers searching at once may both pick it. Where
several run side by side on one machine (parallel test workers, two operators' `up`), `DSV4_CLUSTER_PORTS=LOW-HIGH`
gives each its own range.
"""

from __future__ import annotations

import os
import random
import socket

EPHEMERAL_LOW = 32768
SEARCH_LOW = 20000
PORTS_ENV = "DSV4_CLUSTER_PORTS"


class NoFreePortError(RuntimeError):
    """No free port was found in the searched range."""


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    """True when a listening socket could bind `host:port` now (SO_REUSEADDR, as servers set it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def search_range() -> tuple[int, int]:
    """[low, high) that `free_ports` searches: `DSV4_CLUSTER_PORTS` (LOW-HIGH) when set, else [20000, 32768)."""
    text = os.environ.get(PORTS_ENV, "").strip()
    if not text:
        return SEARCH_LOW, EPHEMERAL_LOW
    try:
        low, high = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"{PORTS_ENV}={text!r}: expected LOW-HIGH, two port numbers") from None
    if not 1024 <= low < high <= 65536:
        raise ValueError(f"{PORTS_ENV}={text!r}: expected 1024 <= LOW < HIGH <= 65536")
    return low, high


def free_ports(count: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """`count` distinct ports in `search_range()` that are free now (random order, so parallel callers rarely
    collide)."""
    low, high = search_range()
    candidates = [p for p in range(low, high) if p not in exclude]
    random.shuffle(candidates)
    found: list[int] = []
    for port in candidates:
        if port_is_free(port):
            found.append(port)
            if len(found) == count:
                return found
    raise NoFreePortError(f"found only {len(found)} of {count} free ports in [{low}, {high})")
