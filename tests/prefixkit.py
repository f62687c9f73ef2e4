"""Shared helpers for the prefix-index and router tests."""

from __future__ import annotations


def chained(tokens: list[int]) -> tuple[int, ...]:
    """Chained block hashes of one-token blocks, as the engine's are (block k's hash fixes block k-1's)."""
    out, parent = [], 0
    for t in tokens:
        parent = hash((parent, t))
        out.append(parent)
    return tuple(out)
