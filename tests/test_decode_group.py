"""The engine's decode group (members kept as offsets from a group step counter) changes no result.

Two engines are driven through the same random event sequence — arrivals sharing prefixes, a KV pool small
enough to preempt and evict, decode runs (some cut short), watched output counts whose callbacks move the
watch or stop watching, aborts between steps and while a step is in flight — one with the group, one with it
switched off (every request on the per-request path). After every event they must agree on the step's
composition and shape, the finished requests, every live request's counts and the free-block queue; at the
end on the inter-token gaps (as a weighted sample of values and group labels: the group writes a step's gaps
as one entry per label, weighted by its members, where the per-request path writes one per request) and the
counters. With gap groups tracked and without.
"""

from __future__ import annotations

import numpy as np
import pytest

from enginekit import finish_side_by_side, gap_sample
from twin.models.engine import Engine, EngineConfig
from twin.models.request import EngineRequest, Status
from twin.models.tokens import TokenSeq


def _engine(group: bool, *, blocks: int, bs: int, track_groups: bool) -> Engine:
    e = Engine(EngineConfig(num_gpu_blocks=blocks, block_size=bs, max_num_batched_tokens=512, max_num_seqs=64,
                            max_model_len=4096), track_groups=track_groups)
    e.use_group = group
    return e


def _request(spec: dict, bs: int, log: list) -> EngineRequest:
    pieces = [("seg", (spec["prefix"], spec["prefix_len"])), ("seg", (spec["rid"] + 10_000, spec["prompt"]))]
    seq = TokenSeq(pieces, block_size=bs, output_segment=spec["rid"] + 20_000)
    r = EngineRequest(request_id=str(spec["rid"]), arrival_s=spec["t"], seq=seq, max_tokens=spec["out"])
    r.group = spec["tier"]
    marks = list(spec["marks"])
    r.watch_output = marks.pop(0) if marks else None

    def on_tokens(q: EngineRequest, m: int, t: float) -> None:
        log.append((q.request_id, q.num_output, m, t))
        while marks and marks[0] <= q.num_output:
            marks.pop(0)
        q.watch_output = marks[0] if marks else None

    r.on_tokens = on_tokens
    return r


def _state(e: Engine) -> tuple:
    live = [(r.request_id, r.num_output, r.num_tokens, r.status) for r in e.running]
    return live, e.kv.free_order(), e.kv.usage(), e.num_preemptions, e.prefix_cache_hits


@pytest.mark.parametrize("track_groups", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_group_matches_per_request_path(seed: int, track_groups: bool) -> None:
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([4, 16]))
    blocks = int(rng.integers(120, 400))
    logs: tuple[list, list] = ([], [])
    engines = (_engine(True, blocks=blocks, bs=bs, track_groups=track_groups),
               _engine(False, blocks=blocks, bs=bs, track_groups=track_groups))
    reqs: tuple[dict, dict] = ({}, {})
    t = 0.0
    rid = 0
    for _ in range(700):
        if rng.random() < 0.25 or not any(e.has_work for e in engines):
            rid += 1
            spec = {"rid": rid, "t": t, "prefix": int(rng.integers(0, 3)), "prefix_len": int(rng.integers(0, 3)) * 24,
                    "prompt": int(rng.integers(1, 300)), "out": int(rng.integers(1, 120)),
                    "tier": str(rng.choice(["free", "paid", "gold"])),
                    "marks": sorted(set(int(x) for x in rng.integers(1, 120, size=int(rng.integers(0, 3)))))}
            for e, log, rs in zip(engines, logs, reqs):
                r = _request(spec, bs, log)
                rs[rid] = r
                e.add(r)
        if rng.random() < 0.05 and len(engines[0].running) > 1:  # abort a running request between steps
            victim = engines[0].running[int(rng.integers(0, len(engines[0].running)))].request_id
            for e, rs in zip(engines, reqs):
                assert e.abort(rs[int(victim)], t)
        steps = [e.schedule(t) for e in engines]
        if steps[0] is None:
            assert steps[1] is None
            t += 0.01
            continue
        a, b = steps
        assert [r.request_id for r in a.reqs] == [r.request_id for r in b.reqs]
        assert a.ns == b.ns and a.shape == b.shape and a.uniform_decode == b.uniform_decode
        assert (a.ctx_requests, a.ctx_tokens, a.gen_requests, a.gen_tokens) == \
            (b.ctx_requests, b.ctx_tokens, b.gen_requests, b.gen_tokens)
        assert [r.request_id for r in a.preempted] == [r.request_id for r in b.preempted]
        assert _state(engines[0]) == _state(engines[1])
        if rng.random() < 0.03 and len(a.reqs) > 1:  # abort while the step is in flight
            victim = a.reqs[int(rng.integers(0, len(a.reqs)))].request_id
            for e, rs in zip(engines, reqs):
                e.abort(rs[int(victim)], t)
        done, t = finish_side_by_side(engines, steps, t, rng, run_share=0.7, max_run=40)
        assert [r.request_id for r in done[0]] == [r.request_id for r in done[1]]
        assert [r.request_id for r in a.first_tokens] == [r.request_id for r in b.first_tokens]
        assert _state(engines[0]) == _state(engines[1])
    g, p = engines
    assert g.grp.steps > 0, "the group was never used"
    assert logs[0] == logs[1]
    assert gap_sample(g) == gap_sample(p)
    assert len(g.itl_values) < len(p.itl_values)  # the group's steps wrote fewer entries for the same gaps
    assert (g.num_steps, g.generation_tokens, g.prompt_tokens, g.prefix_cache_queries) == \
        (p.num_steps, p.generation_tokens, p.prompt_tokens, p.prefix_cache_queries)
    for rg, rp in zip(reqs[0].values(), reqs[1].values()):
        assert (rg.num_output, rg.num_tokens, rg.status, rg.finish_s, rg.finished_reason) == \
            (rp.num_output, rp.num_tokens, rp.status, rp.finish_s, rp.finished_reason)
        # a member's last_token_s is written when it leaves the group; until then it is the group's
        assert (rg.last_token_s if rg._grp is None else g.grp.last_s) == rp.last_token_s
        assert rg.status != Status.FINISHED or rg._grp is None
    g.kv.check_invariants()
