"""The one rule for every text a client sees (error bodies, error events, headers): a worker is named by its
role ("the decode worker"), never by its name, host, port, URL or NIXL agent name, whatever the topology calls
its nodes (an IP, `localhost`, a hostname).

Two halves, one rule:
- Messages the router writes about a worker's failure are built from the role and what happened
  (`worker_text`): no worker text goes in, so nothing of the worker's can leak; the log keeps the details.
- Text that comes from elsewhere and is meant for the client (a worker's 4xx message: the request's fault)
  goes through `Redactor.scrub`, which knows this router's worker names, hosts and ports (`nodes[].address` is
  a free string: a hostname has no shape to match) and removes any token that contains one (an agent name
  built from a hostname, `decode-gpu-node-7-30001`), plus every URL, IP address (v4, v6 bare or bracketed) and
  `host:port` whatever it names (`scrub`, what every error body goes through last).
"""

from __future__ import annotations

import re
from typing import Iterable
from urllib.parse import urlsplit

INTERNAL = "(internal)"
ROLE_WORDS = frozenset({"prefill", "decode", "router", "worker", "the"})
_TOKEN = re.compile(r"[\w.:/@\[\]%~+-]+")   # a URL, an address or an agent name: what a known identifier taints
_WORKER = re.compile(r"\b(prefill|decode) worker '[^']*'")
_GENERIC = re.compile("|".join((
    r"(?<![a-zA-Z0-9+.-])[a-zA-Z][a-zA-Z0-9+.-]*://\S+",                 # any URL
    r"\[[0-9a-fA-F.]*:[0-9a-fA-F:.]*\](?::\d+)?",                         # bracketed IPv6 (+ port); a colon: not `[0]`
    r"(?<![\w:])(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}(?![\w:])",        # bare IPv6, all eight groups
    r"(?<![\w:])(?:[0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{1,4})*)?::"              # bare IPv6 with "::" (not a time
    r"(?:[0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{1,4})*)?(?![\w:])",                # like 10:14:33 nor text like a:b:c)
    r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b",                              # IPv4 (+ port)
    r"\blocalhost(?::\d+)?\b",
    r"(?<![\w.-])(?=[\w.-]*[A-Za-z_])[\w.-]+:\d{2,5}\b",                    # host:port (a host has a letter)
    r"\bport\s+\d{2,5}\b",
)))


def scrub(text: str) -> str:
    """`text` without worker names in the router's own log form, URLs, IP addresses or host:port pairs."""
    return _GENERIC.sub(INTERNAL, _WORKER.sub(r"the \1 worker", text))


def worker_text(role: object, what: str) -> str:
    """What a client reads about a worker: its role and what happened, e.g. "the decode worker could not be
    reached"."""
    return f"the {getattr(role, 'value', role)} worker {what}"


class Redactor:
    """`scrub`, plus every token that contains one of this router's worker names or hosts (as a whole
    component: `vm` is found in `decode-vm-30001`, not in `kvm`)."""

    def __init__(self, names: Iterable[str], urls: Iterable[str], hosts: Iterable[str | None]) -> None:
        found = {n for n in names} | {urlsplit(u).hostname or "" for u in urls} | {h or "" for h in hosts}
        found = sorted((f for f in found if len(f) >= 2 and f.lower() not in ROLE_WORDS), key=len, reverse=True)
        self._known = (re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(map(re.escape, found)) + r")(?![A-Za-z0-9])",
                                  re.IGNORECASE) if found else None)

    def _taint(self, token: re.Match[str]) -> str:
        return INTERNAL if self._known.search(token.group()) else token.group()

    def scrub(self, text: str) -> str:
        """Linear in the text (it may echo a client's input): tokens first, then a search within each."""
        if self._known is not None:
            text = _TOKEN.sub(self._taint, text)
        return scrub(text)
