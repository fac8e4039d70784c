"""The one error the SGLang adapters raise: a call they do not support, or arguments SGLang never passes."""

from __future__ import annotations


class AdapterCallError(ValueError):
    """This call is outside what the adapter computes (the message names the argument and what it supports).

    The adapters never fall back to computing something else: an unsupported call raises this instead."""


def fail(message: str):
    """Raise AdapterCallError(message). Callers test first and format the message only on failure:
    formatting every message of every check measured as host time on each eager call."""
    raise AdapterCallError(message)
