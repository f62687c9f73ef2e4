"""Leave-one-run-out cross-validation of a calibration: judge a model option on runs the fit did not see.

    from twin.calibration.crossval import cross_validate, format_cv_table
    report = cross_validate(sorted(Path("runs/rec/calibration").iterdir()), options=FitOptions(first_step=True))
    print(format_cv_table(report))

Folds, one per run given:

* an **offline** run is left out of the fit (every other run, server runs included, is fitted as ``twin calibrate``
  would) and replayed with the resulting profile;
* a **server** run is left out likewise when there are at least two server runs (the server section needs one to
  fit); with a single server run its fold is skipped, and said so.

Each left-out run is compared with its recording by ``twin.calibration.fidelity`` (one run, so no repeat spread:
the tolerance is ``tolerance``, 10 % by default). The total counts the latency items of the done-when, TTFT, ITL
and E2E p50/p90, over all folds: how many are within the tolerance, and their mean |relative error|. Compare two
settings by running both on the same runs: the higher count (then the lower mean) is the better choice on data not
used for the fit. Deterministic: the fits are, and ``noise`` replays are seeded per run (``twin.replay``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from twin.calibration.calibrate import CalibrationError, FitOptions, calibrate
from twin.calibration.fidelity import DEFAULT_TOLERANCE, LATENCY_ITEMS, TOLERANCE_ITEMS, fidelity
from twin.calibration.recorded import load_recorded_run


def folds(modes: Sequence[str]) -> tuple[list[tuple[int, list[int]]], list[tuple[int, str]]]:
    """``(folds, skipped)`` for runs of the given modes: each fold is ``(left_out, fitted_on)`` (indices), each
    skipped run ``(index, why)``."""
    offline = [i for i, m in enumerate(modes) if m != "server"]
    server = [i for i, m in enumerate(modes) if m == "server"]
    out: list[tuple[int, list[int]]] = []
    skipped: list[tuple[int, str]] = []
    for i in range(len(modes)):
        if i in offline and len(offline) < 2:
            skipped.append((i, "the only offline run: nothing is left to fit the step-time regimes"))
        elif i in server and len(server) < 2:
            skipped.append((i, "the only server run: nothing is left to fit the server section"))
        else:
            out.append((i, [j for j in range(len(modes)) if j != i]))
    return out, skipped


def _total(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    errs = [it["rel_error"] for r in rows for k, it in r["items"].items() if k in LATENCY_ITEMS
            and it["rel_error"] is not None]
    passed = [it["pass"] for r in rows for k, it in r["items"].items() if k in LATENCY_ITEMS and it["pass"] is not None]
    return {"items": len(passed), "within": int(sum(passed)),
            "mean_abs_error": float(np.mean(np.abs(errs))) if errs else None}


def cross_validate(run_dirs: Sequence[str | Path], *, options: FitOptions = FitOptions(), noise: bool | None = None,
                   tolerance: float = DEFAULT_TOLERANCE, seeds: int = 1) -> dict[str, Any]:
    """The cross-validation report (a JSON-ready dict); see the module doc. ``noise`` as ``fidelity``'s (None: on,
    every fitted profile has the table). ``seeds``: with noise, replay each left-out run with that many noise draws
    (``replay``'s ``noise_seed`` 0, 1, ...; one row per fold and draw, the totals over all), since one draw's count
    moves by a few items; without noise the replays are deterministic and 1 is enough. Raises ``CalibrationError``
    when no fold can be formed."""
    paths = [Path(p) for p in run_dirs]
    recs = [load_recorded_run(p) for p in paths]
    plan, skipped = folds([r.run.mode for r in recs])
    if not plan:
        raise CalibrationError("cross-validation needs at least two offline runs (or two server runs with an "
                               "offline one): every run would be left out of its own fit with nothing to fit on")
    if seeds < 1:
        raise ValueError("seeds must be at least 1")
    rows: list[dict[str, Any]] = []
    noise_used = bool(noise)
    with tempfile.TemporaryDirectory(prefix="twin-crossval-") as tmp:
        from twin.engine_profiles.derive import write_spec

        for k, (left, fitted_on) in enumerate(plan):
            fit = calibrate([paths[j] for j in fitted_on], name=f"crossval-{k}",
                            command="twin calibrate --cross-validate", generated_on="cross-validation", source_label=lambda p: p.name, options=options)
            profile = Path(tmp) / f"fold-{k}.yaml"
            write_spec(fit.spec, profile)
            for seed in range(seeds):
                rep = fidelity([paths[left]], profile=str(profile), tolerance=tolerance, noise=noise,
                               noise_seed=seed)
                noise_used = bool(rep["step_time_noise"])
                run = rep["runs"][0]
                items = {name: {key: run["items"][name][key] for key in ("real", "twin", "rel_error", "pass")}
                         for name in TOLERANCE_ITEMS}
                comp = run["items"].get("composition")
                rows.append({"left_out": str(paths[left]), "name": paths[left].name, "mode": recs[left].run.mode,
                             "fitted_on": [paths[j].name for j in fitted_on], "refused": fit.refused,
                             "composition": None if comp is None else comp["pass"], "items": items,
                             "latency": _total([{"items": items}])} | ({"seed": seed} if seeds > 1 else {}))
                if not noise_used:
                    break  # deterministic: every draw would be the same
    return {
        "runs": [str(p) for p in paths], "options": asdict(options), "noise": noise_used, "tolerance": tolerance,
        "latency_items": list(LATENCY_ITEMS), "folds": rows, **({"seeds": seeds} if seeds > 1 else {}),
        "skipped": [{"run": str(paths[i]), "why": why} for i, why in skipped],
        "total": {**_total(rows),
                  "offline": _total([r for r in rows if r["mode"] != "server"]),
                  "server": _total([r for r in rows if r["mode"] == "server"])},
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}"


def _line(t: dict[str, Any]) -> str:
    mean = "n/a" if t["mean_abs_error"] is None else f"{t['mean_abs_error']:.3f}"
    return f"{t['within']} of {t['items']} within tolerance, mean |error| {mean}"


def format_cv_table(report: dict[str, Any]) -> str:
    """The report as text: one line per fold (relative error of each latency item, %), then the totals."""
    opts = [k.replace("_", "-") for k, v in report["options"].items() if v] + (["noise"] if report["noise"] else [])
    labels = [TOLERANCE_ITEMS[k][0] for k in report["latency_items"]]
    lines = [f"leave-one-run-out cross-validation of {len(report['runs'])} runs; options: "
             f"{', '.join(opts) or 'none'}; tolerance {report['tolerance']:.0%}"
             + (f"; {report['seeds']} noise draws per run" if report.get("seeds", 1) > 1 and report["noise"] else ""),
             f"  {'left out':<28}{'mode':<9}" + "".join(f"{lab:>10}" for lab in labels) + "  within  composition"]
    for r in report["folds"]:
        comp = "-" if r["composition"] is None else ("identical" if r["composition"] else "differs")
        name = r["name"] + (f" #{r['seed']}" if "seed" in r else "")
        lines.append(f"  {name:<28}{r['mode']:<9}"
                     + "".join(f"{_pct(r['items'][k]['rel_error']):>10}" for k in report["latency_items"])
                     + f"  {r['latency']['within']}/{r['latency']['items']:<5} {comp}")
        for why in (r["refused"] if r.get("seed", 0) == 0 else []):
            lines.append(f"      refused from this fold's fit: {why}")
    for s in report["skipped"]:
        lines.append(f"  {Path(s['run']).name:<28}skipped: {s['why']}")
    t = report["total"]
    lines += ["", "errors are (twin - real) / real in %, of the run left out, replayed with the profile fitted on "
                  "the others",
              f"total   {_line(t)}", f"offline {_line(t['offline'])}", f"server  {_line(t['server'])}"]
    return "\n".join(lines)
