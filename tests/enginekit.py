"""Small builders for engine-level tests (not a test module)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from twin.models.engine import Engine, EngineConfig
from twin.models.kv import BlockPool
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq, pieces_from_ids


def make_engine(**kw) -> Engine:
    base = dict(num_gpu_blocks=1000, block_size=16, max_num_batched_tokens=8192, max_num_seqs=256,
                max_model_len=32768)
    base.update(kw)
    return Engine(EngineConfig(**base))


def req(rid: str, ids: list[int] | int, *, out: int = 4, block_size: int = 16, arrival: float = 0.0,
        priority: int = 0, seg: int | None = None) -> EngineRequest:
    """A request with explicit token ids, or ``n`` unique tokens when ``ids`` is an int."""
    if isinstance(ids, int):
        base = (hash(rid) & 0xFFFFFF) * 100_000
        ids = list(range(base, base + ids))
    seq = TokenSeq(pieces_from_ids(ids), block_size=block_size, output_segment=seg if seg is not None else hash(rid))
    return EngineRequest(request_id=rid, arrival_s=arrival, seq=seq, max_tokens=out, priority=priority)


def run_steps(engine: Engine, n: int, t0: float = 0.0, dt: float = 1.0) -> list:
    """Schedule and complete up to ``n`` steps; returns the steps."""
    steps = []
    t = t0
    for _ in range(n):
        s = engine.schedule(t)
        if s is None:
            break
        t += dt
        engine.complete(s, t)
        steps.append(s)
    return steps


def finish_side_by_side(engines, steps, t: float, rng, *, run_share: float, max_run: int):
    """Finish the step each of two engines scheduled, the same way in both: with probability ``run_share``
    (when the step is a uniform decode) a decode run of a random length up to ``max_run``, whose length both
    must allow, else one step. Returns (finished requests per engine, the new time)."""
    if steps[0].uniform_decode and rng.random() < run_share:
        ks = [e.max_decode_run(s, max_run) for e, s in zip(engines, steps)]
        assert ks[0] == ks[1]
        m = int(rng.integers(1, ks[0] + 1))
        ends = list(t + np.cumsum(rng.uniform(0.01, 0.03, size=m)))
        return [e.complete_decode_run(s, m, ends) for e, s in zip(engines, steps)], ends[-1]
    t += float(rng.uniform(0.01, 0.05))
    return [e.complete(s, t) for e, s in zip(engines, steps)], t


def admit(pool: BlockPool, r: EngineRequest) -> list[int]:
    """Admit ``r`` whole into ``pool`` after its prefix hit (as the scheduler would), check the pool's
    invariants, and return the hit blocks."""
    hits = pool.find_hit(r)
    bs = pool.block_size
    assert pool.admit(r, r.seq.num_tokens - len(hits) * bs, hits, full_isl=False, watermark_blocks=0)
    pool.check_invariants()
    return hits


def gap_sample(e: Engine) -> Counter:
    """An engine's inter-token gaps as a weighted sample: (value, group label) -> total weight. Paths that
    write the same gaps as different entries (a decode-group step is one entry per label, weighted by its
    members; per request, one entry per gap) give the same sample."""
    labels = list(e.itl_groups) if e.itl_groups is not None else [None] * len(e.itl_values)
    assert len(labels) == len(e.itl_values) == len(e.itl_weights)
    out: Counter = Counter()
    for v, w, g in zip(e.itl_values, e.itl_weights, labels):
        assert w > 0
        out[(v, g)] += w
    return out
