"""The block pool's state word (``BlockPool.st``): a block the bulk path pops off the tail keeps its consumed
tail position as "held by one" (no store); a prefix hit on it, and releases, must count its holders as the
plain encoding (-2 for one holder) would. Cases built so the bulk path is the one that pops."""

from __future__ import annotations

from enginekit import admit

from twin.models.kv import BlockPool
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq

BS = 4


def _req(rid: int, ids: tuple[int, ...]) -> EngineRequest:
    seq = TokenSeq([("ids", ids)], block_size=BS, output_segment=10_000 + rid)
    return EngineRequest(request_id=str(rid), arrival_s=0.0, seq=seq, max_tokens=1)


def test_hit_on_a_bulk_popped_block_counts_two_holders() -> None:
    pool = BlockPool(num_blocks=25, block_size=BS, enable_prefix_caching=True, max_model_len=1024)
    a = _req(1, tuple(range(1, 1 + 12 * BS)))  # 12 full blocks
    admit(pool, a)
    filler = _req(2, tuple(range(1000, 1000 + 12 * BS)))  # the other 12 usable blocks: none fresh left
    admit(pool, filler)
    a_blocks = list(a.blocks)
    pool.release(a)  # a's 12 blocks to the tail, last first
    pool.check_invariants()
    assert pool.free_order() == a_blocks[::-1]
    b = _req(3, tuple(range(5000, 5000 + 10 * BS)))  # pops 10 off the tail (bulk path), evicting a's hashes
    assert admit(pool, b) == []
    assert b.blocks == a_blocks[::-1][:10]
    assert all(pool.ref_count(x) == 1 for x in b.blocks)
    assert pool.st[b.blocks[0]] >= 0  # held by one as a consumed tail position (what this test is about)
    c = _req(4, tuple(range(5000, 5000 + 10 * BS)) + (7,))  # b's prompt and one token: 10 blocks hit
    assert admit(pool, c) == b.blocks
    assert [pool.ref_count(x) for x in b.blocks] == [2] * 10
    assert len(pool.shared) == 10
    pool.release(b)
    pool.check_invariants()
    assert [pool.ref_count(x) for x in c.blocks[:10]] == [1] * 10 and len(pool.shared) == 0
    before = pool.free_order()
    c_blocks = list(c.blocks)
    assert len(c_blocks) == 11
    pool.release(c)
    pool.check_invariants()
    # c's unhashed last block to the head; its 10 hashed ones to the tail, last first (LRU by release)
    assert pool.free_order() == [c_blocks[10], *before, *c_blocks[9::-1]]
    assert all(pool.ref_count(x) == 0 for x in c_blocks)


def test_bulk_popped_blocks_released_by_the_shared_path() -> None:
    """A request whose blocks mix a consumed-position holder and a shared block goes through release's
    per-block path: each consumed-position block is its last holder's and goes back to the tail."""
    pool = BlockPool(num_blocks=25, block_size=BS, enable_prefix_caching=True, max_model_len=1024)
    a = _req(1, tuple(range(1, 1 + 12 * BS)))
    admit(pool, a)
    admit(pool, _req(2, tuple(range(1000, 1000 + 12 * BS))))
    pool.release(a)
    b = _req(3, tuple(range(5000, 5000 + 10 * BS)))
    admit(pool, b)
    c = _req(4, tuple(range(5000, 5000 + 2 * BS)) + (9,) * BS + (8,))  # hits b's first 2 blocks only
    assert admit(pool, c) == b.blocks[:2]
    assert len(pool.shared) == 2
    b_blocks = list(b.blocks)
    before = pool.free_order()
    pool.release(b)  # per-block path (shared blocks): 8 blocks to the tail, 2 stay with c
    pool.check_invariants()
    assert pool.free_order() == [*before, *b_blocks[9:1:-1]]
    assert [pool.ref_count(x) for x in b_blocks] == [1, 1] + [0] * 8
