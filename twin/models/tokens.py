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


class TokenSeq:
    """An append-only token sequence made of pieces, with lazily extended block hashes."""

    __slots__ = ("_pieces", "_length", "_hashes", "block_size", "_out_seg", "_out_len", "_out_off")

    def __init__(self, pieces: Iterable[tuple[str, object]], *, block_size: int, output_segment: int,
                 output_offset: int = 0) -> None:
        """``output_offset``: the output continues segment ``output_segment`` from this token (a resumed
        answer whose first tokens are already in the prompt)."""
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
        self._hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return self._length + self._out_len

    @property
    def prompt_tokens(self) -> int:
        return self._length

    def append_output(self, n: int = 1) -> None:
        self._out_len += n

    def block_hashes(self, num_full_blocks: int) -> list[int]:
        """Hashes of the first ``num_full_blocks`` full blocks (extended on demand)."""
        if num_full_blocks > len(self._hashes):
            self._extend(num_full_blocks)
        return self._hashes

    def _extend(self, upto: int) -> None:
        bs = self.block_size
        hashes = self._hashes
        parent = hashes[-1] if hashes else NONE_HASH
        pieces = self._pieces
        # cursor over pieces: index and start offset of the piece holding the next block's first token
        pi, pstart = 0, 0
        b = len(hashes)
        start = b * bs
        while pi < len(pieces) and pstart + pieces[pi][2] <= start:
            pstart += pieces[pi][2]
            pi += 1
        while b < upto:
            start = b * bs
            while pi < len(pieces) and pstart + pieces[pi][2] <= start:
                pstart += pieces[pi][2]
                pi += 1
            if pi < len(pieces) and pieces[pi][0] == 1 and start + bs <= pstart + pieces[pi][2]:
                # fast path: the block lies inside one virtual segment (same content tuple as below)
                seg = pieces[pi][1]
                a = start - pstart
                last = min(upto, b + (pstart + pieces[pi][2] - start) // bs)
                while b < last:
                    parent = hash((parent, ((seg, a, a + bs),)))
                    hashes.append(parent)
                    a += bs
                    b += 1
                continue
            parent = hash((parent, self._block_content(start, bs)))
            hashes.append(parent)
            b += 1

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
