"""``twin fidelity --sessions``: many calibration sessions' held-out tables at once, and where their error leans.

A *session* is the folder one run of ``scripts/calibrate-cpu.sh`` writes (``runs/calibrate-cpu/<model>``), or one
committed under ``tests/fixtures/calibration/``: the fitted profile (its one top-level ``*.yaml``) and the held-out
runs (``held-out*/<workload>/``). Each session's held-out runs are judged with its own profile, as the one command
judged them, or all with one ``profile`` (the shipped one, say). Three views come out:

- per session, the items passing and the issue's latency items (TTFT, ITL and E2E p50/p90) passing, with the
  held-out workloads whose latency items fail;
- over all sessions, the failing latency items by how far their run's decode steps sat from its profile's model
  (``fidelity.by_step_level``): failures on runs near it are the model's, on runs well off it the host's speed;
- per held-out workload (a run folder's name) and latency item over all sessions: how many runs pass, the median
  signed error, and in what share of runs the twin is slow. Host noise errs both ways; an item whose error leans
  one way over many sessions is the model's (docs/calibration.md, "Where calibration stands"). Beside it, twin*'s
  median signed error (the replay with the recorded step times): a lean twin* shares is the scheduling and latency
  accounting's, one it lacks the step-time model's.

Folders without held-out runs, or (without ``profile``) without exactly one profile file, are skipped and named.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twin.calibration.fidelity import (DEFAULT_TOLERANCE, LATENCY_ITEMS, TOLERANCE_ITEMS, by_step_level, decode_level,
                                      fidelity, format_by_step_level, latency_counts)


def session_parts(folder: str | Path) -> tuple[Path | None, list[Path], str | None]:
    """A session folder's own profile file, its held-out run folders (sorted) and why it is not a session
    (None when it is)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None, [], "not a folder"
    runs = sorted(p.parent for p in folder.glob("held-out*/*/run.json"))
    profiles = sorted(folder.glob("*.yaml"))
    own = profiles[0] if len(profiles) == 1 else None
    if not runs:
        return own, runs, "no held-out runs (held-out*/<workload>/run.json)"
    if own is None:
        return None, runs, f"{len(profiles)} profile files at its top level, not one"
    return own, runs, None


def sessions_report(folders: Sequence[str | Path], *, profile: str | None = None, draws: int = 9,
                    tolerance: float = DEFAULT_TOLERANCE, noise: bool | None = None) -> dict[str, Any]:
    """Each session's held-out runs through ``fidelity`` (its own profile, or ``profile`` for all) with ``draws``
    noise draws (``noise`` as fidelity's), and the latency items gathered by workload. Raises ValueError when no
    folder is a session."""
    sessions, skipped = [], []
    for folder in folders:
        own, runs, why = session_parts(folder)
        if why is not None and not (profile is not None and runs):
            skipped.append({"folder": str(folder), "why": why})
            continue
        use = profile if profile is not None else str(own)
        rep = fidelity(runs, profile=use, tolerance=tolerance, noise=noise, draws=draws)
        # an item without a verdict (no real value to compare with) is left out, as fidelity's own totals do
        latency = [{"workload": r["name"], "run": r["run"], "item": k, "decode_level": decode_level(r),
                    **_latency(r["items"][k])}
                   for r in rep["runs"] for k in LATENCY_ITEMS if r["items"][k]["pass"] is not None]
        exact = [it["pass"] for r in rep["runs"] if r["mode"] == "offline"
                 for it in r["items"].values() if it["kind"] == "exact" and it["pass"] is not None]
        failing: dict[str, int] = {}
        for x in latency:
            if x["pass"] is False:
                failing[x["workload"]] = failing.get(x["workload"], 0) + 1
        lat = rep["latency_items"]
        sessions.append({"folder": str(folder), "profile": use, "runs": len(runs),
                         "items": rep["summary"]["items"], "passed": rep["summary"]["passed"],
                         "latency_items": lat["items"], "latency_passed": lat["passed"],
                         "latency_within_tolerance_outright": lat["within_tolerance_outright"],
                         "latency_median_abs_error": lat["median_abs_error"],
                         "offline_exact_items": len(exact), "offline_exact_passed": sum(exact),
                         "failing_latency": dict(sorted(failing.items())),
                         "latency_by_step_level": rep["latency_by_step_level"], "latency": latency})
    if not sessions:
        raise ValueError("no session among the folders: " + "; ".join(f"{s['folder']}: {s['why']}" for s in skipped))
    return {"profile": profile, "draws": draws, "default_tolerance": tolerance, "sessions": sessions,
            "skipped": skipped, "totals": _totals(sessions, tolerance), "by_workload": _by_workload(sessions)}


def _latency(item: dict[str, Any]) -> dict[str, Any]:
    return {"real": item["real"], "twin": item["twin"], "rel_error": item["rel_error"],
            "rel_error_recorded_steps": item.get("rel_error_recorded_steps"),
            "tolerance": item["tolerance"], "pass": item["pass"]}


def _totals(sessions: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    keys = ("items", "passed", "offline_exact_items", "offline_exact_passed")
    lat = latency_counts([x for s in sessions for x in s["latency"]], tolerance)
    return {"sessions": len(sessions), **{k: sum(s[k] for s in sessions) for k in keys},
            "latency_items": lat["items"], "latency_passed": lat["passed"],
            "latency_within_tolerance_outright": lat["within_tolerance_outright"],
            "latency_median_abs_error": lat["median_abs_error"],
            "latency_by_step_level": by_step_level([(x["decode_level"], x["pass"])
                                                    for s in sessions for x in s["latency"]])}


def _by_workload(sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in sessions:
        for x in s["latency"]:
            groups.setdefault((x["workload"], x["item"]), []).append(x)
    out = []
    for (workload, item), xs in sorted(groups.items(), key=lambda kv: (kv[0][0], LATENCY_ITEMS.index(kv[0][1]))):
        errs = [x["rel_error"] for x in xs if x["rel_error"] is not None]
        recorded = [x["rel_error_recorded_steps"] for x in xs if x["rel_error_recorded_steps"] is not None]
        failed = [x for x in xs if not x["pass"]]
        out.append({"workload": workload, "item": item, "runs": len(xs), "passed": len(xs) - len(failed),
                    "median_rel_error": statistics.median(errs) if errs else None,
                    "median_rel_error_recorded_steps": statistics.median(recorded) if recorded else None,
                    "twin_slow_share": sum(e > 0 for e in errs) / len(errs) if errs else None,
                    "failed_twin_slow": sum(1 for x in failed if (x["rel_error"] or 0) > 0),
                    "failed_twin_fast": sum(1 for x in failed if (x["rel_error"] or 0) < 0)})
    return out


def format_sessions(report: dict[str, Any]) -> str:
    """The report as text: a line per session, the totals, then the latency items by workload."""
    t = report["totals"]
    who = "its own profile" if report["profile"] is None else f"profile {report['profile']}"
    lines = [f"{t['sessions']} session(s), each session's held-out runs with {who}, "
             f"{report['draws']} noise draw(s) a run; latency items = TTFT, ITL and E2E p50/p90", "",
             f"{'session':<44}{'items':>11}{'latency':>10}{'outright':>10}{'|error|':>9}  failing latency items"]
    for s in report["sessions"]:
        failing = ", ".join(f"{w} {n}" for w, n in s["failing_latency"].items()) or "-"
        lines.append(f"{Path(s['folder']).name:<44}{s['passed']:>6} /{s['items']:>3}{s['latency_passed']:>5} /"
                     f"{s['latency_items']:>3}{s['latency_within_tolerance_outright']:>10}"
                     f"{_pct(s['latency_median_abs_error']):>9}  {failing}")
    share = t["latency_passed"] / t["latency_items"] if t["latency_items"] else 0.0
    tol = report["default_tolerance"]
    lines += ["", f"(latency: items passing, the issue's rule; outright: within {tol:.0%} of the real run, not widened "
                  f"by the repeats' spread; |error|: the median |relative error| of the latency items)",
              f"all: {t['passed']:,} of {t['items']:,} items pass; {t['latency_passed']:,} of "
              f"{t['latency_items']:,} latency items ({share:.1%}), {t['latency_within_tolerance_outright']:,} within "
              f"{tol:.0%} outright, median |error| {_pct(t['latency_median_abs_error'])}; offline exact items (steps, "
              f"composition, preemptions, prefix hits) {t['offline_exact_passed']:,} of {t['offline_exact_items']:,}"]
    line = format_by_step_level(t["latency_by_step_level"])
    if line is not None:
        lines.append(line)
    for s in report["skipped"]:
        lines.append(f"skipped {s['folder']}: {s['why']}")
    lines += ["", "latency items by workload, over all sessions (error = twin / real - 1; slow = the twin's value "
                  "is the larger; twin* = the replay with the recorded step times, so a lean that twin* shares is "
                  "scheduling and latency accounting, one it lacks is the step-time model)",
              f"  {'workload':<30}{'item':<10}{'runs':>6}{'pass':>6}{'median error':>14}{'twin slow':>11}"
              f"{'fails slow/fast':>17}{'twin* median':>14}"]
    for b in report["by_workload"]:
        med = "n/a" if b["median_rel_error"] is None else f"{b['median_rel_error']:+.1%}"
        slow = "n/a" if b["twin_slow_share"] is None else f"{b['twin_slow_share']:.0%}"
        star = "n/a" if b["median_rel_error_recorded_steps"] is None else f"{b['median_rel_error_recorded_steps']:+.1%}"
        fails = f"{b['failed_twin_slow']} / {b['failed_twin_fast']}"
        lines.append(f"  {b['workload']:<30}{TOLERANCE_ITEMS[b['item']][0]:<10}{b['runs']:>6}{b['passed']:>6}{med:>14}"
                     f"{slow:>11}{fails:>17}{star:>14}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"
