"""A decode-group member's deferred block registration (``BlockPool.pend``) changes no result.

The case the random workloads of tests/test_kv_lazy.py and tests/test_decode_group.py do not reach: while
a member decodes its answer, a second request whose prompt replays that answer (a resumed answer: same
history, same output segment) prefills one token a step (the budget's remainder) just behind the member,
so both register blocks with equal hashes under one segment, the member first: the hash map (earliest
block) and the duplicate lists depend on the member's deferred blocks being written out before the other
request registers (without that write-out this test fails). Compared with the
engine whose every request takes the per-request path (registration when each step is scheduled).
"""

from __future__ import annotations

from twin.models.engine import Engine, EngineConfig
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq

BS = 4


def _engine(group: bool) -> Engine:
    e = Engine(EngineConfig(num_gpu_blocks=400, block_size=BS, max_num_batched_tokens=2, max_num_seqs=8,
                            max_model_len=1024))
    e.use_group = group
    return e


def _pair() -> tuple[EngineRequest, EngineRequest]:
    a = EngineRequest(request_id="a", arrival_s=0.0, max_tokens=120,
                      seq=TokenSeq([("seg", (1, 40))], block_size=BS, output_segment=500))
    b = EngineRequest(request_id="b", arrival_s=0.0, max_tokens=30,
                      seq=TokenSeq([("seg", (1, 40)), ("seg", (500, 100))], block_size=BS, output_segment=500,
                                   output_offset=100))
    return a, b


def test_resumed_answer_while_its_original_decodes() -> None:
    engines = (_engine(True), _engine(False))
    pairs = [_pair() for _ in engines]
    for e, (a, _) in zip(engines, pairs):
        e.add(a)
    t = 0.0
    for i in range(400):
        if i == 12:  # the original has a few output blocks by now; the resumed prompt runs well past them
            for e, (_, b) in zip(engines, pairs):
                e.add(b)
        steps = [e.schedule(t) for e in engines]
        if steps[0] is None:
            assert steps[1] is None
            break
        assert [r.request_id for r in steps[0].reqs] == [r.request_id for r in steps[1].reqs]
        assert engines[0].kv.free_order() == engines[1].kv.free_order()
        t += 0.01
        for e, s in zip(engines, steps):
            e.complete(s, t)
    g, p = engines
    assert g.grp.steps > 0, "the group was never used"
    assert not g.has_work and not p.has_work
    assert g.kv.materialise() == p.kv.materialise()
    assert p.kv.dups, "no duplicate hashes: the case is not exercised"
    assert g.kv.dups == p.kv.dups
    assert g.kv.bhash == p.kv.bhash
    assert g.kv.free_order() == p.kv.free_order()
    g.kv.check_invariants()
