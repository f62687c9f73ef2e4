"""The engine's inter-token gaps: a weighted sample, one entry per distinct gap a step gives.

``Engine.itl_values`` and ``Engine.itl_weights`` are (value_s, weight) entries: an entry stands for
``weight`` gaps of that value (typed arrays, 8 + 4 bytes an entry), and ``Engine.itl_groups`` (when
tracked) gives each entry's group label. A request decoding on its own writes one entry of weight 1 per
token; a decode-group step gives every member the same gap and writes one entry per group label present,
weighted by its member count; a decode run's later steps write one entry per step and label, weighted by
the batch. Every statistic read from them is a weighted one: the quantiles are the smallest value whose
cumulative weight reaches the target, and the mean (``twin.metrics.weighted_mean``) is the exact weighted sum
rounded once, so an entry of weight n and n entries of weight 1 give the same figures, bit for bit.

Until 2026-11-30 a group step's entry was expanded into one gap per member when the columns were read
(~400 gaps per turn in a fleet run, 12 bytes each, and the fleet summary's products 8 more), because the
mean was a pairwise float sum over the expanded gaps in order; the exact mean made the expansion
unnecessary. At 0.0625x for 10 simulated minutes the fleet's 61.9 M gaps are now 1.3 M entries
(docs/performance-rounds.md, "Round 10").

``GapColumns`` is mixed into ``twin.models.engine.Engine``.
"""

from __future__ import annotations

from array import array


class GapColumns:
    """``Engine``'s inter-token-gap columns (see the module docstring)."""

    __slots__ = ()

    def _gaps_init(self) -> None:
        self._gap_v = array("d")  # gap values
        self._gap_w = array("I")  # how many gaps each entry stands for

    @property
    def itl_values(self) -> array:
        return self._gap_v

    @property
    def itl_weights(self) -> array:
        return self._gap_w
