"""Drills: run a fault scenario and print the timeline an on-call engineer reads.

The timeline is built from the run's tables only (events, requests): when the region went, streams
dropped, resumed and failed, where traffic went, ladder rungs and alerts, recovery, and the user-visible
damage per phase (failed turns, TTFT and per-request TPOT as the inter-token proxy).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa

from twin.metrics import distribution

TIMELINE_KINDS = ("fault.", "region.", "dns.", "replica.crashed", "replica.recovered", "node.", "ladder.", "alert.",
                  "autoscaler.", "canary.")


def _region_of(scope: str | None) -> str | None:
    if not scope or not scope.startswith("fleet."):
        return None
    return scope.split(".")[1]


def phases(events: dict, *, at_s: float, end_s: float) -> list[tuple[str, float, float]]:
    """Before the loss, outage until DNS failover, failed over until recovery, recovered."""
    t_dns = next((t for k, t in zip(events["kind"], events["t_s"]) if k == "dns.failed_over" and t >= at_s), None)
    t_back = next((t for k, t in zip(events["kind"], events["t_s"]) if k == "region.recovering" and t >= at_s), None)
    out = [("before", 0.0, at_s)]
    if t_dns is None:
        out.append(("outage", at_s, end_s))
        return out
    out.append(("outage (DNS not moved)", at_s, t_dns))
    if t_back is None:
        out.append(("failed over", t_dns, end_s))
    else:
        out.append(("failed over", t_dns, t_back))
        out.append(("recovering/recovered", t_back, end_s))
    return out


def drill_report(events: pa.Table, requests: pa.Table, *, region: str, at_s: float, end_s: float) -> dict[str, Any]:
    ev = events.to_pydict()
    rq = requests.to_pydict()
    timeline = []
    dropped = 0
    for t, k, scope, v, reason in zip(ev["t_s"], ev["kind"], ev["scope"], ev["value"], ev["reason"]):
        if k.startswith(TIMELINE_KINDS):
            if k == "replica.crashed":
                dropped += int(v or 0)
            timeline.append({"t_s": t, "kind": k, "scope": scope, "value": v, "reason": reason})
    # collapse per-replica crash lines into one line per instant
    collapsed: list[dict] = []
    for item in timeline:
        last = collapsed[-1] if collapsed else None
        if last and item["kind"] in ("replica.crashed", "replica.recovered") and last["kind"] == item["kind"] \
                and abs(last["t_s"] - item["t_s"]) < 1e-9:
            last["count"] = last.get("count", 1) + 1
            last["value"] = (last["value"] or 0) + (item["value"] or 0)
            continue
        collapsed.append(dict(item))
    resumed = sum(1 for k in ev["kind"] if k == "request.resumed")
    retried = sum(1 for k in ev["kind"] if k == "request.retried")
    table = []
    arrival = np.array(rq["arrival_s"], dtype=float)
    ttft = np.array(rq["ttft_s"], dtype=float)
    tpot = np.array(rq["tpot_s"], dtype=float)
    homes = rq.get("region") or [None] * len(arrival)
    served = [_region_of(s) for s in rq["scope"]]
    for name, a, b in phases(ev, at_s=at_s, end_s=end_s):
        idx = [i for i in range(len(arrival)) if a <= arrival[i] < b]
        outcomes: dict[str, int] = {}
        for i in idx:
            key = rq["outcome"][i] if rq["outcome"][i] == "completed" else f"{rq['outcome'][i]}:{rq['reason'][i]}"
            outcomes[key] = outcomes.get(key, 0) + 1
        done = [i for i in idx if rq["outcome"][i] == "completed"]
        moved = sum(1 for i in idx if homes[i] == region and served[i] not in (None, region))
        from_region = sum(1 for i in idx if homes[i] == region)
        table.append({
            "phase": name, "from_s": a, "to_s": b, "turns": len(idx), "completed": len(done),
            "not_completed": {k: v for k, v in sorted(outcomes.items()) if k != "completed"},
            "ttft_s": distribution(ttft[done][np.isfinite(ttft[done])]) if done else distribution([]),
            "tpot_s": distribution(tpot[done][np.isfinite(tpot[done])]) if done else distribution([]),
            "turns_homed_in_region": from_region, "served_elsewhere": moved,
        })
    return {"region": region, "at_s": at_s, "timeline": collapsed, "streams_dropped": dropped,
            "turns_retried": retried, "turns_resumed": resumed, "phases": table}


def format_drill(rep: dict[str, Any]) -> str:
    lines = [f"region-loss drill: {rep['region']} lost at t={rep['at_s']:.0f} s", "", "timeline"]
    for it in rep["timeline"]:
        what = it["kind"]
        detail = ""
        if what == "replica.crashed":
            detail = f"{it.get('count', 1)} replicas, {int(it['value'] or 0)} live streams dropped"
        elif what == "replica.recovered":
            detail = f"{it.get('count', 1)} replicas back"
        elif it["reason"]:
            detail = str(it["reason"])
        scope = it["scope"] if what not in ("replica.crashed", "replica.recovered") else ""
        lines.append(f"  t={it['t_s']:8.1f} s  {what:<22} {scope or ''} {detail}".rstrip())
    lines += ["", f"streams dropped {rep['streams_dropped']}, turns retried {rep['turns_retried']}, "
                  f"resumed from the last persisted token {rep['turns_resumed']}", ""]
    lines.append(f"{'phase':<24}{'turns':>7}{'done':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
                 f"{'TPOT p99':>10}{'homed':>7}{'moved':>7}  not completed")
    fmt = lambda x: "   n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"  # noqa: E731
    for p in rep["phases"]:
        nc = ", ".join(f"{k} {v}" for k, v in p["not_completed"].items()) or "-"
        lines.append(f"{p['phase']:<24}{p['turns']:>7}{p['completed']:>7}{fmt(p['ttft_s']['p50']):>10}"
                     f"{fmt(p['ttft_s']['p99']):>10}{fmt(p['tpot_s']['p50']):>10}{fmt(p['tpot_s']['p99']):>10}"
                     f"{p['turns_homed_in_region']:>7}{p['served_elsewhere']:>7}  {nc}")
    lines.append("")
    lines.append("(TTFT and TPOT in seconds over completed turns by arrival phase; TPOT is the per-turn inter-token "
                 "proxy; 'homed' = turns from users homed in the lost region, 'moved' = of those, served elsewhere)")
    return "\n".join(lines)
