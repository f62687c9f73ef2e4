"""Request sources for one replica: synthetic arrivals with length distributions and shared prefixes.

Every draw comes from a named stream (``twin.rng``), so the same scenario and seed give the same
requests. Prompts are token *content* (pieces, see ``twin.models.tokens``): a shared system prompt is
one virtual segment that every request of its group carries, so prefix reuse is real block-hash reuse,
not a probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twin.rng import stable_hash, stream
from twin.scenario import (
    ConstantLength,
    ExponentialLength,
    LognormalLength,
    SyntheticWorkload,
    UniformLength,
)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    arrival_s: float
    pieces: tuple[tuple[str, object], ...]
    prompt_tokens: int
    output_tokens: int  # where the model stops (EOS)
    max_tokens: int
    output_segment: int


def draw_lengths(dist, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(dist, ConstantLength):
        return np.full(n, dist.value, dtype=np.int64)
    if isinstance(dist, UniformLength):
        return rng.integers(dist.low, dist.high + 1, size=n, dtype=np.int64)
    if isinstance(dist, LognormalLength):
        # parameterised by the mean of the lognormal itself
        mu = np.log(dist.mean) - dist.sigma**2 / 2.0
        x = np.rint(rng.lognormal(mu, dist.sigma, size=n)).astype(np.int64)
        return np.clip(x, dist.min, dist.max)
    if isinstance(dist, ExponentialLength):
        p = 1.0 / max(dist.mean - dist.min + 1.0, 1.0)
        x = rng.geometric(p, size=n).astype(np.int64) - 1 + dist.min
        return np.clip(x, dist.min, dist.max)
    raise TypeError(f"unknown length distribution {dist!r}")


def arrival_times(arrival, n: int, rng: np.random.Generator) -> np.ndarray:
    if arrival.kind == "offline":
        return np.zeros(n)
    if arrival.kind == "poisson":
        gaps = rng.exponential(1.0 / arrival.rate_per_s, size=n)
    else:  # gamma
        shape = arrival.burstiness
        gaps = rng.gamma(shape, 1.0 / (arrival.rate_per_s * shape), size=n)
    t = np.cumsum(gaps)
    return t - t[0]  # the first request arrives at t=0


def synthetic_requests(w: SyntheticWorkload, *, seed: int, replication: int) -> list[RequestSpec]:
    """Draw the workload. Prompts longer than the replica's context are kept: the replica rejects them."""
    n = w.num_requests
    arrivals = arrival_times(w.arrival, n, stream(seed, replication, "workload.arrivals"))
    prompts = draw_lengths(w.prompt_tokens, n, stream(seed, replication, "workload.prompt_tokens"))
    outputs = draw_lengths(w.output_tokens, n, stream(seed, replication, "workload.output_tokens"))
    sp = w.shared_prefix
    if sp is not None:
        rng = stream(seed, replication, "workload.shared_prefix")
        shared = rng.random(n) < sp.fraction
        group = rng.integers(0, sp.groups, size=n)
    out: list[RequestSpec] = []
    for i in range(n):
        rid = f"req-{i:06d}"
        uniq = stable_hash(f"{seed}/{replication}/{rid}")
        p = int(prompts[i])
        pieces: list[tuple[str, object]] = []
        if sp is not None and shared[i]:
            pieces.append(("seg", (stable_hash(f"system-prompt/{int(group[i])}"), sp.tokens)))
            p = max(p, sp.tokens + 1)
            pieces.append(("seg", (uniq, p - sp.tokens)))
        else:
            pieces.append(("seg", (uniq, p)))
        o = int(outputs[i])
        max_tokens = w.max_tokens if w.max_tokens is not None else o
        out.append(RequestSpec(request_id=rid, arrival_s=float(arrivals[i]), pieces=tuple(pieces), prompt_tokens=p,
                               output_tokens=o, max_tokens=max_tokens, output_segment=uniq ^ 0x0A5A5A5A))
    return out


def workload_requests(w, *, seed: int, replication: int) -> list[RequestSpec]:
    """Requests of any single-replica workload kind."""
    if w.kind == "trace":
        from twin.models.traces import trace_requests

        return trace_requests(w, seed=seed, replication=replication)
    return synthetic_requests(w, seed=seed, replication=replication)
