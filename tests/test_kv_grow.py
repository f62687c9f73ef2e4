"""The block pool's per-block arrays cover only the blocks handed out so far and grow with them
(``BlockPool._grow``): a pool's never-used blocks cost no memory, and growing changes no result."""

from __future__ import annotations

import pytest

import test_kv_lazy as lazy_side_by_side
from twin.models import kv
from twin.models.kv import BlockPool


def test_the_arrays_grow_with_the_blocks_handed_out() -> None:
    pool = BlockPool(num_blocks=20_000, block_size=16, enable_prefix_caching=True, max_model_len=100_000)
    assert len(pool.st) == len(pool.bhash) == kv._FIRST_CAP < pool.num_blocks
    out: list[int] = []
    pool._pop_free(5_000, out)
    assert out == list(range(1, 5_001)) and pool.fresh == 5_001
    assert len(pool.st) == len(pool.bhash) == 2 * kv._FIRST_CAP  # doubled, not sized to the pool
    assert list(pool.st[1:5_001]) == [-2] * 5_000 and set(pool.st[5_001:]) == {-1}
    pool._pop_free(pool.num_free, out)  # every block: the arrays reach the pool's size and no further
    assert len(pool.st) == len(pool.bhash) == pool.num_blocks and pool.num_free == 0
    pool.stv[1:3] = 7  # the numpy view made again after growing writes through to the array
    assert pool.st[1] == pool.st[2] == 7


def test_a_small_pool_is_covered_from_the_start() -> None:
    pool = BlockPool(num_blocks=300, block_size=16, enable_prefix_caching=True, max_model_len=4_096)
    assert len(pool.st) == len(pool.bhash) == 300


@pytest.mark.parametrize("seed", range(4))
def test_growing_from_two_blocks_changes_nothing_in_the_lazy_pools_side_by_side(seed: int, monkeypatch) -> None:
    """The lazy-against-eager random driver (tests/test_kv_lazy.py: free queues, hits, hash maps and the pools'
    invariants compared after every event) with both pools starting from two blocks, so they grow many times."""
    monkeypatch.setattr(kv, "_FIRST_CAP", 2)
    lazy_side_by_side.test_lazy_registration_matches_eager(seed)


def test_pools_hand_out_the_same_int_objects_for_the_same_block_ids() -> None:
    """A fleet's pools share one int object per block id (``kv._block_ids``): ids past 256 are not cached by
    CPython, and one object per block of every pool was ~1.5 GB at the full fleet."""
    a = BlockPool(num_blocks=5_000, block_size=16, enable_prefix_caching=True, max_model_len=100_000)
    b = BlockPool(num_blocks=9_000, block_size=16, enable_prefix_caching=True, max_model_len=100_000)
    got_a: list[int] = []
    got_b: list[int] = []
    a._pop_free(3_000, got_a)
    b._pop_free(1_000, got_b)
    b._pop_free(7_999, got_b)  # (the shared list grows as pools need more ids)
    assert got_a == list(range(1, 3_001)) and got_b == list(range(1, 9_000))
    assert all(x is y for x, y in zip(got_a, got_b))
    assert got_b[-1] is kv._block_ids(8_999, 9_000)[0]
    assert kv._BLOCK_IDS == list(range(len(kv._BLOCK_IDS)))  # id k at index k, however it grew
