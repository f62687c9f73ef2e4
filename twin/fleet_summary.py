"""The fleet run's summary: the single-replica summary's fields, plus per-tier and per-class breakdowns,
rejections by reason, GPU-hours and dollars per million output tokens."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from twin.metrics import distribution
from twin.results import summarize


def _itl_by_group(engines) -> dict[str | None, tuple[list[float], list[int]]]:
    out: dict[str | None, tuple[list[float], list[int]]] = {}
    for e in engines:
        groups = e.itl_groups or [None] * len(e.itl_values)
        for v, w, g in zip(e.itl_values, e.itl_weights, groups):
            vals, wts = out.setdefault(g, ([], []))
            vals.append(v)
            wts.append(w)
    return out


def fleet_summary(world, reqs: pa.Table, *, end_s: float, wall_s: float, slo) -> dict:
    engines = world.engines()
    by_group = _itl_by_group(engines)
    all_v = [v for vals, _ in by_group.values() for v in vals]
    all_w = [w for _, wts in by_group.values() for w in wts]
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
