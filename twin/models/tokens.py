"""Token content and chained block hashes, as vLLM's prefix cache sees them.

A request's tokens are a list of *pieces*: either real token ids (a tuple of ints, as in a recorded
run) or a *virtual segment* ``(segment_id, length)`` standing for ``length`` tokens whose ids are
unknown but identical wherever the same segment appears (a shared system prompt, a previous answer
replayed as history). The same content is always written with the same pieces, so two requests that
share a prefix produce the same chained block hashes, exactly as vLLM's ``hash((parent, tokens))``
chain does (vLLM semantics §3.4). Only full blocks are hashed.

Python's ``hash`` of tuples of ints is not salted by PYTHONHASHSEED, so hashes are identical across
runs and processes (determinism), and 64-bit collisions are negligible at fleet scale.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

NONE_HASH = 0x5EED_7717  # the chain's seed, like vLLM's NONE_HASH

# A piece is a tuple of token ids, or a (segment_id, start, length) triple for a virtual segment.
Piece = tuple[int, ...]


# Chains of the full blocks inside a prompt's leading pieces (system prompt, tool schemas), shared by every
# request that starts with the same pieces: key (leading pieces, block size) -> hashes. A chain is entered
# the second time its key is seen, so one-off prompts never fill the memo; both maps are bounded.
_HEAD_MEMO: dict[tuple, list[int]] = {}
_HEAD_SEEN: set[tuple] = set()
_HEAD_MEMO_MAX = 4096
_HEAD_SEEN_MAX = 65536


def clear_chain_memo() -> None:
    """Empty the memo (``twin.runner.run_scenario`` does, per run). The chains are pure functions of their keys,
    so this changes no result; it keeps a run's cost and memory independent of the runs before it in the process
    (a benchmark's capacity run with the same seed would otherwise make its measured run hash the chains of
    every prompt both saw)."""
    _HEAD_MEMO.clear()
    _HEAD_SEEN.clear()


class TokenSeq:
    """An append-only token sequence made of pieces, with lazily extended block hashes.

    ``num_tokens`` is a plain attribute (read in every engine step), kept equal to prompt + output length.
    """

    __slots__ = ("_pieces", "_length", "_hashes", "block_size", "_out_seg", "_out_len", "_out_off", "num_tokens",
                 "_pi", "_pstart")

    def __init__(self, pieces: Iterable[tuple[str, object]], *, block_size: int, output_segment: int,
                 output_offset: int = 0, parent: TokenSeq | None = None) -> None:
        """``output_offset``: the output continues segment ``output_segment`` from this token (a resumed
        answer whose first tokens are already in the prompt). ``parent``: an earlier sequence (the session's
        previous prompt, say); when its prompt's pieces begin this one's, the hashes it has of blocks inside
        its prompt are this one's too (each is a function of the pieces up to the block's end) and are taken
        over instead of computed again."""
        self.block_size = block_size
        self._pieces: list[tuple[int, object, int]] = []  # (kind 0=ids 1=seg, payload, length)
        self._length = 0
        for kind, payload in pieces:
            if kind == "ids":
                ids = tuple(payload)  # type: ignore[arg-type]
                if ids:
                    self._pieces.append((0, ids, len(ids)))
                    self._length += len(ids)
            elif kind == "seg":
                seg, n = payload  # type: ignore[misc]
                if n > 0:
                    self._pieces.append((1, int(seg), int(n)))
                    self._length += int(n)
            else:
                raise ValueError(f"unknown piece kind {kind!r}")
        self._out_seg = output_segment
        self._out_off = output_offset
        self._out_len = 0
        self.num_tokens = self._length
        self._hashes: list[int] = []
        self._pi = 0  # cursor of _extend: index and first token of the piece holding the next block's start
        self._pstart = 0
        if parent is not None and parent.block_size == block_size and parent._hashes:
            own, theirs = self._pieces, parent._pieces
            if len(theirs) <= len(own) and own[:len(theirs)] == theirs:
                # (the cursor at 0 may trail the next block: _extend_from walks it forward). Its output's blocks
                # are not taken over: the engine registers them without hashes (kv_lazy), so it rarely has any.
                self._hashes = parent._hashes[:parent._length // block_size]

    @property
    def prompt_tokens(self) -> int:
        return self._length

    def append_output(self, n: int = 1) -> None:
        self._out_len += n
        self.num_tokens += n

    def block_hashes(self, num_full_blocks: int) -> list[int]:
        """Hashes of the first ``num_full_blocks`` full blocks (extended on demand).

        The list returned may be longer than asked only if an earlier call asked for more.
        """
        if num_full_blocks > len(self._hashes):
            self._extend(num_full_blocks)
        return self._hashes

    def key_runs(self, b0: int, b1: int) -> list[tuple[int | None, int, int]]:
        """Blocks ``b0 <= i < b1`` as runs ``(key, i0, i1)``: a block's *key* is the segment its content starts
        with (the first item of ``_block_content``), or None when it starts with a real token id. Equal content
        gives an equal key, so the block pool can index blocks whose hash it has not computed by key."""
        bs = self.block_size
        out: list[tuple[int | None, int, int]] = []
        pstart = 0
        for kind, payload, length in self._pieces:
            pend = pstart + length
            i0 = -(-pstart // bs)  # blocks whose first token lies in [pstart, pend)
            i1 = -(-pend // bs)
            if i0 < b0:
                i0 = b0
            if i1 > b1:
                i1 = b1
            if i0 < i1:
                out.append((payload if kind == 1 else None, i0, i1))
            pstart = pend
            if pstart >= b1 * bs:
                return out
        i0 = -(-pstart // bs)
        if i0 < b0:
            i0 = b0
        if i0 < b1:
            out.append((self._out_seg, i0, b1))
        return out

    def _head(self, upto: int) -> None:
        """Start the chain from the memo of the leading virtual pieces (at most ``upto`` blocks)."""
        pieces = self._pieces
        bs = self.block_size
        for k in (2, 1):
            if len(pieces) < k or any(p[0] != 1 for p in pieces[:k]):
                continue
            key = (tuple(pieces[:k]), bs)
            chain = _HEAD_MEMO.get(key)
            if chain is None:
                if key in _HEAD_SEEN:
                    if len(_HEAD_MEMO) < _HEAD_MEMO_MAX:
                        n_full = sum(p[2] for p in pieces[:k]) // bs
                        self._extend_from(n_full)
                        _HEAD_MEMO[key] = self._hashes[:n_full]
                        if n_full > upto:
                            del self._hashes[upto:]
                            self._pi = self._pstart = 0  # the cursor may only trail the next block
                        return
                else:
                    if len(_HEAD_SEEN) >= _HEAD_SEEN_MAX:
                        _HEAD_SEEN.clear()
                    _HEAD_SEEN.add(key)
                continue
            self._hashes.extend(chain[:upto])
            return

    def _extend(self, upto: int) -> None:
        hashes = self._hashes
        if hashes and upto == len(hashes) + 1:
            start = len(hashes) * self.block_size
            if start >= self._length:
                # One block inside the output segment (a decode filling a block): _extend_from's output fast
                # path without its piece cursor, which may trail (it is only ever advanced).
                a = start - self._length + self._out_off
                hashes.append(hash((hashes[-1], ((self._out_seg, a, a + self.block_size),))))
                return
        if not hashes:
            self._head(upto)
            if len(self._hashes) >= upto:
                return
        self._extend_from(upto)

    def _extend_from(self, upto: int) -> None:
        bs = self.block_size
        hashes = self._hashes
        parent = hashes[-1] if hashes else NONE_HASH
        pieces = self._pieces
        n_pieces = len(pieces)
        b = len(hashes)
        pi, pstart = self._pi, self._pstart
        while b < upto:
            start = b * bs
            while pi < n_pieces and pstart + pieces[pi][2] <= start:
                pstart += pieces[pi][2]
                pi += 1
            if pi < n_pieces:
                kind, seg, length = pieces[pi]
                if kind == 1 and start + bs <= pstart + length:
                    # fast path: the block lies inside one virtual segment (same content tuple as below)
                    a = start - pstart
                    last = min(upto, b + (pstart + length - start) // bs)
                    while b < last:
                        parent = hash((parent, ((seg, a, a + bs),)))
                        hashes.append(parent)
                        a += bs
                        b += 1
                    continue
            elif start >= self._length:
                # fast path: the block lies inside the output segment (same content tuple as below)
                seg, off = self._out_seg, self._out_off
                a = start - self._length + off
                while b < upto:
                    parent = hash((parent, ((seg, a, a + bs),)))
                    hashes.append(parent)
                    a += bs
                    b += 1
                break
            parent = hash((parent, self._block_content(start, bs)))
            hashes.append(parent)
            b += 1
        self._pi, self._pstart = pi, pstart

    def _block_content(self, start: int, n: int) -> tuple:
        """Canonical description of tokens [start, start+n)."""
        out: list[object] = []
        pos = 0
        end = start + n
        for kind, payload, length in self._pieces:
            p_end = pos + length
            if p_end > start and pos < end:
                a = max(start, pos) - pos
                z = min(end, p_end) - pos
                if kind == 0:
                    out.extend(payload[a:z])  # type: ignore[index]
                elif out and isinstance(out[-1], tuple) and out[-1][0] == payload and out[-1][2] == a:
                    out[-1] = (payload, out[-1][1], z)  # contiguous pieces of one segment read as one
                else:
                    out.append((payload, a, z))
            pos = p_end
            if pos >= end:
                break
        if end > pos:  # the output segment
            a = max(start, pos) - pos
            z = end - pos
            off = self._out_off
            seg = self._out_seg
            if out and isinstance(out[-1], tuple) and out[-1][0] == seg and out[-1][2] == a + off:
                out[-1] = (seg, out[-1][1], z + off)  # a resumed answer continues its own segment
            else:
                out.append((seg, a + off, z + off))  # same form as a ("seg", ...) piece: answers replay
        return tuple(out)


def pieces_from_ids(ids: Sequence[int]) -> list[tuple[str, object]]:
    return [("ids", tuple(ids))]


def chained_block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of a token-id list (for routers' own prefix indexes and tests)."""
    seq = TokenSeq(pieces_from_ids(ids), block_size=block_size, output_segment=0)
    return list(seq.block_hashes(len(ids) // block_size))
