"""A release whose leading blocks have other holders (prefix hits on a prompt that running requests hold, as a
tenant's system prompt is in a fleet): those lose one holder each and stay out of the free queue, the rest go
to the tail last first, exactly as the per-block path would put them."""

from __future__ import annotations

import pytest
from enginekit import admit

from twin.models.kv import BlockPool
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq

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
    """Shared blocks that do not all lead (here the last of them is preceded by one the request alone holds) are
    released block by block; the result is the same ordering rule."""
    pool = BlockPool(num_blocks=64, block_size=BS, enable_prefix_caching=True, max_model_len=1024)
    a = _req(1, [("ids", tuple(range(500, 500 + 14 * BS)))])
    admit(pool, a)
    b = _req(2, [("ids", tuple(range(500, 500 + 3 * BS))), ("ids", (7,) * BS)])  # hits a's first 3 blocks
    assert admit(pool, b) == a.blocks[:3]
    assert pool.shared == set(a.blocks[:3])
    # one of a's later blocks becomes shared too, by hand through the state word (no prompt reaches it
    # without its predecessors): a request's non-leading shared block
    x = a.blocks[9]
    pool.st[x] = -3
    pool.shared.add(x)
    a_blocks = list(a.blocks)
    before = pool.free_order()
    pool.release(a)
    assert [pool.ref_count(y) for y in a_blocks[:3]] == [1] * 3
    assert pool.ref_count(x) == 1 and pool.shared == set()
    assert pool.free_order() == [*before, *[y for y in a_blocks[:2:-1] if y != x]]
