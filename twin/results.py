"""Result tables, derived by pure functions from the recorder, and their atomic writing.

- ``events``: tidy event table ``t_s, seq, kind, scope, request_id, value, reason``.
- ``levels``: ``t_s, scope, metric, value`` written on change.
- ``requests``: one row per request, derived from the events.
- ``iterations``: the engine's own iteration log (optional), in the recorded-run columns.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from twin.metrics import distribution
from twin.models.recorder import Recorder

TERMINAL_KINDS = {"request.finished": "completed", "request.rejected": "rejected", "request.cancelled": "cancelled",
                  "request.abandoned": "abandoned", "request.failed": "failed"}


def _labelled(labels: list[str | None], codes) -> pa.Array:
    """A string column from codes into ``labels`` (None labels become nulls)."""
    return pa.array(labels, pa.string()).take(pa.array(np.frombuffer(codes, dtype=_CODE_DTYPES[codes.typecode])))


_CODE_DTYPES = {"B": np.uint8, "H": np.uint16, "I": np.uint32}


def _doubles(col) -> np.ndarray:
    """A copy of a typed ``array('d')`` column (a copy, so the recorder's buffer is not pinned by a view)."""
    return np.frombuffer(col, dtype=np.float64).copy()


def events_table(rec: Recorder) -> pa.Table:
    n = len(rec.ev_t)
    has_value = np.frombuffer(rec.ev_has_value, dtype=np.int8)
    return pa.table({
        "t_s": pa.array(_doubles(rec.ev_t)),
        "seq": pa.array(np.arange(n, dtype=np.int64)),
        "kind": _labelled(rec.kinds.labels, rec.ev_kind),
        "scope": _labelled(rec.scopes.labels, rec.ev_scope),
        "request_id": pa.array(rec.ev_request, pa.string()),
        "value": pa.array(_doubles(rec.ev_value), mask=has_value == 0),
        "reason": _labelled(rec.reasons.labels, rec.ev_reason),
    })


def levels_table(rec: Recorder) -> pa.Table:
    key = pa.array(np.frombuffer(rec.lv_key, dtype=np.uint32))
    return pa.table({
        "t_s": pa.array(_doubles(rec.lv_t)),
        "scope": pa.array([k[0] for k in rec.lv_keys], pa.string()).take(key),
        "metric": pa.array([k[1] for k in rec.lv_keys], pa.string()).take(key),
        "value": pa.array(_doubles(rec.lv_value)),
    })


def iterations_table(rec: Recorder) -> pa.Table:
    cols: dict[str, Any] = {"scope": pa.array(rec.it_scope, pa.string())}
    for k, v in rec.it_cols.items():
        typ = np.float64 if v.typecode == "d" else np.int64
        cols[k] = pa.array(np.frombuffer(v, dtype=typ).copy())
    return pa.table(cols)


ATTR_COLUMNS = ("tier", "tenant", "klass", "region")


def string_codes(col, *, labels: bool = True) -> tuple[np.ndarray, Any]:
    """Dictionary-encode a string column: int64 codes in first-seen order (-1 for null) and the labels
    (a list, or with ``labels=False`` the Arrow array, not converted to Python strings)."""
    if isinstance(col, pa.ChunkedArray):  # one chunk: one dictionary, codes in first-seen order
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    enc = pc.dictionary_encode(col)
    codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return codes, enc.dictionary.to_pylist() if labels else enc.dictionary


def _first_in_group(group: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """Per group (0..n-1), the first of ``rows`` (ascending row numbers) in that group; -1 where none."""
    out = np.full(n, -1, dtype=np.int64)
    present, first = np.unique(group[rows], return_index=True)  # first occurrences (documented)
    out[present] = rows[first]
    return out


def _last_in_group(group: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """Per group, the last of ``rows`` (ascending row numbers) in that group; -1 where none."""
    return _first_in_group(group, rows[::-1], n)


def _at(values: np.ndarray, rows: np.ndarray, missing) -> np.ndarray:
    """``values[rows]`` with ``missing`` where the row is -1."""
    out = values[np.maximum(rows, 0)]
    return np.where(rows >= 0, out, missing)


def _first_scheduling(group: np.ndarray, t: np.ndarray, arrived: np.ndarray, sched: np.ndarray,
                      n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request, the scheduling event that sets its queue time: the first whose queue time (its time
    minus the last arrival before it) is defined, else its last; -1 for none. Also each scheduling row's
    queue time (NaN elsewhere)."""
    both = np.flatnonzero(arrived | sched)
    both = both[np.argsort(group[both], kind="stable")]  # grouped, event order within a group
    g_both = group[both]
    pos = np.arange(len(both))
    seen = np.maximum.accumulate(np.where(arrived[both], pos, -1)) if len(both) else pos  # last arrival so far
    start = np.searchsorted(g_both, g_both, side="left")  # each group's first position
    arrival_seen = np.where(seen >= start, t[both[np.maximum(seen, 0)]], np.nan) if len(both) else np.zeros(0)
    queue_at = t[both] - arrival_seen
    ok = np.flatnonzero(sched[both] & ~np.isnan(queue_at))
    first_defined = np.full(n, -1, dtype=np.int64)
    present, first = np.unique(g_both[ok], return_index=True)
    first_defined[present] = both[ok[first]]
    chosen = np.where(first_defined >= 0, first_defined, _last_in_group(group, np.flatnonzero(sched), n))
    queue_of_row = np.full(len(t), np.nan)
    queue_of_row[both] = queue_at
    return chosen, queue_of_row


def requests_table(events: pa.Table, token_times: dict[str, list[float]] | None = None,
                   attrs: dict[str, tuple] | None = None) -> pa.Table:
    """One row per request from the event table (a pure function of it, plus per-request attributes).

    Only ``request.*`` events count: in a fleet, a request is a user's turn, and the engine-level
    ``generation.*`` events are kept in the event table for drill-down. Rows are in order of each request's
    first event. Per request, in event order: the last ``arrived`` gives arrival and prompt tokens; the first
    ``scheduled``/``dispatched`` whose queue time is defined (arrival seen before it) gives queue time and
    scope, and it and those before it set the cached tokens, else the first ``first_token`` with a value
    does; the last ``first_token`` gives its time; the last terminal event gives outcome, finish and reason,
    and the last terminal event with a value the output tokens.

    Columnar (numpy group-by over the event rows) rather than a dict per request: a full fleet has millions
    of requests (``tests/test_results_columnar.py`` checks it against the per-row definition).
    """
    # Codes over the whole event table, then numpy row selection: filtering the table first would copy
    # the request events' strings (~60% of a fleet's events) only to encode them.
    kind_all, kind_labels = string_codes(events.column("kind"))
    wanted = np.array([k is not None and k.startswith("request.") for k in kind_labels] + [False])
    rid_all, rid_labels = string_codes(events.column("request_id"), labels=False)
    rows = np.flatnonzero(wanted[kind_all] & (rid_all >= 0))  # (a null kind's code -1 picks the False)
    # groups: the kept rows' request ids, renumbered in order of first appearance among the kept rows
    present, first = np.unique(rid_all[rows], return_index=True)
    by_first = present[np.argsort(first, kind="stable")]
    renumber = np.zeros(len(rid_labels), dtype=np.int64)
    renumber[by_first] = np.arange(len(by_first))
    group = renumber[rid_all[rows]]
    request_id = rid_labels.take(pa.array(by_first, pa.int64()))
    n = len(request_id)
    kind = kind_all[rows]
    t = events.column("t_s").to_numpy(zero_copy_only=False).astype(np.float64, copy=False)[rows]
    value_col = events.column("value")
    v = value_col.fill_null(np.nan).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)[rows]
    has_v = pc.is_valid(value_col).to_numpy(zero_copy_only=False)[rows]
    code = {k: i for i, k in enumerate(kind_labels)}

    def rows_of(*kinds: str) -> np.ndarray:
        wanted = [code[k] for k in kinds if k in code]
        return np.flatnonzero(np.isin(kind, wanted)) if wanted else np.zeros(0, dtype=np.int64)

    def mask_of(*kinds: str) -> np.ndarray:
        m = np.zeros(len(kind), dtype=bool)
        m[rows_of(*kinds)] = True
        return m

    arrived = mask_of("request.arrived")
    last_arrived = _last_in_group(group, np.flatnonzero(arrived), n)
    arrival = _at(t, last_arrived, np.nan)
    prompt = _at(v, last_arrived, 0.0).astype(np.int64)

    sched = mask_of("request.scheduled", "request.dispatched")
    chosen, queue_of_row = _first_scheduling(group, t, arrived, sched, n)
    queue = _at(queue_of_row, chosen, np.nan)
    applied = sched & (np.arange(len(kind)) <= chosen[group]) if len(kind) else sched
    cached_sched = _last_in_group(group, np.flatnonzero(applied & has_v), n)
    cached_first = _first_in_group(group, np.flatnonzero(mask_of("request.first_token") & has_v), n)
    cached_row = np.where(cached_sched >= 0, cached_sched, cached_first)
    cached = _at(v, cached_row, 0.0).astype(np.int64)
    dispatched_code = code.get("request.dispatched", -2)
    chosen_idx = pa.array(rows[np.maximum(chosen, 0)] if len(rows) else np.zeros(n, np.int64), mask=chosen < 0)
    scope = pc.if_else(pa.array(_at(kind, chosen, -1) == dispatched_code),
                       events.column("reason").take(chosen_idx), events.column("scope").take(chosen_idx))

    first_token = _at(t, _last_in_group(group, rows_of("request.first_token"), n), np.nan)
    preemptions = np.bincount(group[rows_of("request.preempted")], minlength=n).astype(np.int64)
    retries = np.bincount(group[rows_of("request.retried")], minlength=n).astype(np.int64)
    term_rows = rows_of(*TERMINAL_KINDS)
    last_term = _last_in_group(group, term_rows, n)
    finish = _at(t, last_term, np.nan)
    out_row = _last_in_group(group, term_rows[has_v[term_rows]], n)
    out_tok = _at(v, out_row, 0.0).astype(np.int64)
    outcome_labels = ["unfinished", *(TERMINAL_KINDS.get(k, "unfinished") for k in kind_labels)]
    outcome = pa.array(outcome_labels, pa.string()).take(pa.array(_at(kind, last_term, -1) + 1))
    term_idx = pa.array(rows[np.maximum(last_term, 0)] if len(rows) else np.zeros(n, np.int64), mask=last_term < 0)

    ttft = first_token - arrival
    completed = _at(kind, last_term, -1) == code.get("request.finished", -2)
    e2e = np.where(completed, finish - arrival, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out_tok > 1, (finish - first_token) / (out_tok - 1), np.nan)
    cols: dict[str, Any] = {
        "request_id": request_id,
        "scope": scope,
        "arrival_s": pa.array(arrival),
        "prompt_tokens": pa.array(prompt),
        "output_tokens": pa.array(out_tok),
        "num_cached_tokens": pa.array(cached, mask=cached_row < 0),
        "queue_s": pa.array(queue),
        "ttft_s": pa.array(ttft),
        "tpot_s": pa.array(tpot),
        "e2e_s": pa.array(e2e),
        "finish_s": pa.array(finish),
        "preemptions": pa.array(preemptions),
        "outcome": outcome,
        "reason": events.column("reason").take(term_idx),
        "retries": pa.array(retries),
    }
    ids = request_id.to_pylist() if attrs is not None or token_times is not None else []
    if attrs is not None:
        none = (None,) * len(ATTR_COLUMNS)
        per_request = [attrs.get(r, none) for r in ids]
        for j, name in enumerate(ATTR_COLUMNS):
            cols[name] = pa.array([a[j] for a in per_request], pa.string())
    if token_times is not None:
        times = [token_times.get(r, ()) for r in ids]
        lengths = np.fromiter((len(x) for x in times), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((x for ts in times for x in ts), dtype=np.float64, count=int(offsets[-1]))
        flat -= np.repeat(arrival, lengths)
        cols["token_times_s"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat),
                                                         type=pa.list_(pa.float64()))
    return pa.table(cols)


def _finite(x: np.ndarray) -> np.ndarray:
    return x[np.isfinite(x)]


OUTCOMES = ("completed", "rejected", "cancelled", "abandoned", "failed", "unfinished")


def summarize(*, requests: pa.Table, itl_values: list[float], itl_weights: list[int], counters: dict[str, int],
              kv_usage_mean: float, sim_time_s: float, wall_s: float, slo_ttft_s: float, slo_itl_s: float,
              itl: dict | None = None) -> dict:
    """The run's summary. ``itl``, when given, is the inter-token gaps' ``distribution`` already computed
    (a fleet computes it from its engines' columns without concatenating them); else it is computed from
    ``itl_values`` and ``itl_weights``."""
    n = requests.num_rows
    outcome, outcome_labels = string_codes(requests.column("outcome"))
    reason, reason_labels = string_codes(requests.column("reason"))
    per_outcome = np.bincount(outcome + 1, minlength=len(outcome_labels) + 1)[1:]
    counts: dict[str, int] = {"arrived": n}
    for o in OUTCOMES:
        counts[o] = int(per_outcome[outcome_labels.index(o)]) if o in outcome_labels else 0
    by_reason: dict[str, int] = {}
    pairs = np.stack([outcome, reason], axis=1) if n else np.zeros((0, 2), dtype=np.int64)
    if n:
        pairs, pair_counts = np.unique(pairs, axis=0, return_counts=True)
    else:
        pair_counts = np.zeros(0, dtype=np.int64)
    for (o, r), c in zip(pairs.tolist(), pair_counts.tolist()):
        label = outcome_labels[o] if o >= 0 else None
        if label in ("rejected", "failed", "cancelled", "abandoned"):
            key = f"{label}:{reason_labels[r] if r >= 0 else None}"
            by_reason[key] = by_reason.get(key, 0) + c
    completed = outcome == (outcome_labels.index("completed") if "completed" in outcome_labels else -2)
    ttft = requests.column("ttft_s").to_numpy(zero_copy_only=False)
    tpot = requests.column("tpot_s").to_numpy(zero_copy_only=False)
    e2e = requests.column("e2e_s").to_numpy(zero_copy_only=False)
    queue = requests.column("queue_s").to_numpy(zero_copy_only=False)
    out_tok = requests.column("output_tokens").to_numpy(zero_copy_only=False)
    good = completed & (ttft <= slo_ttft_s) & ((np.nan_to_num(tpot, nan=0.0)) <= slo_itl_s)
    q = counters.get("prefix_cache_queries", 0)
    return {
        "requests": counts,
        "outcomes_by_reason": dict(sorted(by_reason.items())),
        "ttft_s": distribution(_finite(ttft[completed])),
        "itl_s": itl if itl is not None else distribution(itl_values, itl_weights),
        "tpot_s": distribution(_finite(tpot[completed])),
        "e2e_s": distribution(_finite(e2e[completed])),
        "queue_s": distribution(_finite(queue)),
        "output_tokens_per_s": float(out_tok[completed].sum() / sim_time_s) if sim_time_s > 0 else math.nan,
        "goodput_rps": float(good.sum() / sim_time_s) if sim_time_s > 0 else math.nan,
        "slo_attainment": float(good.sum() / n) if n else math.nan,
        "slo": {"ttft_s": slo_ttft_s, "itl_s": slo_itl_s},
        "prefix_cache_hit_rate": float(counters.get("prefix_cache_hits", 0) / q) if q else 0.0,
        "prefix_cache_queries": int(q),
        "prefix_cache_hits": int(counters.get("prefix_cache_hits", 0)),
        "preemptions": int(counters.get("num_preemptions", 0)),
        "engine_steps": int(counters.get("num_steps", 0)),
        "kv_usage_mean": float(kv_usage_mean),
        "sim_time_s": float(sim_time_s),
        "wall_s": float(wall_s),
    }


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename, so a reader (or a
    crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; outputs are for reading
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dumps(obj: Any) -> str:
    """JSON with NaN written as null (strict JSON), stable key order."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), indent=2, sort_keys=False, default=_json_default) + "\n"


def write_outputs(out_dir: Path, *, tables: dict[str, pa.Table], files: dict[str, str]) -> None:
    """Write every table and file into a temporary sibling folder, then swap it into place.

    Readers never see a half-written run: either the old folder or the complete new one.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for name, table in tables.items():
            pq.write_table(table, tmp / f"{name}.parquet")
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
