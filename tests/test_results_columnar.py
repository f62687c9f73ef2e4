"""The columnar recorder and end-of-run tables against their per-row definitions.

The reference functions below are the per-event, dict-per-request code the tables were first defined by
(twin/results.py at caf03de). Random event streams, including orders a real run does not produce
(a request scheduled before it arrived, arriving twice, finishing twice), must give the same tables and
summary, value for value and type for type.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.models.recorder import Recorder
from twin.results import (ATTR_COLUMNS, TERMINAL_KINDS, events_table, iterations_table, levels_table,
                          requests_table, summarize)


def reference_requests_table(events: pa.Table, token_times=None, attrs=None) -> pa.Table:
    kinds = events.column("kind").to_pylist()
    rids = events.column("request_id").to_pylist()
    ts = events.column("t_s").to_pylist()
    vals = events.column("value").to_pylist()
    reasons = events.column("reason").to_pylist()
    scopes = events.column("scope").to_pylist()
    rows: dict[str, dict[str, Any]] = {}
    for kind, rid, t, v, reason, scope in zip(kinds, rids, ts, vals, reasons, scopes):
        if rid is None or not kind.startswith("request."):
            continue
        row = rows.get(rid)
        if row is None:
            row = rows[rid] = {"request_id": rid, "arrival_s": math.nan, "prompt_tokens": 0, "scope": None,
                               "queue_s": math.nan, "num_cached_tokens": None, "first_token_s": math.nan,
                               "finish_s": math.nan, "output_tokens": 0, "preemptions": 0, "outcome": "unfinished",
                               "reason": None}
        if kind == "request.arrived":
            row["arrival_s"] = t
            row["prompt_tokens"] = int(v)
        elif kind in ("request.scheduled", "request.dispatched"):
            if row["queue_s"] == row["queue_s"]:
                continue
            row["queue_s"] = t - row["arrival_s"]
            if v is not None:
                row["num_cached_tokens"] = int(v)
            row["scope"] = scope if kind == "request.scheduled" else reason
        elif kind == "request.retried":
            row["retries"] = row.get("retries", 0) + 1
        elif kind == "request.first_token":
            row["first_token_s"] = t
            if v is not None and row["num_cached_tokens"] is None:
                row["num_cached_tokens"] = int(v)
        elif kind == "request.preempted":
            row["preemptions"] += 1
        elif kind in TERMINAL_KINDS:
            row["outcome"] = TERMINAL_KINDS[kind]
            row["finish_s"] = t
            if v is not None:
                row["output_tokens"] = int(v)
            row["reason"] = reason
    ordered = list(rows.values())
    arrival = np.array([r["arrival_s"] for r in ordered], dtype=np.float64)
    first = np.array([r["first_token_s"] for r in ordered], dtype=np.float64)
    finish = np.array([r["finish_s"] for r in ordered], dtype=np.float64)
    out_tok = np.array([r["output_tokens"] for r in ordered], dtype=np.int64)
    ttft = first - arrival
    e2e = np.where(np.array([r["outcome"] == "completed" for r in ordered], dtype=bool), finish - arrival, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out_tok > 1, (finish - first) / (out_tok - 1), np.nan)
    cols: dict[str, Any] = {
        "request_id": pa.array([r["request_id"] for r in ordered], pa.string()),
        "scope": pa.array([r["scope"] for r in ordered], pa.string()),
        "arrival_s": pa.array(arrival),
        "prompt_tokens": pa.array([r["prompt_tokens"] for r in ordered], pa.int64()),
        "output_tokens": pa.array(out_tok),
        "num_cached_tokens": pa.array([r["num_cached_tokens"] for r in ordered], pa.int64()),
        "queue_s": pa.array([r["queue_s"] for r in ordered], pa.float64()),
        "ttft_s": pa.array(ttft),
        "tpot_s": pa.array(tpot),
        "e2e_s": pa.array(e2e),
        "finish_s": pa.array(finish),
        "preemptions": pa.array([r["preemptions"] for r in ordered], pa.int64()),
        "outcome": pa.array([r["outcome"] for r in ordered], pa.string()),
        "reason": pa.array([r["reason"] for r in ordered], pa.string()),
    }
    cols["retries"] = pa.array([r.get("retries", 0) for r in ordered], pa.int64())
    if attrs is not None:
        for j, name in enumerate(ATTR_COLUMNS):
            cols[name] = pa.array([attrs.get(r["request_id"], (None,) * len(ATTR_COLUMNS))[j] for r in ordered],
                                  pa.string())
    if token_times is not None:
        cols["token_times_s"] = pa.array(
            [[t - r["arrival_s"] for t in token_times.get(r["request_id"], [])] for r in ordered],
            pa.list_(pa.float64()))
    return pa.table(cols)


def reference_outcome_counts(requests: pa.Table) -> tuple[dict, dict]:
    outcome = requests.column("outcome").to_pylist()
    reasons = requests.column("reason").to_pylist()
    counts: dict[str, int] = {"arrived": len(outcome)}
    for o in ("completed", "rejected", "cancelled", "abandoned", "failed", "unfinished"):
        counts[o] = sum(1 for x in outcome if x == o)
    by_reason: dict[str, int] = {}
    for o, r in zip(outcome, reasons):
        if o in ("rejected", "failed", "cancelled", "abandoned"):
            key = f"{o}:{r}"
            by_reason[key] = by_reason.get(key, 0) + 1
    return counts, dict(sorted(by_reason.items()))


def same_values(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (x != x and y != y)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(same_values(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


def assert_same_table(a: pa.Table, b: pa.Table) -> None:
    assert a.schema == b.schema
    assert a.num_rows == b.num_rows
    for name in a.column_names:
        xs, ys = a.column(name).to_pylist(), b.column(name).to_pylist()
        bad = [(i, x, y) for i, (x, y) in enumerate(zip(xs, ys)) if not same_values(x, y)]
        assert not bad, (name, bad[:5])


KINDS = ["request.arrived", "request.queued", "request.scheduled", "request.dispatched", "request.first_token",
         "request.retried", "request.preempted", "request.finished", "request.rejected", "request.cancelled",
         "request.abandoned", "request.failed", "generation.queued", "generation.finished", "tool.executed",
         "replica.crashed"]
RIDS = [None, "s1-t0", "s1-t0/g1", "s2-t0", "s2-t1", "req-3", "req-4"]
SCOPES = ["client", "queue", "router", "fleet.us.n0.r0", "fleet.us.n0.r1"]
REASONS = [None, None, "g1", "chat", "fleet.us.n0.r1", "stop", "length", "replica_down", "None"]

event_st = st.tuples(
    st.floats(0.0, 5.0, allow_nan=False), st.sampled_from(KINDS), st.sampled_from(SCOPES), st.sampled_from(RIDS),
    st.one_of(st.none(), st.integers(0, 4000).map(float), st.floats(0.0, 1e4, allow_nan=False)),
    st.sampled_from(REASONS))


def recorded(evs) -> tuple[Recorder, pa.Table]:
    """Feed ``evs`` to a Recorder in time order; arrivals always carry a value, as the callers' do."""
    rec = Recorder()
    t_now = 0.0
    for dt, kind, scope, rid, value, reason in evs:
        t_now += dt
        if kind == "request.arrived" and value is None:
            value = 0.0
        rec.event(t_now, kind, scope, rid, value, reason)
    return rec, events_table(rec)


@settings(max_examples=300, deadline=None)
@given(st.lists(event_st, max_size=60), st.booleans(), st.booleans())
def test_requests_table_matches_the_per_row_definition(evs, with_attrs, with_token_times):
    _, events = recorded(evs)
    attrs = {"s1-t0": ("free", "acme", "chat", "us"), "req-3": ("paid", None, "agent", "eu")} if with_attrs else None
    token_times = {"req-3": [1.0, 1.5, 2.25], "s2-t1": [], "req-4": [0.5]} if with_token_times else None
    assert_same_table(requests_table(events, token_times, attrs), reference_requests_table(events, token_times, attrs))


@settings(max_examples=200, deadline=None)
@given(st.lists(event_st, max_size=60))
def test_summary_counts_match_the_per_row_definition(evs):
    _, events = recorded(evs)
    reqs = requests_table(events)
    s = summarize(requests=reqs, itl_values=[0.01, 0.02], itl_weights=[1, 3], counters={}, kv_usage_mean=0.0,
                  sim_time_s=10.0, wall_s=0.0, slo_ttft_s=1.0, slo_itl_s=0.1)
    counts, by_reason = reference_outcome_counts(reqs)
    assert s["requests"] == counts
    assert s["outcomes_by_reason"] == by_reason
    assert list(s["outcomes_by_reason"]) == list(by_reason)


@settings(max_examples=200, deadline=None)
@given(st.lists(event_st, max_size=40))
def test_events_table_holds_what_was_recorded(evs):
    _, events = recorded(evs)
    t_now, expect = 0.0, []
    for dt, kind, scope, rid, value, reason in evs:
        t_now += dt
        if kind == "request.arrived" and value is None:
            value = 0.0
        expect.append((t_now, kind, scope, rid, value, reason))
    want = pa.table({
        "t_s": pa.array([e[0] for e in expect], pa.float64()),
        "seq": pa.array(np.arange(len(expect), dtype=np.int64)),
        "kind": pa.array([e[1] for e in expect], pa.string()),
        "scope": pa.array([e[2] for e in expect], pa.string()),
        "request_id": pa.array([e[3] for e in expect], pa.string()),
        "value": pa.array([e[4] for e in expect], pa.float64()),
        "reason": pa.array([e[5] for e in expect], pa.string()),
    })
    assert_same_table(events, want)


def test_a_nan_value_stays_nan_and_a_missing_one_stays_null():
    rec = Recorder()
    rec.event(0.0, "alert.firing", "alerts", None, math.nan, "itl")
    rec.event(1.0, "fault.injected", "failures", None, None, "xid")
    rec.event(2, "replica.crashed", "fleet.r0", None, 3, None)  # ints as the callers sometimes pass them
    values = events_table(rec).column("value")
    assert values.null_count == 1
    assert values.to_pylist()[1] is None
    assert math.isnan(values.to_pylist()[0])
    assert values.to_pylist()[2] == 3.0
    assert events_table(rec).column("t_s").to_pylist() == [0.0, 1.0, 2.0]


def test_levels_and_iterations_tables_hold_what_was_recorded():
    rec = Recorder(levels_interval_s=1.0, record_iterations=True)
    expect = []
    for t, scope, metric, value in [(0.0, "r0", "kv_usage", 0.1), (0.5, "r0", "kv_usage", 0.2),
                                    (0.5, "r1", "running", 3), (1.2, "r0", "kv_usage", 0.3),
                                    (1.3, "r1", "running", 3), (2.0, "r1", "running", 4)]:
        rec.level(t, scope, metric, value)
    expect = [(0.0, "r0", "kv_usage", 0.1), (0.5, "r1", "running", 3.0), (1.2, "r0", "kv_usage", 0.3),
              (2.0, "r1", "running", 4.0)]
    rec.close_levels(3.0)
    expect += [(3.0, "r0", "kv_usage", 0.3), (3.0, "r1", "running", 4.0)]
    lv = levels_table(rec)
    assert lv.column_names == ["t_s", "scope", "metric", "value"]
    assert list(zip(*(lv.column(c).to_pylist() for c in lv.column_names))) == expect
    means = rec.level_means(3.0)
    assert means[("r0", "kv_usage")] == (0.1 * 0.5 + 0.2 * 0.7 + 0.3 * 1.8) / 3.0
    assert means[("r1", "running")] == (3 * 1.5 + 4 * 1.0) / 2.5

    rec.iteration("r0", step=1, t_start_s=0.0, ctx_requests=2, ctx_tokens=300, gen_requests=0, gen_tokens=0,
                  elapsed_ms=12.5, kv_usage_pct=1.0)
    rec.iteration("r1", step=7, t_start_s=0.25, ctx_requests=0, ctx_tokens=0, gen_requests=5, gen_tokens=5,
                  elapsed_ms=8, kv_usage_pct=2.5)
    it = iterations_table(rec)
    assert it.schema == pa.schema([("scope", pa.string()), ("step", pa.int64()), ("t_start_s", pa.float64()),
                                   ("ctx_requests", pa.int64()), ("ctx_tokens", pa.int64()),
                                   ("gen_requests", pa.int64()), ("gen_tokens", pa.int64()),
                                   ("elapsed_ms", pa.float64()), ("kv_usage_pct", pa.float64())])
    assert it.to_pylist()[1] == {"scope": "r1", "step": 7, "t_start_s": 0.25, "ctx_requests": 0, "ctx_tokens": 0,
                                 "gen_requests": 5, "gen_tokens": 5, "elapsed_ms": 8.0, "kv_usage_pct": 2.5}


def test_an_empty_run_gives_empty_tables_of_the_same_schema():
    rec = Recorder()
    events = events_table(rec)
    assert_same_table(requests_table(events, {}, {}), reference_requests_table(events, {}, {}))


def reference_weighted_quantiles(values, weights, qs):
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return [float("nan")] * len(qs)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cw = np.cumsum(w)
    total = cw[-1]
    return [float(v[min(int(np.searchsorted(cw, q * total, side="left")), v.size - 1)]) for q in qs]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.01, 0.02, 0.5, math.inf, 1e-9]) | st.floats(0, 2, allow_nan=False),
                          st.integers(0, 50)), min_size=0, max_size=80), st.booleans())
def test_weighted_quantiles_match_the_sorted_copy_definition(pairs, weighted):
    from twin.metrics import weighted_quantiles

    v = [p[0] for p in pairs]
    w = [p[1] for p in pairs] if weighted else None
    qs = (0.0, 0.5, 0.9, 0.95, 0.99, 1.0)
    assert same_values(weighted_quantiles(np.array(v), w, qs), reference_weighted_quantiles(v, w, qs))


def reference_itl_by_group(engines):
    vals, wts, gids = [], [], []
    order = {}
    for e in engines:
        v = np.asarray(e.itl_values, dtype=np.float64)
        if v.size == 0:
            continue
        g = e.itl_groups
        if g is None or len(g) == 0:
            codes, labels = np.zeros(v.size, dtype=np.int64), [None]
        else:
            codes, labels = np.asarray(g.codes, dtype=np.int64), g.labels
        present, first = np.unique(codes, return_index=True)
        for c in present[np.argsort(first, kind="stable")]:
            order.setdefault(labels[c], len(order))
        to_global = np.array([order.get(x, -1) for x in labels], dtype=np.int64)
        vals.append(v)
        wts.append(np.asarray(e.itl_weights, dtype=np.float64))
        gids.append(to_global[codes])
    if not vals:
        return {}
    v, w, gid = np.concatenate(vals), np.concatenate(wts), np.concatenate(gids)
    idx = np.argsort(gid, kind="stable")
    v, w, gid = v[idx], w[idx], gid[idx]
    bounds = np.searchsorted(gid, np.arange(len(order) + 1))
    return {label: (v[bounds[i]:bounds[i + 1]], w[bounds[i]:bounds[i + 1]]) for label, i in order.items()}


class _Engine:
    def __init__(self, gaps, track_groups):
        from array import array

        from twin.models.engine_parts import GroupColumn

        self.itl_values = array("d", [g[0] for g in gaps])
        self.itl_weights = array("I", [g[1] for g in gaps])
        self.itl_groups = None
        if track_groups:
            self.itl_groups = GroupColumn()
            self.itl_groups.extend([g[2] for g in gaps])


gap_st = st.tuples(st.floats(0.0, 1.0, allow_nan=False), st.integers(1, 9), st.sampled_from(["free", "pro", None, "ent"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(gap_st, max_size=30), st.booleans()), max_size=6))
def test_fleet_itl_groups_match_the_concatenate_and_sort_definition(engines_spec):
    from twin.fleet_summary import _itl_by_group
    from twin.metrics import distribution

    engines = [_Engine(gaps, track) for gaps, track in engines_spec]
    by_group, all_v, all_w = _itl_by_group(engines)
    want = reference_itl_by_group(engines)
    assert list(by_group) == list(want)
    for label, (v, w) in want.items():
        assert by_group[label][0].tolist() == v.tolist() and by_group[label][1].tolist() == w.tolist()
        assert distribution(*by_group[label]) == distribution(v, w)
    ref_v = np.concatenate([v for v, _ in want.values()]) if want else []
    ref_w = np.concatenate([w for _, w in want.values()]) if want else []
    assert all_v.tolist() == list(ref_v) and all_w.tolist() == list(ref_w)
    assert same_values(list(distribution(all_v, all_w).values()), list(distribution(ref_v, ref_w).values()))


part_st = st.lists(st.tuples(
    st.sampled_from([0.0, 0.01, 0.02, 0.5, math.inf, -1.5, 5e-324, 1e300]) | st.floats(-2, 2, allow_nan=False),
    st.integers(0, 9), st.integers(0, 2)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.lists(part_st, max_size=5))
def test_grouped_quantiles_match_quantiles_of_the_concatenated_sample(parts_spec):
    from twin.metrics import grouped_weighted_quantiles, weighted_quantiles

    parts = [(np.array([x[0] for x in p], dtype=np.float64), np.array([x[1] for x in p], dtype=np.float64),
              np.array([x[2] for x in p], dtype=np.int64)) for p in parts_spec]
    qs = (0.0, 0.5, 0.9, 0.95, 0.99, 1.0)
    got = grouped_weighted_quantiles(lambda: iter(parts), 3, qs)
    v = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
    w = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
    g = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    if (np.signbit(v) & (v == 0)).any():  # -0.0: the sorted order of equal values decides; declined
        assert got is None
        return
    want = [weighted_quantiles(v, w, qs)] + [weighted_quantiles(v[g == k], w[g == k], qs) for k in range(3)]
    assert same_values(got, want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(gap_st, max_size=30), st.booleans()), max_size=6), st.booleans())
def test_fleet_itl_distributions_match_distribution_of_the_concatenated_gaps(engines_spec, with_nan):
    from twin.fleet_summary import _itl_distributions
    from twin.metrics import distribution

    engines = [_Engine(gaps, track) for gaps, track in engines_spec]
    if with_nan and engines and len(engines[0].itl_values):
        engines[0].itl_values[0] = math.nan  # takes the concatenating fallback
    whole, groups = _itl_distributions(engines)
    want = reference_itl_by_group(engines)
    assert list(groups) == list(want)
    for label, (v, w) in want.items():
        assert same_values(list(groups[label].items()), list(distribution(v, w).items()))
    ref_v = np.concatenate([v for v, _ in want.values()]) if want else []
    ref_w = np.concatenate([w for _, w in want.values()]) if want else []
    assert same_values(list(whole.items()), list(distribution(ref_v, ref_w).items()))
