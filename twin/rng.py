"""Named random streams: one root seed per run, one independent numpy Generator per named stream.

``stream(seed, replication, "workload.arrivals")`` is seeded from
``SeedSequence(seed, spawn_key=(replication, stable_hash(name)))``, so adding a component never shifts
another component's stream, and two policies compared on one seed see the same arrivals (common
random numbers).
"""

from __future__ import annotations

import hashlib

import numpy as np


def stable_hash(name: str) -> int:
    """A 63-bit hash of a string that is the same in every process (unlike ``hash(str)``)."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "big") >> 1


def stream(seed: int, replication: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(replication, stable_hash(name)))))
