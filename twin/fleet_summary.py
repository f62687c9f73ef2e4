"""The fleet run's summary: the single-replica summary's fields, plus per-tier and per-class breakdowns,
rejections by reason, GPU-hours and dollars per million output tokens."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from twin.metrics import distribution
from twin.results import summarize


def _itl_by_group(engines) -> dict[str | None, tuple[np.ndarray, np.ndarray]]:
    """Every engine's inter-token gaps and weights by group label: groups in first-seen order (engines in
    order, gaps in order), each group's gaps in engine-then-record order. Numpy columns, not Python lists:
    a fleet run has ~100 gaps per turn."""
    vals, wts, gids = [], [], []
    order: dict[str | None, int] = {}
    for e in engines:
        v = np.asarray(e.itl_values, dtype=np.float64)
        if v.size == 0:
            continue
        g = e.itl_groups
        if g is None or len(g) == 0:
            codes, labels = np.zeros(v.size, dtype=np.int64), [None]
        elif hasattr(g, "codes"):  # twin.models.engine_parts.GroupColumn
            codes, labels = np.asarray(g.codes, dtype=np.int64), g.labels
        else:
            labels = list(dict.fromkeys(g))
            index = {x: i for i, x in enumerate(labels)}
            codes = np.array([index[x] for x in g], dtype=np.int64)
        present, first = np.unique(codes, return_index=True)
        for c in present[np.argsort(first, kind="stable")]:  # this engine's labels in first-seen order
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


def fleet_summary(world, reqs: pa.Table, *, end_s: float, wall_s: float, slo) -> dict:
    engines = world.engines()
    by_group = _itl_by_group(engines)
    all_v = np.concatenate([vals for vals, _ in by_group.values()]) if by_group else []
    all_w = np.concatenate([wts for _, wts in by_group.values()]) if by_group else []
    means = world.rec.level_means(end_s)
    kv = [v for (scope, metric), v in means.items() if metric == "kv_usage"]
    s = summarize(requests=reqs, itl_values=all_v, itl_weights=all_w, counters=world.counters(),
                  kv_usage_mean=float(np.mean(kv)) if kv else 0.0, sim_time_s=end_s, wall_s=wall_s,
                  slo_ttft_s=slo.ttft_s, slo_itl_s=slo.itl_s)
    d = reqs.to_pydict()
    tiers = sorted({t for t in d["tier"] if t})
    s["by_tier"] = {}
    for tier in tiers:
        idx = [i for i, t in enumerate(d["tier"]) if t == tier]
        sub = reqs.take(pa.array(idx, pa.int64()))
        vals, wts = by_group.get(tier, ([], []))
        part = summarize(requests=sub, itl_values=vals, itl_weights=wts, counters={}, kv_usage_mean=0.0,
                         sim_time_s=end_s, wall_s=wall_s, slo_ttft_s=slo.ttft_s, slo_itl_s=slo.itl_s)
        s["by_tier"][tier] = {k: part[k] for k in ("requests", "outcomes_by_reason", "ttft_s", "itl_s", "tpot_s",
                                                   "goodput_rps", "slo_attainment", "output_tokens_per_s")}
    s["by_class"] = {}
    for klass in sorted({k for k in d["klass"] if k}):
        idx = [i for i, k in enumerate(d["klass"]) if k == klass]
        ttft = np.array([d["ttft_s"][i] for i in idx], dtype=float)
        done = [i for i in idx if d["outcome"][i] == "completed"]
        s["by_class"][klass] = {"arrived": len(idx), "completed": len(done),
                                "ttft_s": distribution(ttft[np.isfinite(ttft)])}
    gpus = world.gpus
    gpu_hours = sum(world.model_info[h.model]["tp"] * (((h.removed_s if h.removed_s is not None else end_s)
                                                        - h.started_s) / 3600.0) for h in world.handles)
    price = [i["price"] for i in world.model_info.values() if i["price"]]
    usd_per_gpu_hour = float(price[0]) if price else None
    out_tokens = int(np.nansum(np.array(d["output_tokens"], dtype=float)))
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
