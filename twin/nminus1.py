"""The N-1 planning check: run three regions at a share of their peak, lose one, and see whether the
remaining regions hold the SLOs; report the largest share at which N-1 holds.

For each share s the scenario runs with ``fleet.traffic.scale = s``; one region is lost at ``fail_at_s``.
The verdict reads the turns that arrive after DNS failover plus a settling time: N-1 holds when their SLO
attainment (completed within the TTFT and TPOT SLOs, over arrived turns) is at least ``target`` — the
same rule is applied to the turns before the loss, which must hold too, or the share is over capacity
even with every region up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twin.runner import run_scenario
from twin.scenario import load_scenario


def attainment(req: dict, *, start_s: float, end_s: float, ttft_slo: float, itl_slo: float) -> tuple[float, int]:
    """Share of turns arriving in [start, end) completed within both SLOs; turns the user cancelled are a
    choice, not a miss, and are left out."""
    idx = [i for i, a in enumerate(req["arrival_s"]) if start_s <= a < end_s
           and not (req["outcome"][i] == "cancelled" and req["reason"][i] == "user_cancelled")]
    if not idx:
        return float("nan"), 0
    good = 0
    for i in idx:
        tpot = req["tpot_s"][i]
        if (req["outcome"][i] == "completed" and req["ttft_s"][i] <= ttft_slo
                and (tpot is None or np.isnan(tpot) or tpot <= itl_slo)):
            good += 1
    return good / len(idx), len(idx)


def check(scenario_path: str, *, shares: list[float], region: str, fail_at_s: float, settle_s: float = 30.0,
          lead_s: float = 20.0, target: float = 0.95, seed: int | None = None, seeds: list[int] | None = None,
          overrides: list[str] = ()) -> dict[str, Any]:
    """One row per share. ``seeds``: run each share on each of them (instead of ``seed``, or the scenario's); a
    share holds only when it holds on every seed, and its row reads the worst seed (lowest attainments, highest TTFT
    p99), with each seed's own figures under ``seeds``. Near the boundary one seed is not a verdict."""
    runs = list(seeds) if seeds else [seed]
    rows = []
    for s in shares:
        per_seed = [_one(scenario_path, share=s, region=region, fail_at_s=fail_at_s, settle_s=settle_s,
                         lead_s=lead_s, target=target, seed=k, overrides=overrides) for k in runs]
        if len(per_seed) == 1:
            rows.append(per_seed[0])
            continue
        p99s = [r["ttft_p99_after_s"] for r in per_seed if r["ttft_p99_after_s"] is not None]
        rows.append({"share": s, "attainment_before": min(r["attainment_before"] for r in per_seed),
                     "turns_before": sum(r["turns_before"] for r in per_seed),
                     "attainment_after": min(r["attainment_after"] for r in per_seed),
                     "turns_after": sum(r["turns_after"] for r in per_seed),
                     "ttft_p99_after_s": max(p99s) if p99s else None,
                     "holds_all_regions": all(r["holds_all_regions"] for r in per_seed),
                     "holds_n_minus_1": all(r["holds_n_minus_1"] for r in per_seed),
                     "seeds_held": sum(r["holds_n_minus_1"] for r in per_seed),
                     "wall_s": sum(r["wall_s"] for r in per_seed), "seeds": per_seed})
    held = [r["share"] for r in rows if r["holds_n_minus_1"]]
    return {"scenario": scenario_path, "region_lost": region, "fail_at_s": fail_at_s, "target_attainment": target,
            "seeds": runs if seeds else None, "rows": rows,
            "largest_share_n_minus_1_holds": max(held) if held else None}


def _one(scenario_path: str, *, share: float, region: str, fail_at_s: float, settle_s: float, lead_s: float,
         target: float, seed: int | None, overrides: list[str]) -> dict[str, Any]:
    sc = load_scenario(scenario_path, overrides=[
        *overrides, f"fleet.traffic.scale={share}",
        f"fleet.faults=[{{kind: region_loss, at_s: {fail_at_s}, region: {region}}}]"])
    res = run_scenario(sc, seed=seed)
    if not res.ok:
        raise RuntimeError(res.manifest["exception"])
    req = res.tables["requests"].to_pydict()
    slo = sc.slo
    dns = sc.fleet.failover.dns_failover_s
    end = sc.fleet.traffic.duration_s
    # turns that arrived with ``lead_s`` to finish before the loss: the all-regions baseline
    before, n_before = attainment(req, start_s=fail_at_s / 3, end_s=max(fail_at_s - lead_s, fail_at_s / 2),
                                  ttft_slo=slo.ttft_s, itl_slo=slo.itl_s)
    after, n_after = attainment(req, start_s=fail_at_s + dns + settle_s, end_s=end, ttft_slo=slo.ttft_s,
                                itl_slo=slo.itl_s)
    idx = [i for i, a in enumerate(req["arrival_s"]) if a >= fail_at_s + dns + settle_s]
    ttft = np.array([req["ttft_s"][i] for i in idx if req["outcome"][i] == "completed"], dtype=float)
    return {"share": share, "seed": res.seed, "attainment_before": before, "turns_before": n_before,
            "attainment_after": after, "turns_after": n_after,
            "ttft_p99_after_s": float(np.quantile(ttft, 0.99)) if ttft.size else None,
            "holds_all_regions": before >= target, "holds_n_minus_1": after >= target and before >= target,
            "wall_s": res.summary["wall_s"]}


def format_check(rep: dict[str, Any]) -> str:
    seeds = rep.get("seeds")
    lines = [f"N-1 check: lose {rep['region_lost']} at t={rep['fail_at_s']:.0f} s; holds = SLO attainment >= "
             f"{rep['target_attainment']:.2f} before the loss and after failover"
             + (f"; seeds {', '.join(str(k) for k in seeds)}: a share holds when it holds on every seed, and its "
                "row reads the worst seed" if seeds else ""), "",
             f"{'share':>6}{'attain before':>15}{'attain after':>14}{'TTFT p99 after':>16}{'all regions':>13}{'N-1':>6}"
             + (f"{'seeds held':>12}  attain after by seed" if seeds else "")]
    for r in rep["rows"]:
        p99 = "n/a" if r["ttft_p99_after_s"] is None else f"{r['ttft_p99_after_s']:.2f} s"
        line = (f"{r['share']:>6.2f}{r['attainment_before']:>15.3f}{r['attainment_after']:>14.3f}{p99:>16}"
                f"{'holds' if r['holds_all_regions'] else 'FAILS':>13}{'holds' if r['holds_n_minus_1'] else 'FAILS':>6}")
        if seeds:
            line += (f"{str(r['seeds_held']) + ' of ' + str(len(seeds)):>12}  "
                     + " ".join(f"{x['attainment_after']:.3f}" for x in r["seeds"]))
        lines.append(line)
    best = rep["largest_share_n_minus_1_holds"]
    lines.append("")
    lines.append(f"largest share of peak at which N-1 holds{' on every seed' if seeds else ''}: {best:.2f}"
                 if best is not None else "N-1 holds at none of the shares tried")
    return "\n".join(lines)
