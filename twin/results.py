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
import pyarrow.parquet as pq

from twin.metrics import distribution
from twin.models.recorder import Recorder

TERMINAL_KINDS = {"request.finished": "completed", "request.rejected": "rejected", "request.cancelled": "cancelled",
                  "request.abandoned": "abandoned", "request.failed": "failed"}


def events_table(rec: Recorder) -> pa.Table:
    n = len(rec.ev_t)
    return pa.table({
        "t_s": pa.array(rec.ev_t, pa.float64()),
        "seq": pa.array(np.arange(n, dtype=np.int64)),
        "kind": pa.array(rec.ev_kind, pa.string()),
        "scope": pa.array(rec.ev_scope, pa.string()),
        "request_id": pa.array(rec.ev_request, pa.string()),
        "value": pa.array(rec.ev_value, pa.float64()),
        "reason": pa.array(rec.ev_reason, pa.string()),
    })


def levels_table(rec: Recorder) -> pa.Table:
    return pa.table({
        "t_s": pa.array(rec.lv_t, pa.float64()),
        "scope": pa.array(rec.lv_scope, pa.string()),
        "metric": pa.array(rec.lv_metric, pa.string()),
        "value": pa.array(rec.lv_value, pa.float64()),
    })


def iterations_table(rec: Recorder) -> pa.Table:
    cols: dict[str, Any] = {"scope": pa.array(rec.it_scope, pa.string())}
    for k, v in rec.it_cols.items():
        typ = pa.float64() if k in ("t_start_s", "elapsed_ms", "kv_usage_pct") else pa.int64()
        cols[k] = pa.array(v, typ)
    return pa.table(cols)


ATTR_COLUMNS = ("tier", "tenant", "klass", "region")


def requests_table(events: pa.Table, token_times: dict[str, list[float]] | None = None,
                   attrs: dict[str, tuple] | None = None) -> pa.Table:
    """One row per request from the event table (a pure function of it, plus per-request attributes).

    Only ``request.*`` events count: in a fleet, a request is a user's turn, and the engine-level
    ``generation.*`` events are kept in the event table for drill-down.
    """
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
            if row["queue_s"] == row["queue_s"]:  # already set (first scheduling only)
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
                row["num_cached_tokens"] = int(v)  # fleet turns: cached tokens of the generation streaming
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


def _finite(x: np.ndarray) -> np.ndarray:
    return x[np.isfinite(x)]


def summarize(*, requests: pa.Table, itl_values: list[float], itl_weights: list[int], counters: dict[str, int],
              kv_usage_mean: float, sim_time_s: float, wall_s: float, slo_ttft_s: float, slo_itl_s: float) -> dict:
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
    completed = np.array([o == "completed" for o in outcome], dtype=bool)
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
        "itl_s": distribution(itl_values, itl_weights),
        "tpot_s": distribution(_finite(tpot[completed])),
        "e2e_s": distribution(_finite(e2e[completed])),
        "queue_s": distribution(_finite(queue)),
        "output_tokens_per_s": float(out_tok[completed].sum() / sim_time_s) if sim_time_s > 0 else math.nan,
        "goodput_rps": float(good.sum() / sim_time_s) if sim_time_s > 0 else math.nan,
        "slo_attainment": float(good.sum() / len(outcome)) if outcome else math.nan,
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
