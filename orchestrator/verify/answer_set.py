"""The answer set `dsv4-cluster verify` sends through the router on the SGLang engine: a PD transfer that scrambles
KV still returns fluent text, but not the one exact answer of an arithmetic question. A miss or two is allowed.
"""

from __future__ import annotations

PASS_RATE = 0.9  # at least 18 of 20 exact; below this `verify` fails
MAX_TOKENS = 64  # per answer; "Number only." replies take a handful of tokens

ANSWERS: tuple[tuple[str, int], ...] = (
    ("What is 17*23? Number only.", 391),
    ("What is 634-63? Number only.", 571),
    ("What is 50*14? Number only.", 700),
    ("What is 396+32? Number only.", 428),
    ("What is 884-79? Number only.", 805),
    ("What is 96*11? Number only.", 1056),
    ("What is 212+13? Number only.", 225),
    ("What is 354-59? Number only.", 295),
    ("What is 65*11? Number only.", 715),
    ("What is 980+74? Number only.", 1054),
    ("What is 921-50? Number only.", 871),
    ("What is 93*24? Number only.", 2232),
    ("What is 841+61? Number only.", 902),
    ("What is 240-80? Number only.", 160),
    ("What is 19*7? Number only.", 133),
    ("What is 932+35? Number only.", 967),
    ("What is 254-78? Number only.", 176),
    ("What is 83*28? Number only.", 2324),
    ("What is 802+36? Number only.", 838),
    ("What is 438-79? Number only.", 359),
)
