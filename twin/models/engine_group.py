"""The engine's decode-group path: the steadily decoding prefix of ``running`` scheduled and completed as
a whole (``DecodeGroup`` in ``twin.models.engine_parts`` holds its state; docs/engine.md, "Speed by design").

Split out of ``twin.models.engine`` to keep that module about vLLM's scheduling rules: ``GroupPath`` is mixed
into ``Engine`` and works on its attributes (``grp``, ``kv``, ``running``, the inter-token-gap columns);
``tests/test_decode_group.py`` runs the engine with and without it side by side.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

from twin.models.request import EngineRequest, Status

if TYPE_CHECKING:
    from twin.models.engine_parts import Step


_by_adm = attrgetter("adm")
_second = itemgetter(1)


def _pair_adm(p: tuple[EngineRequest, int]) -> int:
    return p[0].adm


class GroupPath:
    """``Engine``'s decode-group methods (see the module docstring)."""

    __slots__ = ()

    def _g_schedule(self, step: Step, budget: int) -> int:
        """Phase A for the group's members (``running[:n]``, each decoding one token): their touches due at
        this step, then every member into ``step`` at once. Returns the members scheduled, or 0 after
        dissolving the group when the fast path cannot be exact (budget, or a block it may not get)."""
        grp, kv = self.grp, self.kv
        n = grp.n
        s = grp.steps + 1
        due = grp.take_sched(s)
        # one block each (see DecodeGroup): grp.take_per(s, s, True), inlined
        per = list(map(_second, slot)) if grp.n_per and (slot := grp.per[s % grp.bs]) else ()
        if not due and not per:
            if n > budget:
                self._g_dissolve()
                return 0
            return self._g_step(step, n)
        bs = grp.bs
        free = kv.num_free
        if n > budget or (len(due) + len(per) > free  # (the exact count of blocks due only when it could matter)
                          and len(per) + sum(1 for r in due if (r.num_computed + grp.steps - r.g_base) % bs == 0)
                          > free):
            self._g_dissolve()
            return 0
        caching = kv.caching
        S, bs1 = grp.steps, bs - 1
        push, push_per = grp.push_sched, grp.push_per
        grow: list[EngineRequest] = []
        reg: list[EngineRequest] = []
        for r in due:  # in running order, as Phase A would reach them
            c = r.num_computed + S - r.g_base
            c1 = c + 1
            q = c % bs
            if q == 0 or len(r.blocks) * bs < c1:
                grow.append(r)
            if q == bs1 and caching and c1 // bs > r.num_cached_blocks:
                reg.append(r)  # a block that starts in the prompt (see _g_push)
            # self._g_push(r, s + 1, c1), inlined: c1 % bs is q + 1, or 0 when q is bs - 1
            if not caching or c1 - c1 % bs >= r.seq._length:
                push_per(r, s + bs - q)
            else:
                push(r, s + 1 if q == bs1 else s + bs1 - q)
        if grow:
            self._g_grow(grow, per, 1)
        elif per:
            self._g_deal(per)
        for r in reg:  # after every allocation (see _g_grow)
            kv._cache_upto(r, (r.num_computed + S - r.g_base + 1) // bs)
        return self._g_step(step, n)

    def _g_deal(self, per: list[EngineRequest]) -> None:
        """``_g_grow`` for members that need one block each."""
        got: list[int] = []
        self.kv._pop_free(len(per), got)
        for r, b in zip(per, got):
            r.blocks.append(b)

    def _g_grow(self, grow: list[EngineRequest], per, m: int) -> None:
        """The blocks that members ``grow`` need for the tokens of group steps up to ``steps + m``, and one block
        each for the deferred members ``per`` whose block step falls in those steps (each list in running order;
        the blocks only: a member's registration is deferred, ``kv.pend``). One pop off the free queue for all of
        them, dealt out in running order: the same blocks sequential allocations would take. Only ``grow``'s needs
        are computed: a member of ``per`` needs exactly one (its block step is its only one in the steps; the
        run or step stops before ``max_model_len``), and ``per`` is most of the members touched. The callers
        register the few blocks due on time (those starting in the prompt) after it, not between allocations:
        the same maps, as an eviction and a registration commute (evicting a hash promotes its earliest
        duplicate, which is where a registration after the eviction puts the new block)."""
        kv, grp = self.kv, self.grp
        bs, mml, S = grp.bs, grp.mml, grp.steps
        needs = []
        total = 0
        for r in grow:
            ca = r.num_computed + S - r.g_base + m
            k = -(-(ca if ca < mml else mml) // bs) - len(r.blocks)
            needs.append(k)
            total += k
        one_each = total == len(grow)  # (every need is at least one)
        total += len(per)
        assert total <= kv.num_free, "counted against num_free (a step) or guaranteed by max_decode_run (a run)"
        got: list[int] = []
        kv._pop_free(total, got)
        if one_each:  # one block each (the usual case)
            for r, b in zip(sorted(grow + per, key=_by_adm) if per else grow, got):
                r.blocks.append(b)
        else:
            pairs = sorted([*zip(grow, needs), *((r, 1) for r in per)], key=_pair_adm) if per else zip(grow, needs)
            j = 0
            for r, k in pairs:
                r.blocks.extend(got[j:j + k])
                j += k

    def _g_step(self, step: Step, n: int) -> int:
        """The group's ``n`` members into ``step``, one token each."""
        grp = self.grp
        step.reqs = self.running[:n]
        step.ns = [1] * n
        step.g_n = n
        step.g_epoch = grp.epoch
        grp.csum += n
        grp.infl = 1
        return n

    def _g_join(self, end_s: float) -> None:
        """After a completion: running requests right after the members that decode steadily join."""
        grp, running = self.grp, self.running
        grp.last_s = end_s
        n = grp.n
        if n == len(running) or not self.use_group:
            return
        itl_g = self.itl_groups
        mml, S = self.cfg.max_model_len, grp.steps
        pend = self.kv.pend if self.kv.caching else None
        while n < len(running):
            r = running[n]
            o = r._nout
            w = r.watch_output
            c = r.num_computed
            if (r.status != Status.RUNNING or o <= 0 or c != r.seq.num_tokens - 1 or r.last_token_s != end_s
                    or r.token_times is not None or (w is not None and w <= o) or c >= mml - 1):
                break
            if pend is not None and r.seq._out_seg in pend:
                break  # another member defers registration under this segment (a resumed answer)
            if itl_g is not None:
                code = itl_g._index.get(r.group)
                if code is None:  # a label not recorded yet: let the per-request path record it first
                    break
                grp.ncode[code] = grp.ncode.get(code, 0) + 1
            if pend is not None:
                pend[r.seq._out_seg] = r
            grp.ver += 1
            r.g_ver = grp.ver
            r.g_base = S
            r._grp = grp
            grp.csum += c
            grp.hist[(c - S) % grp.bs] += 1
            self._g_push(r, S + 1, c)
            grp.push_complete(r)
            n += 1
        grp.n = n

    def _g_push(self, r: EngineRequest, s: int, c: int) -> None:
        """Push the member's next schedule-time touch from group step ``s``, whose scheduling finds ``c``
        computed tokens: the next block to allocate (in ``per``), or while the block being filled starts in the
        prompt (its key may be shared, so it is registered on time), the step that fills it too (in ``sched``).
        Blocks that start in the output are registered when the member leaves (``kv.pend``): one call for all
        of them, not one touch each."""
        grp = self.grp
        if not self.kv.caching or c - c % grp.bs >= r.seq._length:
            grp.push_per(r, s + (-c) % grp.bs)
        else:
            grp.push_sched(r, grp.next_sched(s, c))

    def _g_write_out(self, r: EngineRequest) -> None:
        """A member that has just left (fields written, ``_grp`` cleared): its deferred registration written,
        its segment out of ``kv.pend``."""
        kv = self.kv
        if kv.caching:
            kv._write_pending(r)
            key = r.seq._out_seg
            if kv.pend.get(key) is r:
                del kv.pend[key]

    def _g_leave(self, r: EngineRequest) -> int:
        """``r`` leaves the group with its true values written; returns its index in ``running`` (the caller
        takes it out)."""
        grp = self.grp
        idx = self.running.index(r)
        assert idx < grp.n
        grp.hist[(r.num_computed - r.g_base) % grp.bs] -= 1
        grp.materialise(r)
        grp.csum -= r.num_computed
        if self.itl_groups is not None:
            code = self.itl_groups._index[r.group]
            left = grp.ncode[code] - 1
            if left:
                grp.ncode[code] = left
            else:
                del grp.ncode[code]
        grp.n -= 1
        grp.drop_per(r)
        r.g_ver = None
        r._grp = None
        self._g_write_out(r)
        return idx

    def _g_dissolve(self) -> None:
        """Every member back to plain per-request state (true values written; in-flight token included)."""
        grp = self.grp
        for r in self.running[:grp.n]:
            grp.materialise(r)
            r.g_ver = None
            r.g_pl = None
            r._grp = None
            self._g_write_out(r)
        grp.n = grp.csum = grp.infl = grp.n_per = 0
        grp.hist = [0] * grp.bs
        grp.sched.clear()
        for lst in grp.per:
            lst.clear()
        grp.scur = grp.steps
        grp.cheap.clear()
        grp.ncode.clear()
        grp.epoch += 1

    def _g_emit(self, step: Step, first_s: float) -> int:
        """The members' inter-token gaps for a completing group step (all equal: every member's last token
        came at the end of the previous step): one entry weighted by the member count, or with gap groups one
        per group code, weighted by its members. Returns the member count."""
        grp = self.grp
        n = step.g_n
        gap = first_s - grp.last_s
        itl_g = self.itl_groups
        if itl_g is None:
            self._gap_v.append(gap)
            self._gap_w.append(n)
        else:
            gv, gw, gc = self._gap_v, self._gap_w, itl_g.codes
            for c, k in grp.ncode.items():
                gv.append(gap)
                gw.append(k)
                gc.append(c)
        return n

    def _g_run(self, step: Step, m: int, ends_s: list[float], finished: list[EngineRequest],
               counts: dict[str | None, int]) -> bool:
        """``complete_decode_run`` for the members (they come first in running order): the blocks of steps
        2..m of those with a block due in them, the first gaps in bulk, the members finishing or reaching a
        watched count at step m. Fills ``finished`` and ``counts``; True if the group must be dissolved."""
        grp, kv = self.grp, self.kv
        S = grp.steps
        sm = S + m
        bs, mml, caching = grp.bs, grp.mml, kv.caching
        due = grp.take_sched(sm)  # in running order: one call per request, as the per-request loop makes
        per = ()
        if grp.n_per:
            if m - 1 <= bs:  # each deferred member's block step in S + 2 .. sm is its only one: one block each
                per = grp.take_per(S + 2, sm, True)
            else:  # (a long run: the general path below)
                due = sorted(due + grp.take_per(S + 2, sm, False), key=_by_adm)
        push, push_per = grp.push_sched, grp.push_per
        grow: list[EngineRequest] = []
        reg: list[EngineRequest] = []
        for r in due:
            ca = r.num_computed + S - r.g_base + m  # computed after steps 1..m are scheduled
            if -(-(ca if ca < mml else mml) // bs) > len(r.blocks):
                grow.append(r)
            if caching and ca // bs > r.num_cached_blocks and r.num_cached_blocks * bs < r.seq._length:
                reg.append(r)  # a block that starts in the prompt, filled in this run (see _g_push)
            qa = ca % bs  # self._g_push(r, sm + 1, ca), inlined
            if not caching or ca - qa >= r.seq._length:
                push_per(r, sm + 1 + (bs - qa) % bs)
            else:
                push(r, sm + 1 if qa == 0 else sm + bs - qa)
        if grow:
            self._g_grow(grow, per, m)
        elif per:
            self._g_deal(per)
        for r in reg:  # after every allocation (see _g_grow)
            kv._cache_upto(r, (r.num_computed + S - r.g_base + m) // bs)
        self._g_emit(step, ends_s[0])
        itl_g = self.itl_groups
        if itl_g is not None:
            labels = itl_g.labels
            for c, k in grp.ncode.items():
                counts[labels[c]] = k
        last_s = ends_s[m - 1]
        broken = False
        for r in (grp.pop_due(grp.cheap, sm) if grp.cheap and grp.cheap[0][0] <= sm else ()):  # (the run ends at the first)
            r._grp = None
            grp.materialise(r)
            r.num_computed += m - 1
            seq = r.seq
            seq._out_len += m
            seq.num_tokens += m
            n_out = r._nout = r._nout + m
            r.last_token_s = last_s
            r.g_base = sm
            w = r.watch_output
            if r.on_tokens is not None and w is not None and n_out >= w:
                r.on_tokens(r, m, last_s)
            r._grp = grp
            if n_out >= r.target_output_tokens or seq.num_tokens >= mml:
                finished.append(r)
            elif r.watch_output is not None and r.watch_output <= n_out:
                broken = True
            else:
                grp.push_complete(r)
        grp.csum += (m - 1) * step.g_n  # the tokens of steps 2..m
        grp.steps = sm
        grp.infl = 0
        return broken
