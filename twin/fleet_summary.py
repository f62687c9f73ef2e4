"""The fleet run's summary: the single-replica summary's fields, plus per-tier and per-class breakdowns,
rejections by reason, GPU-hours and dollars per million output tokens."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from twin.metrics import PERCENTILES, distribution, grouped_weighted_quantiles, weighted_mean_of
from twin.results import string_codes, summarize


def _engine_codes(e) -> tuple[np.ndarray, list]:
    """An engine's gap group codes (a view where it can be) and their labels."""
    g = e.itl_groups
    if g is None or len(g) == 0:
        return np.zeros(len(e.itl_values), dtype=np.int64), [None]
    if hasattr(g, "codes"):  # twin.models.engine_parts.GroupColumn
        return np.asarray(g.codes), g.labels
    labels = list(dict.fromkeys(g))
    index = {x: i for i, x in enumerate(labels)}
    return np.array([index[x] for x in g], dtype=np.int64), labels


def _itl_parts(engines):
    """Per engine with gaps: its values, weights (float64) and gap group ids (global: groups in first-seen
    order, engines in order, entries in order), and the group labels in that order."""
    order: dict[str | None, int] = {}
    parts = []
    for e in engines:
        if len(e.itl_values) == 0:
            continue
        codes, labels = _engine_codes(e)
        present, first = np.unique(codes, return_index=True)
        for c in present[np.argsort(first, kind="stable")]:  # this engine's labels in first-seen order
            order.setdefault(labels[c], len(order))
        to_global = np.array([order.get(x, -1) for x in labels], dtype=np.int64)
        parts.append((np.asarray(e.itl_values, dtype=np.float64), np.asarray(e.itl_weights, dtype=np.float64),
                      to_global[codes]))
    return order, parts


def _itl_by_group(engines) -> tuple[dict[str | None, tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """Every engine's inter-token gap entries (values, weights) by group label, groups in first-seen order,
    each group's entries in engine-then-record order, and the whole sample (all groups, in that order), the
    former being slices of the latter: the plain definition, which ``_itl_distributions`` falls back on."""
    order, parts = _itl_parts(engines)
    if not parts:
        return {}, np.zeros(0), np.zeros(0)
    v = np.concatenate([p[0] for p in parts])
    w = np.concatenate([p[1] for p in parts])
    g = np.concatenate([p[2] for p in parts])
    idx = np.argsort(g, kind="stable")
    v, w, g = v[idx], w[idx], g[idx]
    bounds = np.searchsorted(g, np.arange(len(order) + 1))
    by_group = {label: (v[bounds[i]:bounds[i + 1]], w[bounds[i]:bounds[i + 1]]) for label, i in order.items()}
    return by_group, v, w


def _itl_distributions(engines) -> tuple[dict, dict[str | None, dict]]:
    """The ``distribution`` of every engine's inter-token gaps, and of each group's, without concatenating
    the engines' columns: the quantiles from ``grouped_weighted_quantiles`` (which reads them in place), the
    means as ``weighted_mean`` computes them (exact sums: the same whatever the order of the entries).

    A fleet run has ~400 gaps per turn, but the engines write a decode-group step's gaps as one entry per
    group label (``twin.models.engine_gaps``), so the columns hold ~50x fewer entries than gaps, and nothing
    here is as large as the gaps once were."""
    order, parts = _itl_parts(engines)
    if not parts:
        return distribution([]), {}
    qs = grouped_weighted_quantiles(lambda: iter(parts), len(order), tuple(p / 100 for p in PERCENTILES))
    if qs is None:  # a NaN or -0.0 gap: the plain definition, on concatenated copies
        by_group, all_v, all_w = _itl_by_group(engines)
        return distribution(all_v, all_w), {label: distribution(v, w) for label, (v, w) in by_group.items()}

    def dist(quantiles: list[float], pairs: list) -> dict:
        out: dict[str, float | int] = {f"p{p}": x for p, x in zip(PERCENTILES, quantiles)}
        out["mean"] = weighted_mean_of(lambda: pairs)
        out["count"] = int(sum(float(w.sum()) for _, w in pairs))  # whole numbers: exact in any order
        return out

    of_group: list[list] = [[] for _ in order]  # per group, each engine's entries of it
    for v, w, g in parts:
        for i in np.unique(g).tolist():
            sel = g == i
            of_group[i].append((v[sel], w[sel]))
    whole = dist(qs[0], [(v, w) for v, w, _g in parts])
    groups = {label: dist(qs[1 + i], of_group[i]) for label, i in order.items()}
    return whole, groups


def fleet_summary(world, reqs: pa.Table, *, end_s: float, wall_s: float, slo) -> dict:
    engines = world.engines()
    itl_whole, itl_groups = _itl_distributions(engines)
    means = world.rec.level_means(end_s)
    kv = [v for (scope, metric), v in means.items() if metric == "kv_usage"]
    s = summarize(requests=reqs, itl_values=[], itl_weights=[], itl=itl_whole, counters=world.counters(),
                  kv_usage_mean=float(np.mean(kv)) if kv else 0.0, sim_time_s=end_s, wall_s=wall_s,
                  slo_ttft_s=slo.ttft_s, slo_itl_s=slo.itl_s)
    # per tier and class by codes over the columns, not through Python lists of every request
    tier, tier_labels = string_codes(reqs.column("tier"))
    s["by_tier"] = {}
    for name in sorted(t for t in tier_labels if t):
        sub = reqs.filter(pa.array(tier == tier_labels.index(name)))
        part = summarize(requests=sub, itl_values=[], itl_weights=[], itl=itl_groups.get(name, distribution([])),
                         counters={}, kv_usage_mean=0.0,
                         sim_time_s=end_s, wall_s=wall_s, slo_ttft_s=slo.ttft_s, slo_itl_s=slo.itl_s)
        s["by_tier"][name] = {k: part[k] for k in ("requests", "outcomes_by_reason", "ttft_s", "itl_s", "tpot_s",
                                                   "goodput_rps", "slo_attainment", "output_tokens_per_s")}
    s["by_class"] = {}
    klass, klass_labels = string_codes(reqs.column("klass"))
    ttft_all = reqs.column("ttft_s").to_numpy(zero_copy_only=False).astype(float)
    completed = pc.equal(reqs.column("outcome"), "completed").to_numpy(zero_copy_only=False)
    for name in sorted(k for k in klass_labels if k):
        mine = klass == klass_labels.index(name)
        ttft = ttft_all[mine]
        s["by_class"][name] = {"arrived": int(mine.sum()), "completed": int((mine & completed).sum()),
                               "ttft_s": distribution(ttft[np.isfinite(ttft)])}
    gpus = world.gpus
    gpu_hours = math.fsum(world.model_info[h.model]["tp"] * (((h.removed_s if h.removed_s is not None else end_s)
                                                              - h.started_s) / 3600.0) for h in world.handles)
    price = [i["price"] for i in world.model_info.values() if i["price"]]
    usd_per_gpu_hour = float(price[0]) if price else None
    out_tokens = int(np.nansum(reqs.column("output_tokens").to_numpy(zero_copy_only=False).astype(float)))
    prov = world.cfg.autoscaling.provider if world.cfg.autoscaling is not None else None
    provider_usd = (world.provider_tokens / 1e6 * prov.usd_per_m_output_tokens) if prov is not None else 0.0
    s["fleet"] = {"replicas": len(world.handles), "gpus": gpus, "gpu_hours": gpu_hours,
                  "provider_turns": world.provider_turns, "provider_output_tokens": world.provider_tokens,
                  "provider_usd": provider_usd,
                  "usd_per_gpu_hour": usd_per_gpu_hour,
                  "usd": gpu_hours * usd_per_gpu_hour if usd_per_gpu_hour else None,
                  "output_tokens": out_tokens,
                  "usd_per_m_output_tokens": (gpu_hours * usd_per_gpu_hour / out_tokens * 1e6)
                  if usd_per_gpu_hour and out_tokens else None,
                  "router_decisions": world.router.decisions,
                  "streams_dropped_by_faults": world.dropped_streams,
                  "duplicate_completions": world.conversation.duplicate_completions}
    if world.cfg.canary is not None:
        s["canary"] = {"canary_turns": world.canary_turns, "final_share": world.canary_share,
                       "max_share_before_decision": world.canary_share_max, "last_decision": world.canary_last or None}
    return s
