"""The fleet run's summary: the single-replica summary's fields, plus per-tier and per-class breakdowns,
rejections by reason, GPU-hours and dollars per million output tokens."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from twin.metrics import PERCENTILES, distribution, grouped_weighted_quantiles
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


def _itl_by_group(engines) -> tuple[dict[str | None, tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """Every engine's inter-token gaps and weights by group label: groups in first-seen order (engines in
    order, gaps in order), each group's gaps in engine-then-record order. Returns the per-group arrays and
    the whole sample (all groups, in that order), the former being slices of the latter: the plain
    definition, which ``_itl_distributions`` falls back on (16 bytes a gap)."""
    order, plan = _itl_plan(engines)
    if not plan:
        return {}, np.zeros(0), np.zeros(0)
    bounds, placed = _itl_layout(plan, len(order))
    v_all = np.empty(int(bounds[-1]), dtype=np.float64)
    w_all = np.empty(int(bounds[-1]), dtype=np.float64)
    for _g, slot, v, w in placed:
        v_all[slot] = v
        w_all[slot] = w
    by_group = {label: (v_all[bounds[i]:bounds[i + 1]], w_all[bounds[i]:bounds[i + 1]]) for label, i in order.items()}
    return by_group, v_all, w_all


def _itl_plan(engines):
    """Gap groups in first-seen order (engines in order, gaps in order) and, per engine with gaps, its
    labels' global group ids and its gap count per label."""
    order: dict[str | None, int] = {}
    plan = []
    for e in engines:
        if len(e.itl_values) == 0:
            continue
        codes, labels = _engine_codes(e)
        present, first = np.unique(codes, return_index=True)
        for c in present[np.argsort(first, kind="stable")]:  # this engine's labels in first-seen order
            order.setdefault(labels[c], len(order))
        to_global = np.array([order.get(x, -1) for x in labels], dtype=np.int64)
        plan.append((e, to_global, np.bincount(codes, minlength=len(labels))))
    return order, plan


def _itl_layout(plan, n_groups: int):
    """Where each engine's gaps go in the group-by-group order: the groups' bounds, and an iterator of
    (group id, slot in the whole sample, the engine's values and weights of that group) in placing order."""
    sizes = np.zeros(n_groups, dtype=np.int64)
    for _e, to_global, counts in plan:
        np.add.at(sizes, to_global[counts > 0], counts[counts > 0])
    bounds = np.concatenate([[0], np.cumsum(sizes)])

    def placed():
        cursor = bounds[:-1].copy()
        for e, to_global, counts in plan:
            codes, _labels = _engine_codes(e)
            v = np.asarray(e.itl_values, dtype=np.float64)
            w = np.asarray(e.itl_weights, dtype=np.float64)
            for c in np.flatnonzero(counts):
                g, k = to_global[c], int(counts[c])
                sel = slice(None) if k == v.size else codes == c
                yield g, slice(int(cursor[g]), int(cursor[g]) + k), v[sel], w[sel]
                cursor[g] += k

    return bounds, placed()


def _itl_distributions(engines) -> tuple[dict, dict[str | None, dict]]:
    """The ``distribution`` of every engine's inter-token gaps, and of each group's: the same dicts as
    ``distribution`` gives on the gaps concatenated group by group (groups in first-seen order, each
    group's gaps in engine-then-record order), without concatenating them.

    A fleet run has ~100 gaps per turn (~300 M at full scale); concatenated, sorted by group and then
    sorted by value, each full-size copy cost 8 bytes a gap. Now the only full-size array is the weighted
    gaps (value x weight) in that order, because the mean's sum depends on the order; the quantiles come
    from ``grouped_weighted_quantiles``, which reads the engines' own columns."""
    order, plan = _itl_plan(engines)
    if not plan:
        return distribution([]), {}
    bounds, placed = _itl_layout(plan, len(order))
    weighted = np.empty(int(bounds[-1]), dtype=np.float64)
    weight = np.zeros(len(order), dtype=np.float64)  # whole numbers: exact in any order
    for g, slot, v, w in placed:
        np.multiply(v, w, out=weighted[slot])
        weight[g] += w.sum()

    def parts():
        for e, to_global, _counts in plan:
            codes, _labels = _engine_codes(e)
            yield (np.asarray(e.itl_values, dtype=np.float64), np.asarray(e.itl_weights, dtype=np.float64),
                   to_global[codes])

    qs = grouped_weighted_quantiles(parts, len(order), tuple(p / 100 for p in PERCENTILES))
    if qs is None:  # a NaN or -0.0 gap: the plain definition, on concatenated copies
        by_group, all_v, all_w = _itl_by_group(engines)
        return distribution(all_v, all_w), {label: distribution(v, w) for label, (v, w) in by_group.items()}

    def dist(quantiles: list[float], lo: int, hi: int, total: float) -> dict:
        # as ``distribution`` computes it: np.average's sum of value x weight over the sample, in order
        out: dict[str, float | int] = {f"p{p}": x for p, x in zip(PERCENTILES, quantiles)}
        if total == 0:
            raise ZeroDivisionError("Weights sum to zero, can't be normalized")
        out["mean"] = float(weighted[lo:hi].sum() / np.float64(total))
        out["count"] = int(total)
        return out

    whole = dist(qs[0], 0, int(bounds[-1]), float(weight.sum()))
    groups = {label: dist(qs[1 + i], int(bounds[i]), int(bounds[i + 1]), float(weight[i]))
              for label, i in order.items()}
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
    gpu_hours = sum(world.model_info[h.model]["tp"] * (((h.removed_s if h.removed_s is not None else end_s)
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
