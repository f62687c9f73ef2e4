"""Many identical decode steps in one event: ``Engine.max_decode_run`` and ``Engine.complete_decode_run``.

Split out of ``twin.models.engine`` to keep that module about vLLM's scheduling rules: ``RunPath`` is mixed into
``Engine`` and works on its attributes, like ``GroupPath`` (docs/engine.md, "Speed by design").
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twin.models.engine_parts import Step
    from twin.models.request import EngineRequest


class RunPath:
    """``Engine``'s decode-run methods (see the module docstring)."""

    __slots__ = ()

    def max_decode_run(self, step: Step, limit: int) -> int:
        """How many decode steps, starting with ``step``, are guaranteed identical in composition.

        Valid only when ``step.uniform_decode``: every running request decodes one token, nothing was
        admitted or preempted. The run ends at the first step in which a request finishes (that step
        included) or before the first step whose block allocation would not fit.
        """
        mml = self.cfg.max_model_len
        k = limit
        grp = self.grp
        g_n = step.g_n if step.g_epoch == grp.epoch else 0
        if g_n:  # the members' earliest finish or watched count is the top of the complete-time heap
            ch = grp.cheap
            while ch and ch[0][3].g_ver != ch[0][2]:
                heapq.heappop(ch)
            if ch and ch[0][0] - grp.steps < k:
                k = ch[0][0] - grp.steps
        others = self.running[g_n:] if g_n else self.running
        for r in others:
            rem = r.target_output_tokens - r._nout
            by_len = mml - r.seq.num_tokens
            if by_len < rem:
                rem = by_len
            w = r.watch_output
            if w is not None and r._nout < w < r._nout + rem:
                rem = w - r._nout
            if rem < k:
                k = rem
        if k <= 1:
            return 1
        bs = self.kv.block_size
        free = self.kv.num_free
        if len(self.running) * ((k + bs - 2) // bs) <= free:
            return k  # no request allocates more than ceil((k - 1) / bs) blocks in steps 2..k: all fit
        cs = [r.num_computed for r in others]  # after step 1's scheduling
        # members by (c - 1) mod bs, c their num_computed after step 1's scheduling (see DecodeGroup.hist)
        phases = [((key + grp.steps) % bs, h) for key, h in enumerate(grp.hist) if h] if g_n else []

        def new_blocks(m: int) -> int:  # blocks steps 2..m allocate
            return (sum((c + m - 2) // bs - (c - 1) // bs for c in cs)
                    + sum(h * ((x + m - 1) // bs) for x, h in phases))

        if new_blocks(k) <= free:
            return k
        lo, hi = 1, k  # new_blocks(lo) <= free < new_blocks(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if new_blocks(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def complete_decode_run(self, step: Step, m: int, ends_s: list[float]) -> list[EngineRequest]:
        """Apply ``m`` decode steps (the first is ``step``) ending at ``ends_s[0..m-1]``.

        Per request: the blocks of steps 2..m (the tokens sampled in steps 1..m-1), then ``m`` new tokens,
        the first at ``ends_s[0]`` and the last at ``ends_s[m-1]``; as ``m`` calls of ``complete`` would.
        """
        if m == 1:
            return self.complete(step, ends_s[0])
        self.num_steps += m
        kv = self.kv
        mml = self.cfg.max_model_len
        first_s, last_s = ends_s[0], ends_s[m - 1]
        finished: list[EngineRequest] = []
        k = m - 1
        itl_v, itl_w, itl_g = self._gap_v, self._gap_w, self.itl_groups
        bs = kv.block_size
        caching = kv.caching
        counts: dict[str | None, int] = {}  # requests per gap group, in first-seen order (only with itl_g)
        grp = self.grp
        g_n = step.g_n if step.g_epoch == grp.epoch else 0
        broken = False
        if g_n:
            broken = self._g_run(step, m, ends_s, finished, counts)
        for r in (self.running[g_n:] if g_n else self.running) if g_n < len(self.running) else ():
            # kv.allocate_decode(r, ca) for the tokens computed in steps 2..m, its no-op case checked inline
            ca = r.num_computed + k
            if -(-(ca if ca < mml else mml) // bs) > len(r.blocks) or (caching and ca // bs > r.num_cached_blocks):
                ok = kv.allocate_decode(r, ca)
                assert ok, "max_decode_run guaranteed the blocks"
            r.num_computed = ca
            # _emit for a request with output (every request of a decode run has some), inlined
            itl_v.append(first_s - r.last_token_s)
            itl_w.append(1)
            if itl_g is not None:
                g = r.group
                itl_g.append(g)
                counts[g] = counts.get(g, 0) + 1
            seq = r.seq
            seq._out_len += m
            seq.num_tokens += m
            n_out = r._nout = r._nout + m
            r.last_token_s = last_s
            w = r.watch_output
            if r.on_tokens is not None and w is not None and n_out >= w:
                r.on_tokens(r, m, last_s)
            if r.token_times is not None:
                r.token_times.extend(ends_s[:m])
            if n_out >= r.target_output_tokens or seq.num_tokens >= mml:
                finished.append(r)
        self.generation_tokens += m * len(self.running)
        gaps = [ends_s[j] - ends_s[j - 1] for j in range(1, m)]
        if itl_g is None:
            itl_v.extend(gaps)
            itl_w.extend([len(self.running)] * k)
        else:
            g = len(counts)
            if g == 1:
                itl_v.extend(gaps)
            else:  # step-major, groups in first-seen order
                itl_v.extend([gap for gap in gaps for _ in range(g)])
            itl_w.extend(list(counts.values()) * k)
            codes = [itl_g.code(g) for g in counts]
            itl_g.codes.extend(codes * k)
        if finished:
            self._retire(finished, last_s)
        if broken:
            self._g_dissolve()
        self._g_join(last_s)
        return finished
