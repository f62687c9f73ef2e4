"""A release whose leading blocks have other holders (prefix hits on a prompt that running requests hold, as a
tenant's system prompt is in a fleet): those lose one holder each and stay out of the free queue, the rest go
to the tail last first, exactly as the per-block path would put them. While no hash has two cached copies, the
blocks with other holders can only lead (``twin.models.kv_tail._leading``, which counts them by bisection): checked
at every release of random drives and of a small fleet run."""

from __future__ import annotations

import pytest
from enginekit import admit
import test_kv_lazy

from benchmarks.fleet import OVERRIDES
from twin.models.kv import BlockPool
from twin.models.kv_tail import _leading
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq
from twin.runner import run_scenario
from twin.scenario import load_scenario

BS = 4
SYSTEM = tuple(range(1, 1 + 5 * BS))  # five full blocks every request below starts with


def _req(rid: int, pieces: list, out_seg: int | None = None) -> EngineRequest:
    seq = TokenSeq(pieces, block_size=BS, output_segment=10_000 + rid if out_seg is None else out_seg)
    return EngineRequest(request_id=str(rid), arrival_s=0.0, seq=seq, max_tokens=1)


@pytest.mark.parametrize("own", [
    [("ids", tuple(range(500, 500 + 12 * BS)))],  # its own blocks registered by hash
    [("seg", (77, 12 * BS))],  # registered lazily, by the segment's key
    [("ids", tuple(range(500, 500 + 12 * BS + 2)))],  # and a partial last block, never registered
])
def test_the_shared_leading_blocks_keep_their_other_holder(own: list) -> None:
    pool = BlockPool(num_blocks=64, block_size=BS, enable_prefix_caching=True, max_model_len=1024)
    holder = _req(1, [("ids", SYSTEM), ("ids", (9,) * 3 * BS)])
    admit(pool, holder)
    a = _req(2, [("ids", SYSTEM), *own])
    assert admit(pool, a) == holder.blocks[:5]
    assert len(a.blocks) - 5 > 8  # the case this test is about: more than 8 blocks past the shared ones
    assert pool.shared == set(holder.blocks[:5])
    a_blocks = list(a.blocks)
    registered = a.num_cached_blocks
    before = pool.free_order()
    pool.release(a)
    pool.check_invariants()
    assert [pool.ref_count(x) for x in a_blocks[:5]] == [1] * 5 and not pool.shared
    assert all(pool.ref_count(x) == 0 for x in a_blocks[5:])
    unregistered = a_blocks[registered:]  # to the head, ahead of every free block
    assert pool.free_order() == [*unregistered[::-1], *before, *a_blocks[registered - 1:4:-1]]
    # the shared blocks are still cached: a third request hits them and a's own blocks, now free in the tail
    c = _req(3, [("ids", SYSTEM), *own], out_seg=10_002)
    assert admit(pool, c) == a_blocks[:min(registered, (c.seq.num_tokens - 1) // BS)]  # (a prompt's last token is
    # always computed, so a prompt of whole blocks hits all but its last)
    pool.check_invariants()
    pool.release(holder)
    pool.check_invariants()
    assert [pool.ref_count(x) for x in a_blocks[:5]] == [1] * 5


def test_a_shared_block_after_an_own_block_takes_the_per_block_path() -> None:
    """Shared blocks that do not all lead, which takes two cached copies of a hash: b and a start the same prompt
    at once, b's first chunk registers blocks 0..2 first, so a's copies of them are duplicates; c then hits b's
    copies (the earliest) and a's blocks 3..9. a holds its blocks 0..2 alone and 3..9 with c: released block
    by block, with the same ordering rule."""
    pool = BlockPool(num_blocks=64, block_size=BS, enable_prefix_caching=True, max_model_len=1024)
    prompt = tuple(range(500, 500 + 14 * BS))
    a = _req(1, [("ids", prompt)])
    b = _req(2, [("ids", prompt[:3 * BS]), ("ids", (7,) * BS)])
    hits_a, hits_b = pool.find_hit(a), pool.find_hit(b)
    assert hits_a == hits_b == []  # both looked up before either registered a block
    assert pool.admit(b, 3 * BS, hits_b, full_isl=False, watermark_blocks=0)
    assert pool.admit(a, a.seq.num_tokens, hits_a, full_isl=False, watermark_blocks=0)
    assert sorted(pool.dups.values()) == [[x] for x in a.blocks[:3]]
    c = _req(3, [("ids", prompt[:10 * BS]), ("ids", (8,) * BS)])
    assert admit(pool, c) == [*b.blocks[:3], *a.blocks[3:10]]
    assert pool.shared == set(b.blocks[:3]) | set(a.blocks[3:10])
    a_blocks = list(a.blocks)
    before = pool.free_order()
    pool.release(a)
    pool.check_invariants()
    assert [pool.ref_count(y) for y in a_blocks[3:10]] == [1] * 7
    assert pool.shared == set(b.blocks[:3])
    assert pool.free_order() == [*before, *a_blocks[:9:-1], *a_blocks[2::-1]]


class _ReleaseCheck:
    """Wraps ``BlockPool.release``: before each release, while no hash has two cached copies (``dups`` empty), the
    released request's blocks with another holder must lead its blocks (the fast path counts them by bisection,
    ``kv_tail._leading``), and the count must be what a walk finds. Counts what it saw, so a drive that never
    shares a block fails its test rather than passing empty."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.releases = self.with_shared = self.with_dups = 0
        original = BlockPool.release

        def release(pool: BlockPool, req: EngineRequest) -> None:
            held = [b in pool.shared for b in req.blocks]
            lead = held.index(False) if False in held else len(held)
            self.releases += 1
            self.with_shared += lead > 0
            if pool.dups:
                self.with_dups += 1
            else:
                assert not any(held[lead:]), f"request {req.request_id}: a shared block after one it holds alone"
                assert _leading(pool.shared, req.blocks) == lead
            original(pool, req)

        monkeypatch.setattr(BlockPool, "release", release)


@pytest.mark.parametrize("seed", range(10))
def test_shared_blocks_lead_every_release_of_random_drives(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_kv_lazy.py's drives (multi-turn prompts over a few system prompts, the same prompt twice at once,
    chunked prefills, preemption, aborts), every release checked."""
    check = _ReleaseCheck(monkeypatch)
    test_kv_lazy.test_lazy_registration_matches_eager(seed)
    assert check.with_shared > 0 and check.releases > check.with_dups


def test_shared_blocks_lead_every_release_of_a_fleet_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The speed benchmark's fleet (every component on, the llm-d-style scorer), small and short."""
    check = _ReleaseCheck(monkeypatch)
    sc = load_scenario("scenarios/baseline-day.yaml", overrides=[
        *OVERRIDES, "fleet.scale=0.02", "fleet.traffic.duration_s=60", "horizon_s=60"])
    assert run_scenario(sc).ok
    assert check.with_shared > 100 and check.releases > check.with_dups + 100
