"""A tiny deterministic PRNG and stable 64-bit hashing for routing policies.

The house style forbids the ``random`` module and a production router must import ``twin.policies``
without numpy-heavy machinery, so policies draw from :class:`SplitMix64` (Steele, Lea & Flood 2014):
one 64-bit state, a golden-ratio increment and a strong finaliser. It is fast, passes BigCrush when
used as a generator, and is fully reproducible from its seed on every platform.

Hashing must be stable across processes (Python's ``hash`` of ``str`` is salted by PYTHONHASHSEED), so
strings are hashed with BLAKE2b and integers are mixed with the SplitMix64 finaliser.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from functools import lru_cache

MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijective avalanche mix of a 64-bit integer (negatives wrap)."""
    z = x & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@lru_cache(maxsize=65536)
def stable_hash_str(text: str) -> int:
    """A 64-bit hash of ``text`` that is identical in every process and on every platform."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def combine_hashes(values: Iterable[int]) -> int:
    """Order-sensitive 64-bit combination of integers (e.g. the first K block hashes of a prompt)."""
    h = 0x5EED_0F_B10C
    for v in values:
        h = mix64(h ^ mix64(v))
    return h


class SplitMix64:
    """Deterministic pseudo-random stream; ``SplitMix64(seed)`` always yields the same sequence."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = seed & MASK64

    def next_u64(self) -> int:
        self._state = (self._state + _GOLDEN_GAMMA) & MASK64
        return mix64(self._state)

    def random(self) -> float:
        """A float in [0, 1) with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))

    def randrange(self, n: int) -> int:
        """An integer in [0, n), unbiased (rejection sampling)."""
        if n <= 0:
            raise ValueError(f"randrange needs n > 0, got {n}")
        limit = (1 << 64) - ((1 << 64) % n)
        while True:
            x = self.next_u64()
            if x < limit:
                return x % n

    def sample2(self, n: int) -> tuple[int, int]:
        """Two distinct indices in [0, n) (n >= 2), uniformly among ordered pairs."""
        if n < 2:
            raise ValueError(f"sample2 needs n >= 2, got {n}")
        i = self.randrange(n)
        j = self.randrange(n - 1)
        return i, (j + 1 if j >= i else j)
