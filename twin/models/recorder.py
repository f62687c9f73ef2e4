"""Columnar recording of a run: the tidy event table, the level table and the iteration log.

Hot-path calls append to plain lists; tables are built once at the end (``twin.results``). Levels are
written on change, at most once per ``levels_interval_s`` per (scope, metric), while their time-weighted
integral is kept exactly, so means do not depend on the sampling interval.
"""

from __future__ import annotations


class Recorder:
    def __init__(self, *, levels_interval_s: float = 0.0, record_iterations: bool = False) -> None:
        self.levels_interval_s = levels_interval_s
        self.record_iterations = record_iterations
        # events
        self.ev_t: list[float] = []
        self.ev_kind: list[str] = []
        self.ev_scope: list[str] = []
        self.ev_request: list[str | None] = []
        self.ev_value: list[float | None] = []
        self.ev_reason: list[str | None] = []
        # levels
        self.lv_t: list[float] = []
        self.lv_scope: list[str] = []
        self.lv_metric: list[str] = []
        self.lv_value: list[float] = []
        self._lv_state: dict[tuple[str, str], list[float]] = {}  # key -> [t_last, value, integral, t_written, t_first]
        # iteration log
        self.it_scope: list[str] = []
        self.it_cols: dict[str, list[float]] = {k: [] for k in (
            "step", "t_start_s", "ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens", "elapsed_ms",
            "kv_usage_pct")}
        # inter-token gaps, weighted
        self.itl_values: list[float] = []
        self.itl_weights: list[int] = []

    def event(self, t_s: float, kind: str, scope: str, request_id: str | None = None, value: float | None = None,
              reason: str | None = None) -> None:
        self.ev_t.append(t_s)
        self.ev_kind.append(kind)
        self.ev_scope.append(scope)
        self.ev_request.append(request_id)
        self.ev_value.append(value)
        self.ev_reason.append(reason)

    def level(self, t_s: float, scope: str, metric: str, value: float) -> None:
        key = (scope, metric)
        st = self._lv_state.get(key)
        if st is None:
            self._lv_state[key] = [t_s, value, 0.0, t_s, t_s]
            self._write_level(t_s, scope, metric, value)
            return
        if value == st[1]:
            return
        st[2] += st[1] * (t_s - st[0])
        st[0] = t_s
        st[1] = value
        if t_s - st[3] >= self.levels_interval_s:
            st[3] = t_s
            self._write_level(t_s, scope, metric, value)

    def _write_level(self, t_s: float, scope: str, metric: str, value: float) -> None:
        self.lv_t.append(t_s)
        self.lv_scope.append(scope)
        self.lv_metric.append(metric)
        self.lv_value.append(value)

    def level_means(self, end_s: float) -> dict[tuple[str, str], float]:
        """Exact time-weighted mean of every level from its first value to ``end_s``."""
        out = {}
        for key, (t_last, value, integral, _tw, t_first) in self._lv_state.items():
            total = integral + value * max(end_s - t_last, 0.0)
            span = end_s - t_first
            out[key] = total / span if span > 0 else value
        return out

    def close_levels(self, end_s: float) -> None:
        """Write each level's final value at ``end_s`` so the level table spans the run."""
        for (scope, metric), st in self._lv_state.items():
            if st[3] < st[0] or st[3] < end_s:
                self._write_level(end_s, scope, metric, st[1])

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
