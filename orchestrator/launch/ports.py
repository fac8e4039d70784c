"""Local TCP ports: is one free, and find free ones below the ephemeral range (after a load test the ephemeral
range is full of TIME_WAIT sockets, and binding one fails).
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_LOW = 32768
SEARCH_LOW = 20000


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


def free_ports(count: int, low: int = SEARCH_LOW, high: int = EPHEMERAL_LOW,
               exclude: frozenset[int] = frozenset()) -> list[int]:
    """`count` distinct ports in [low, high) that are free now (random order, so parallel
    callers rarely collide)."""
    candidates = [p for p in range(low, high) if p not in exclude]
    random.shuffle(candidates)
    found: list[int] = []
    for port in candidates:
        if port_is_free(port):
            found.append(port)
            if len(found) == count:
                return found
    raise NoFreePortError(f"found only {len(found)} of {count} free ports in [{low}, {high})")
