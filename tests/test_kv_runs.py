"""Lazy entries tracked per tail run (``twin.models.kv_lazy._Lazy``): nothing is stored per block, so which
of an entry's blocks are still cached follows from where its run sits in the tail. Cases the random workloads
of tests/test_kv_lazy.py do not reach: the tail array rebuilt (thousands of stale entries after the front)
while a released entry's run sits in it, then part of that run evicted, then a lookup that materialises it."""

from __future__ import annotations

from enginekit import admit

from twin.models.kv import BlockPool
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq

BS = 4


def _req(rid: int, pieces: list) -> EngineRequest:
    seq = TokenSeq(pieces, block_size=BS, output_segment=10_000 + rid)
    return EngineRequest(request_id=str(rid), arrival_s=0.0, seq=seq, max_tokens=1)


def test_lazy_run_survives_the_tail_rebuild_and_partial_eviction() -> None:
    pool = BlockPool(num_blocks=1 + 100 + 5000, block_size=BS, enable_prefix_caching=True, max_model_len=100_000)
    lazy = _req(1, [("seg", (7, 100 * BS))])  # 100 full blocks, registered lazily under segment 7
    eager = _req(2, [("ids", tuple(range(1, 1 + 5000 * BS)))])  # 5,000 blocks, registered with their hashes
    admit(pool, lazy)
    admit(pool, eager)
    assert pool.fresh == pool.num_blocks  # every block used: from here on pops come off the tail
    l_blocks, e_blocks = list(lazy.blocks), list(eager.blocks)
    assert all(pool.bhash[b] is None for b in l_blocks) and pool.lazy
    pool.release(lazy)  # the tail: lazy's run (last block first), then eager's
    pool.release(eager)
    pool.check_invariants()
    assert pool.free_order() == [*l_blocks[::-1], *e_blocks[::-1]]
    # eager's prompt again, one token more: 5,000 hits taken out of the middle of the tail (stale entries after
    # the front: the array is rebuilt, every valid position moves), then one new block off the front
    front = pool.front
    again = _req(3, [("ids", tuple(range(1, 1 + 5000 * BS)) + (0,))])
    assert admit(pool, again) == e_blocks
    assert pool.front > front + 5000, "the tail was not rebuilt (fresh positions)"
    assert again.blocks[-1] == l_blocks[-1]
    # ten more off the front: lazy's blocks 89..98 (its run is evicted from its last block down)
    other = _req(4, [("seg", (9, 10 * BS))])
    admit(pool, other)
    assert other.blocks == l_blocks[98:88:-1]
    assert pool.free_order() == l_blocks[88::-1]
    # a lookup under segment 7 materialises the entry's blocks still cached, and hits them
    hit = _req(5, [("seg", (7, 100 * BS + 1))])
    assert pool.find_hit(hit) == l_blocks[:89]
    assert not pool.lazy and not pool.runs or all(e.flushed for e in pool.runs)
    assert [pool.cached[h] for h in hit.seq.block_hashes(89)[:89]] == l_blocks[:89]
    assert all(pool.bhash[b] is None for b in l_blocks[89:])
    pool.check_invariants()


def test_entry_dropped_once_its_run_is_evicted() -> None:
    pool = BlockPool(num_blocks=1 + 30, block_size=BS, enable_prefix_caching=True, max_model_len=1024)
    a = _req(1, [("seg", (7, 20 * BS))])
    admit(pool, a)
    filler = _req(2, [("seg", (8, 10 * BS))])
    admit(pool, filler)
    a_blocks = list(a.blocks)
    pool.release(a)
    assert [e.key for e in pool.runs] == [7] and 7 in pool.lazy
    b = _req(3, [("seg", (9, 19 * BS))])  # 19 of a's 20 blocks: its entry stays, with one block cached
    admit(pool, b)
    assert 7 in pool.lazy
    pool.check_invariants()
    c = _req(4, [("seg", (10, 1 * BS))])  # the last one: the entry leaves the index
    admit(pool, c)
    assert c.blocks == [a_blocks[0]]
    assert 7 not in pool.lazy and not pool.runs and pool.n_lazy == 3  # (filler, b, c)
    pool.check_invariants()


def test_rebuild_keeps_the_valid_entries_of_a_partly_hit_run() -> None:
    pool = BlockPool(num_blocks=1 + 100 + 5000, block_size=BS, enable_prefix_caching=True, max_model_len=100_000)
    lazy = _req(1, [("seg", (7, 100 * BS))])
    ids = tuple(range(1, 1 + 5000 * BS))
    eager = _req(2, [("ids", ids)])
    admit(pool, lazy)
    admit(pool, eager)
    l_blocks, e_blocks = list(lazy.blocks), list(eager.blocks)
    pool.release(lazy)
    pool.release(eager)
    # the first 4,990 of eager's blocks hit (stale in the tail); its last 10 stay valid behind lazy's run
    front = pool.front
    again = _req(3, [("ids", ids[:4990 * BS] + (0,))])
    assert admit(pool, again) == e_blocks[:4990]
    assert pool.front > front + 5000, "the tail was not rebuilt (fresh positions)"
    assert again.blocks[-1] == l_blocks[-1]
    assert pool.free_order() == [*l_blocks[98::-1], *e_blocks[4999:4989:-1]]
    # one pop across the end of lazy's run into eager's: its hashes are evicted
    big = _req(4, [("seg", (9, 104 * BS))])
    admit(pool, big)
    assert big.blocks == [*l_blocks[98::-1], *e_blocks[4999:4994:-1]]
    gone = eager.seq.block_hashes(5000)[4995:5000]
    assert not any(h in pool.cached for h in gone)
    assert pool.free_order() == e_blocks[4994:4989:-1]
    assert not pool.lazy.get(7)
