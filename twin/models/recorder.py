"""Columnar recording of a run: the tidy event table, the level table and the iteration log.

Hot-path calls append to typed columns; tables are built once at the end (``twin.results``). Levels are
written on change, at most once per ``levels_interval_s`` per (scope, metric), while their time-weighted
integral is kept exactly, so means do not depend on the sampling interval.

Why typed columns rather than lists of Python objects: a full fleet records ~9 events per turn and ~3 M
turns in ten simulated minutes. As lists, every event held six pointers plus a float object for its time
and one for its value (~100 bytes); as columns it takes ~34 bytes: times and values as 8-byte doubles,
kinds, scopes and reasons as small codes into a label list (they repeat: a few dozen kinds, one scope per
component, a handful of reasons). Request ids stay a list of the caller's own string objects: a code per
id would need a dict entry and an int object per request, more than the pointer it replaces.
"""

from __future__ import annotations

from array import array

_NAN = float("nan")


class Labels:
    """Strings (or None) interned to small integer codes in first-seen order, so codes are deterministic."""

    __slots__ = ("labels", "index")

    def __init__(self) -> None:
        self.labels: list[str | None] = []
        self.index: dict[str | None, int] = {}

    def code(self, label: str | None) -> int:
        c = self.index.get(label)
        if c is None:
            c = self.index[label] = len(self.labels)
            self.labels.append(label)
        return c


ITERATION_INT_COLUMNS = ("step", "ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens")
ITERATION_COLUMNS = ("step", "t_start_s", "ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens", "elapsed_ms",
                     "kv_usage_pct")


class Recorder:
    def __init__(self, *, levels_interval_s: float = 0.0, record_iterations: bool = False) -> None:
        self.levels_interval_s = levels_interval_s
        self.record_iterations = record_iterations
        # events: one typed column each; kind, scope and reason as codes into their Labels
        self.ev_t = array("d")
        self.ev_kind = array("H")  # a few dozen kinds
        self.ev_scope = array("I")
        self.ev_request: list[str | None] = []
        self.ev_value = array("d")  # NaN where the value is None, told apart by ev_has_value
        self.ev_has_value = array("b")
        self.ev_reason = array("I")
        self.kinds = Labels()
        self.scopes = Labels()
        self.reasons = Labels()
        # the event columns' append methods, then the labels' index lookups, in the order event() uses them
        # (the columns and dicts are never replaced, so the bound methods stay valid)
        self._ev_append = (self.ev_t.append, self.ev_kind.append, self.ev_scope.append, self.ev_request.append,
                           self.ev_value.append, self.ev_has_value.append, self.ev_reason.append,
                           self.kinds.index.get, self.scopes.index.get, self.reasons.index.get)
        # levels: the (scope, metric) pair as one code into lv_keys
        self.lv_t = array("d")
        self.lv_key = array("I")
        self.lv_value = array("d")
        self.lv_keys: list[tuple[str, str]] = []
        # key -> [t_last, value, integral, t_written, t_first, key code]
        self._lv_state: dict[tuple[str, str], list] = {}
        # iteration log
        self.it_scope: list[str] = []
        self.it_cols: dict[str, array] = {k: array("q" if k in ITERATION_INT_COLUMNS else "d")
                                          for k in ITERATION_COLUMNS}

    def event(self, t_s: float, kind: str, scope: str, request_id: str | None = None, value: float | None = None,
              reason: str | None = None) -> None:
        # ~9 calls per turn: the columns' appends and the labels' lookups are bound once (``_ev_append``), and
        # Labels.code is inlined for labels seen before
        t_app, k_app, s_app, id_app, v_app, h_app, r_app, k_get, s_get, r_get = self._ev_append
        t_app(t_s)
        k = k_get(kind)
        k_app(self.kinds.code(kind) if k is None else k)
        s = s_get(scope)
        s_app(self.scopes.code(scope) if s is None else s)
        id_app(request_id)
        if value is None:
            v_app(_NAN)
            h_app(0)
        else:
            v_app(value)
            h_app(1)
        r = r_get(reason)
        r_app(self.reasons.code(reason) if r is None else r)

    def level(self, t_s: float, scope: str, metric: str, value: float) -> None:
        key = (scope, metric)
        st = self._lv_state.get(key)
        if st is None:
            self._lv_state[key] = st = [t_s, value, 0.0, t_s, t_s, len(self.lv_keys)]
            self.lv_keys.append(key)
            self._write_level(t_s, st[5], value)
            return
        if value == st[1]:
            return
        st[2] += st[1] * (t_s - st[0])
        st[0] = t_s
        st[1] = value
        if t_s - st[3] >= self.levels_interval_s:
            st[3] = t_s
            self._write_level(t_s, st[5], value)

    def _write_level(self, t_s: float, key_code: int, value: float) -> None:
        self.lv_t.append(t_s)
        self.lv_key.append(key_code)
        self.lv_value.append(value)

    def level_means(self, end_s: float) -> dict[tuple[str, str], float]:
        """Exact time-weighted mean of every level from its first value to ``end_s``."""
        out = {}
        for key, (t_last, value, integral, _tw, t_first, _code) in self._lv_state.items():
            total = integral + value * max(end_s - t_last, 0.0)
            span = end_s - t_first
            out[key] = total / span if span > 0 else value
        return out

    def close_levels(self, end_s: float) -> None:
        """Write each level's final value at ``end_s`` so the level table spans the run."""
        for st in self._lv_state.values():
            if st[3] < st[0] or st[3] < end_s:
                self._write_level(end_s, st[5], st[1])

    def iteration(self, scope: str, *, step: int, t_start_s: float, ctx_requests: int, ctx_tokens: int,
                  gen_requests: int, gen_tokens: int, elapsed_ms: float, kv_usage_pct: float) -> None:
        self.it_scope.append(scope)
        c = self.it_cols
        c["step"].append(step)
        c["t_start_s"].append(t_start_s)
        c["ctx_requests"].append(ctx_requests)
        c["ctx_tokens"].append(ctx_tokens)
        c["gen_requests"].append(gen_requests)
        c["gen_tokens"].append(gen_tokens)
        c["elapsed_ms"].append(elapsed_ms)
        c["kv_usage_pct"].append(kv_usage_pct)
