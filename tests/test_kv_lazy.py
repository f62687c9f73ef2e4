"""The block pool's lazy registration (``twin.models.kv_lazy``) changes no result.

Two engines are driven through the same random event sequence: one with the block pool as it is, one whose
pool registers every block's hash eagerly at scheduling time (the plain reading of vLLM's ``cache_blocks``;
``EagerBlockPool`` below), its every request on the per-request path (no decode group, whose members'
registration is deferred: ``BlockPool.pend``). The workload is multi-turn: prompts start with one of a few system prompts, replay
earlier turns' messages and answers (the answers are other requests' output segments, so output blocks get
hit), sometimes resume an answer (the output continues a prompt segment), sometimes carry real token ids,
sometimes arrive twice at once (duplicate hashes); the pool is small enough to evict and preempt, and
requests are aborted. After every event the two must agree on the step's composition, prefix hits, the
free-block queue and counters; at random moments and at the end the lazy pool, materialised, must hold the
same hash map and the same duplicate lists (earliest first) as the eager one.
"""

from __future__ import annotations

import numpy as np
import pytest

from enginekit import finish_side_by_side
from twin.models.engine import Engine, EngineConfig
from twin.models.kv import BlockPool
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq


class EagerBlockPool(BlockPool):
    """The reference: every block's hash computed and registered when its step is scheduled, and a lookup
    that hashes the whole prompt first."""

    __slots__ = ()

    def _cache_upto(self, req: EngineRequest, full: int) -> None:
        self._register(req, req.num_cached_blocks, full)
        req.num_cached_blocks = full

    def find_hit(self, req: EngineRequest) -> list[int]:
        if not self.caching:
            return []
        max_blocks = (req.seq.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        hashes = req.seq.block_hashes(max_blocks)
        hits = []
        for i in range(max_blocks):
            b = self.cached.get(hashes[i])
            if b is None:
                break
            hits.append(b)
        return hits


def _engine(eager: bool, *, blocks: int, bs: int, group: bool, t_long: int) -> Engine:
    e = Engine(EngineConfig(num_gpu_blocks=blocks, block_size=bs, max_num_batched_tokens=256, max_num_seqs=32,
                            max_model_len=2048, long_prefill_token_threshold=t_long), track_groups=True)
    if eager:
        e.kv = EagerBlockPool(num_blocks=blocks, block_size=bs, enable_prefix_caching=True, max_model_len=2048)
    e.use_group = group and not eager  # the reference registers every block when its step is scheduled
    return e


def _request(spec: dict, bs: int) -> EngineRequest:
    seq = TokenSeq(spec["pieces"], block_size=bs, output_segment=spec["out_seg"], output_offset=spec["out_off"])
    r = EngineRequest(request_id=str(spec["rid"]), arrival_s=spec["t"], seq=seq, max_tokens=spec["out"])
    r.group = f"g{spec['rid'] % 7}"  # a label's first gap stops the decode group's join (a path with its own exits)
    return r


def _spec(rng, rid: int, t: float, convs: list[list], bs: int) -> dict:
    """A turn of a random conversation: system prompt, history (messages and answers), a new message."""
    if not convs or rng.random() < 0.3:
        convs.append([])
    ci = int(rng.integers(0, len(convs)))
    hist = convs[ci]
    pieces: list = [("seg", (int(rng.integers(0, 3)) + 1, int(rng.integers(1, 5)) * bs + int(rng.integers(0, 3))))]
    if rng.random() < 0.2:  # real token ids (registered eagerly) somewhere in the prompt
        pieces.append(("ids", tuple(int(x) for x in rng.integers(0, 50, size=int(rng.integers(1, 3 * bs))))))
    pieces += [("seg", p) for p in hist]
    msg = (rid * 10 + 1_000_000, int(rng.integers(1, 5 * bs)))
    pieces.append(("seg", msg))
    out = int(rng.integers(1, 6 * bs))
    out_seg, out_off = rid * 10 + 2_000_000, 0
    if hist and rng.random() < 0.15:  # a resumed answer: the output continues the prompt's last segment
        out_seg, n = hist[-1]
        out_off = n
        pieces = pieces[:-1]
    else:
        hist.append(msg)
        hist.append((out_seg, out))  # the next turn replays the whole drawn answer
    return {"rid": rid, "t": t, "pieces": pieces, "out_seg": out_seg, "out_off": out_off, "out": out}


def _state(e: Engine) -> tuple:
    live = [(r.request_id, r.num_output, r.num_tokens, r.num_cached_tokens, list(r.blocks)) for r in e.running]
    return live, e.kv.free_order(), e.num_preemptions, e.prefix_cache_hits, e.prefix_cache_queries


def _same_maps(lazy: BlockPool, eager: BlockPool) -> None:
    assert lazy.materialise() == eager.cached
    assert lazy.dups == eager.dups
    assert lazy.bhash == eager.bhash


@pytest.mark.parametrize("seed", range(10))
def test_lazy_registration_matches_eager(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([4, 16]))
    blocks = int(rng.integers(60, 300))
    group = bool(rng.random() < 0.5)
    # a prefill cap lets two requests computing the same prompt interleave their chunks (registration order)
    t_long = int(rng.choice([0, 2 * bs + 3]))
    kw = dict(blocks=blocks, bs=bs, group=group, t_long=t_long)
    engines = (_engine(False, **kw), _engine(True, **kw))
    reqs: tuple[dict, dict] = ({}, {})
    convs: list[list] = []
    t = 0.0
    rid = 0
    hits = 0
    dup_seen = lazy_seen = False
    for _ in range(1500):
        if rng.random() < 0.3 or not any(e.has_work for e in engines):
            rid += 1
            spec = _spec(rng, rid, t, convs, bs)
            twins = [spec]
            if rng.random() < 0.1:  # the same prompt twice at once: duplicate hashes
                rid += 1
                twins.append({**spec, "rid": rid, "out_seg": rid * 10 + 2_000_000, "out_off": 0})
            for sp in twins:
                if sum(p[1][1] if p[0] == "seg" else len(p[1]) for p in sp["pieces"]) >= 2048 - 1:
                    continue
                for e, rs in zip(engines, reqs):
                    r = _request(sp, bs)
                    rs[sp["rid"]] = r
                    e.add(r)
        if rng.random() < 0.04 and engines[0].running:
            victim = int(engines[0].running[int(rng.integers(0, len(engines[0].running)))].request_id)
            for e, rs in zip(engines, reqs):
                assert e.abort(rs[victim], t)
        steps = [e.schedule(t) for e in engines]
        if steps[0] is None:
            assert steps[1] is None
            t += 0.01
            continue
        a, b = steps
        assert [r.request_id for r in a.reqs] == [r.request_id for r in b.reqs]
        assert a.ns == b.ns and a.shape == b.shape
        assert [r.request_id for r in a.preempted] == [r.request_id for r in b.preempted]
        hits += sum(r.num_cached_tokens or 0 for r in a.admitted)
        assert _state(engines[0]) == _state(engines[1])
        done, t = finish_side_by_side(engines, steps, t, rng, run_share=0.6, max_run=30)
        assert [r.request_id for r in done[0]] == [r.request_id for r in done[1]]
        assert _state(engines[0]) == _state(engines[1])
        if rng.random() < 0.02:
            _same_maps(engines[0].kv, engines[1].kv)
        engines[0].kv.check_invariants()
        dup_seen = dup_seen or bool(engines[1].kv.dups)
        lazy_seen = lazy_seen or bool(engines[0].kv.lazy)
    lazy, eager = engines
    assert hits > 0 and dup_seen, "the workload exercised too little"
    assert lazy_seen, "nothing was ever left lazy"
    _same_maps(lazy.kv, eager.kv)
    lazy.kv.check_invariants()
