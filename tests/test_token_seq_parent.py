"""A token sequence that takes over its parent's block hashes (``TokenSeq(parent=...)``, the session's previous
prompt) hashes every block as one built from nothing: random prompts that extend an earlier one (with or without
its answer replayed), repeat, cut or change it, with real-id and virtual pieces, blocks across piece boundaries
and parents hashed only in part."""

from __future__ import annotations

import random

from twin.models.tokens import TokenSeq, clear_chain_memo


def _piece(rng: random.Random):
    if rng.random() < 0.3:
        return ("ids", tuple(rng.randrange(32000) for _ in range(rng.randint(1, 40))))
    return ("seg", (rng.randrange(5), rng.randint(1, 90)))


def _full(seq: TokenSeq, bs: int) -> list[int]:
    return list(seq.block_hashes(seq.num_tokens // bs)[: seq.num_tokens // bs])


def test_hashes_taken_over_from_a_parent_are_the_ones_computed_from_nothing() -> None:
    rng = random.Random(11)
    taken = 0
    for trial in range(400):
        clear_chain_memo()
        bs = rng.choice([4, 16])
        base = [_piece(rng) for _ in range(rng.randint(1, 6))]
        # a resumed answer's output continues its segment from an offset: its blocks are not the answer piece's
        parent = TokenSeq(base, block_size=bs, output_segment=99, output_offset=rng.choice([0, 0, 5]))
        n_parent = sum(p[1][1] if p[0] == "seg" else len(p[1]) for p in base) // bs
        parent.block_hashes(rng.randint(0, n_parent))  # hashed in part, or not at all
        if rng.random() < 0.6:
            parent.append_output(rng.randint(1, 50))
            parent.block_hashes(parent.num_tokens // bs)  # output blocks too
        kind = rng.random()
        if kind < 0.3:  # the next turn: the prompt extended
            pieces = base + [_piece(rng) for _ in range(rng.randint(1, 4))]
        elif kind < 0.6:  # the next turn: its answer (whole, cut or longer than generated), then a message
            pieces = base + [("seg", (99, rng.randint(1, 60))), _piece(rng)]
        elif kind < 0.7:  # a retry: the same prompt
            pieces = list(base)
        elif kind < 0.85:  # history cut from the front: not a prefix
            pieces = base[1:] + [_piece(rng)]
        else:  # a changed piece in the middle
            pieces = list(base)
            pieces[rng.randrange(len(pieces))] = _piece(rng)
        bs_child = bs if rng.random() < 0.9 else 8  # another model's block size: nothing taken over
        child = TokenSeq(pieces, block_size=bs_child, output_segment=7, parent=parent)
        taken += len(child._hashes)
        fresh = TokenSeq(pieces, block_size=bs_child, output_segment=7)
        assert _full(child, bs_child) == _full(fresh, bs_child), trial
        child.append_output(rng.randint(1, 40))
        fresh.append_output(child.num_tokens - fresh.num_tokens)
        assert _full(child, bs_child) == _full(fresh, bs_child), trial
    assert taken > 1000  # the parent path was taken, not only the fallback


def test_nothing_is_taken_over_when_the_parent_is_not_a_prefix() -> None:
    parent = TokenSeq([("seg", (1, 64)), ("seg", (2, 64))], block_size=16, output_segment=9)
    parent.block_hashes(8)
    assert len(TokenSeq([("seg", (1, 64)), ("seg", (3, 64))], block_size=16, output_segment=9,
                        parent=parent)._hashes) == 0
    assert len(TokenSeq([("seg", (1, 64)), ("seg", (2, 64)), ("seg", (3, 8))], block_size=16, output_segment=9,
                        parent=parent)._hashes) == 8
