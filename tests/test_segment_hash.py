"""The client's segment hashes are ``stable_hash`` of ``prefix/key``, computed from a copied hash state."""

from __future__ import annotations

import pytest

from twin.models.client import ANSWER_SEG, MESSAGE_SEG, SegmentHash
from twin.rng import stable_hash


@pytest.mark.parametrize("prefix", ["message", "answer", "retrieved", "toolcall", "toolresult", "", "ünï/côde"])
@pytest.mark.parametrize("key", ["s0000001-t0", "", "x" * 300, "s0000042-t7/g1", "日本語-t3"])
def test_segment_hash_is_stable_hash_of_the_joined_name(prefix: str, key: str) -> None:
    assert SegmentHash(prefix)(key) == stable_hash(f"{prefix}/{key}")


def test_the_state_is_copied_not_consumed() -> None:
    # a second call must not see the first call's key (the prefix state is copied for every key)
    assert MESSAGE_SEG("a") == MESSAGE_SEG("a") == stable_hash("message/a")
    assert ANSWER_SEG("s1-t0") != MESSAGE_SEG("s1-t0")
    assert 0 <= MESSAGE_SEG("s1-t0") < 2**63
