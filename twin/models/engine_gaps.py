"""The engine's inter-token gaps: written as they happen, with a decode-group step's gaps as one run.

``Engine.itl_values`` and ``Engine.itl_weights`` are (value_s, weight) pairs, one weight per token the value
applies to, in the order the engine produces them (typed arrays: 8 + 4 bytes a gap). A decode-group step
gives every member the same gap; it used to be written as ``n`` copies at once (a temporary ``array * n``,
then ``extend``) into two growing arrays (~1.2 M single gaps per 10,000 single-replica requests; that write
pattern alone, 20,766 steps of 57 gaps, took 80 ms in a micro-benchmark against 1.6 ms for one entry a step;
inside the benchmark's run the measured cut was smaller: -0.3% of callgrind's instructions, the rest of the
old cost being reallocation copies and page faults that instruction counts do not weigh). Now the hot paths
write into short *pending* arrays, where a group step is one entry plus its
position and member count (``_gap_at``, ``_gap_n``); reading ``itl_values`` or ``itl_weights`` first
expands the pending entries, with numpy, onto the end of the arrays readers see: the same values and
weights in the same order, so every quantile, sum and mean taken from them is the same, bit for bit.
(A reader during a run, such as the autoscaler's window, sees every gap written so far.)

``GapColumns`` is mixed into ``twin.models.engine.Engine``; the group labels (``itl_groups``) are written
directly, one per gap, as before.
"""

from __future__ import annotations

from array import array

import numpy as np


class GapColumns:
    """``Engine``'s inter-token-gap columns (see the module docstring)."""

    __slots__ = ()

    def _gaps_init(self) -> None:
        self._itl_v = array("d")  # the expanded gaps readers see
        self._itl_w = array("I")
        self._gap_v = array("d")  # pending gaps, written by the hot paths
        self._gap_w = array("I")
        self._gap_at = array("q")  # pending entries that stand for a group step's gaps ...
        self._gap_n = array("q")  # ... and how many (one per member)

    def _gap_run(self, value: float, n: int) -> None:
        """``n`` gaps of ``value``, weight 1 each (a group step's members)."""
        gv = self._gap_v
        self._gap_at.append(len(gv))
        self._gap_n.append(n)
        gv.append(value)
        self._gap_w.append(1)

    def _gaps_flush(self) -> None:
        """Expand the pending entries onto the readers' arrays, in order, and clear them."""
        gv, gw = self._gap_v, self._gap_w
        if not gv:
            return
        v = np.frombuffer(gv, np.float64)
        w = np.frombuffer(gw, np.uint32)
        if self._gap_at:
            reps = np.ones(len(gv), np.int64)
            reps[np.frombuffer(self._gap_at, np.int64)] = np.frombuffer(self._gap_n, np.int64)
            v = np.repeat(v, reps)
            w = np.repeat(w, reps)
        self._itl_v.frombytes(memoryview(v).cast("B"))
        self._itl_w.frombytes(memoryview(w).cast("B"))
        del v, w  # (the views export the pending arrays' buffers: released before they are cleared)
        del gv[:], gw[:], self._gap_at[:], self._gap_n[:]

    @property
    def itl_values(self) -> array:
        self._gaps_flush()
        return self._itl_v

    @property
    def itl_weights(self) -> array:
        self._gaps_flush()
        return self._itl_w
