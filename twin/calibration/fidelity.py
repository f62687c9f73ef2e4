"""How close the twin comes to recorded real runs: an error table per run, with a tolerance per item.

    from twin.calibration.fidelity import fidelity, format_table
    report = fidelity(["runs/held-out/heldout-server-bursty", ...], profile="cpu-tiny-llama")
    print(format_table(report))

Each run is replayed twice with the engine settings of its own run.json: with the profile's step times
(the twin as it would be used) and with the recorded step times plus the profile's per-step overhead
(scheduling and latency accounting alone, no step-time model). Items:

* exact: step count, step composition, preemptions, prefix-cache hits. These do not depend on the machine
  for offline runs. A server run's engine batches what has arrived when a step starts, so its step count and
  composition follow the arrival and step timing (its repeats differ in them too): there the step count is a
  tolerance item and the composition is reported (``kind: reported``) and not judged.
* tolerance: TTFT, ITL, TPOT and E2E p50/p90, output throughput, step-time sum (model execution only, the
  per-step overhead excluded on both sides). The tolerance is 10 % unless the same workload was recorded
  more than once among the runs given and the real values of that item spread wider between repeats.
  The run-to-run spread is the largest relative error one real repeat makes as a prediction of another,
  ``max / min - 1``: the twin passes an item when it is as close to the run as the repeats are to each
  other. A stricter rule is reported beside it (``summary.strict``): the tolerance widened only by the
  repeats' largest deviation from their own mean. Under that rule even an exact prediction of the repeats'
  mean can fail (its error is relative to the run, the deviation to the mean), so the report also counts how
  many items the repeats' mean itself passes there (docs/calibration-sessions.md, "The spread rule").

Pass/fail is judged on the profile replay; the recorded-step-time replay is reported beside it. Server-mode
runs replayed with a profile that has a ``server`` section get the API front end in both replays
(``twin.replay``); the step-time sum then leaves the front end's time out on the twin's side too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twin.calibration.calibrate import replay_recorded
from twin.calibration.recorded import RecordedRun, load_recorded_run
from twin.engine_profiles.profile import ServerFrontEnd
from twin.replay import compare, format_step_timing, recorded_step_timing, replay, run_label, server_front_end

DEFAULT_TOLERANCE = 0.10
# item key -> (label, unit scale for printing, unit)
TOLERANCE_ITEMS: dict[str, tuple[str, float, str]] = {
    "ttft_p50_s": ("TTFT p50", 1e3, "ms"),
    "ttft_p90_s": ("TTFT p90", 1e3, "ms"),
    "itl_p50_s": ("ITL p50", 1e3, "ms"),
    "itl_p90_s": ("ITL p90", 1e3, "ms"),
    "tpot_p50_s": ("TPOT p50", 1e3, "ms"),
    "tpot_p90_s": ("TPOT p90", 1e3, "ms"),
    "e2e_p50_s": ("E2E p50", 1e3, "ms"),
    "e2e_p90_s": ("E2E p90", 1e3, "ms"),
    "output_tokens_per_s": ("output tok/s", 1.0, ""),
    "step_time_sum_s": ("step-time sum", 1.0, "s"),
}
# the latency items the calibration issue's done-when names (TTFT, ITL and E2E p50/p90), counted apart in
# ``latency_items``
LATENCY_ITEMS = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "e2e_p50_s", "e2e_p90_s")
# a server run's items that follow arrival and step timing (``_server_timed_item``)
SERVER_TIMED_ITEMS = ("steps", "composition")
EXACT_ITEMS: dict[str, str] = {
    "steps": "steps",
    "composition": "composition",
    "preemptions": "preemptions",
    "prefix_cache_hits": "prefix hits",
}


def _rel(twin: float | None, real: float | None) -> float | None:
    if twin is None or real is None or not np.isfinite(twin) or not np.isfinite(real) or real == 0:
        return None
    return (twin - real) / real


def _values(rec: RecordedRun, result: Any, comparison: dict[str, Any], *, overhead_s: float,
            overhead_in_log_s: float) -> dict[str, Any]:
    """Flat item -> twin value (and real value) from one ``compare`` output."""
    real: dict[str, Any] = {}
    twin: dict[str, Any] = {}
    for key in ("ttft", "itl", "tpot", "e2e"):
        for p in ("p50", "p90"):
            d = comparison["latency"][f"{key}_s"][p]
            real[f"{key}_{p}_s"], twin[f"{key}_{p}_s"] = d["real"], d["twin"]
    real["output_tokens_per_s"] = comparison["output_tokens_per_s"]["real"]
    twin["output_tokens_per_s"] = comparison["output_tokens_per_s"]["twin"]
    it = result.tables["iterations"]
    # the iteration log's elapsed_ms leaves out only the overhead the step model declares (overhead_in_log_s); a
    # server run's front end beyond its per-step base is already out of the comparison's sum (``compare``; a run
    # without a recorded iteration log has no such item there)
    logged = (comparison["step_time_sum_s"]["twin"] if "step_time_sum_s" in comparison
              else float(np.sum(it.column("elapsed_ms").to_numpy())) / 1e3)
    twin_sum = logged - (overhead_s - overhead_in_log_s) * it.num_rows
    real["step_time_sum_s"] = float(np.sum(rec.iterations.elapsed_ms)) / 1e3 if rec.iterations is not None else None
    twin["step_time_sum_s"] = twin_sum
    exact_real: dict[str, Any] = {}
    exact_twin: dict[str, Any] = {}
    exact_match: dict[str, bool | None] = {}
    if "steps" in comparison:
        exact_real["steps"], exact_twin["steps"] = comparison["steps"]["real"], comparison["steps"]["twin"]
        exact_match["steps"] = comparison["steps"]["match"]
        c = comparison["composition"]
        exact_real["composition"] = "recorded"
        exact_twin["composition"] = ("identical" if c["match"] else
                                     f"differs at step {c['first_mismatch_step']}: real {c['real_at_mismatch']} "
                                     f"twin {c['twin_at_mismatch']}")
        exact_match["composition"] = c["match"]
    for key in ("preemptions", "prefix_cache_hits"):
        exact_real[key], exact_twin[key], exact_match[key] = (comparison[key]["real"], comparison[key]["twin"],
                                                              comparison[key]["match"])
    return {"real": real, "twin": twin, "exact_real": exact_real, "exact_twin": exact_twin, "exact_match": exact_match}


# What the recorder measured about the machine during a run, and which pass through one engine start it was
# (`twin record --repeats`); not the workload: repeats differ in them.
MEASURED_WORKLOAD_FIELDS = ("speed_probe", "front_end_pinning", "warmup_steps", "host_load", "engine_start",
                            "host_witness")


def workload_key(rec: RecordedRun) -> str:
    """Runs with equal keys are repeats: same mode and engine settings (async scheduling included), and the same
    workload description in run.json (less what the recorder measured, ``MEASURED_WORKLOAD_FIELDS``) or, where it
    has none, the same request set (prompts, output lengths, send times to the ms; a server run's measured send times
    jitter, so the description is preferred)."""
    r = rec.run
    h = hashlib.sha256()
    settings = [r.mode, r.engine_version, r.hardware, r.block_size, r.num_gpu_blocks, r.max_num_batched_tokens,
                r.max_num_seqs, r.max_model_len, r.enable_chunked_prefill, r.enable_prefix_caching, r.model_config_]
    h.update(json.dumps(settings + (["async_scheduling"] if r.async_scheduling else [])).encode())  # (sync: as before)
    if r.workload:
        described = {k: v for k, v in r.workload.items() if k not in MEASURED_WORKLOAD_FIELDS}
        h.update(json.dumps(described, sort_keys=True).encode())
    else:
        for q in rec.requests:
            h.update(json.dumps([round(q.arrival_s, 3), q.max_tokens, list(q.prompt_token_ids)]).encode())
    return h.hexdigest()[:16]


def _finite(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)


def spread(values: Sequence[float | None]) -> float | None:
    """The run-to-run spread of repeated real values: the largest relative error one repeat makes as a
    prediction of another, ``max / min - 1`` (None with fewer than two values or a value that is not positive)."""
    v = _finite(values)
    if v.size < 2 or v.min() <= 0:
        return None
    return float(v.max() / v.min() - 1.0)


def mean_deviation(values: Sequence[float | None]) -> float | None:
    """The stricter rule's spread: the largest relative deviation of a repeat from the repeats' mean (None with
    fewer than two values)."""
    v = _finite(values)
    if v.size < 2 or v.mean() == 0:
        return None
    return float(np.max(np.abs(v - v.mean())) / abs(v.mean()))


@dataclass
class _RunReplays:
    rec: RecordedRun
    prof: dict[str, Any]
    recd: dict[str, Any]
    draws: list[dict[str, Any]] | None = None  # each noise draw's ``twin`` values (``draws`` > 1), prof's the median


def _median(values: Sequence[float | None]) -> float | None:
    v = _finite(values)
    return float(np.median(v)) if v.size else None


def _over_draws(draws: list[dict[str, Any]]) -> dict[str, Any]:
    """One profile replay's values from several noise draws (``_values`` of each): the twin's tolerance items are
    the median over the draws (the twin's prediction, not one sample of its own spread); an exact item matches
    only if it matches in every draw, its value shown is the first draw's; a step count is the median's nearest
    int (a server run's, judged like a latency item)."""
    first = draws[0]
    twin = {k: _median([d["twin"][k] for d in draws]) for k in first["twin"]}
    exact_twin = dict(first["exact_twin"])
    if "steps" in exact_twin:
        exact_twin["steps"] = int(round(float(np.median([d["exact_twin"]["steps"] for d in draws]))))
    exact_match = {k: (None if any(d["exact_match"][k] is None for d in draws)
                       else all(d["exact_match"][k] for d in draws)) for k in first["exact_match"]}
    return {"real": first["real"], "twin": twin, "exact_real": first["exact_real"], "exact_twin": exact_twin,
            "exact_match": exact_match}


def _replay_both(rec: RecordedRun, profile: str, overhead_s: float, overhead_in_log_s: float, *,
                 noise: bool | None = None, noise_seed: int = 0, draws: int = 1,
                 host_speed: float = 1.0) -> _RunReplays:
    server = server_front_end(rec, profile)
    if server is None:
        acct: dict[str, float] = {"overhead_s": overhead_s, "overhead_in_log_s": overhead_in_log_s}
    else:  # the server front end's per-step base is the model's overhead, so the log already leaves it out
        fe = server.step_time.overhead_s
        acct = {"overhead_s": fe, "overhead_in_log_s": fe}
    each = []
    for k in range(draws):
        res_p = replay(rec, profile=profile, step_times="profile", noise=noise, noise_seed=noise_seed + k,
                       host_speed=host_speed)
        if not res_p.ok:
            raise RuntimeError(f"{rec.path}: the profile replay failed: {res_p.manifest['exception']}")
        each.append(_values(rec, res_p, compare(rec, res_p, server=server), **acct))
    prof = each[0] if draws == 1 else _over_draws(each)
    recd: dict[str, Any] = {}
    if rec.iterations is not None and len(rec.iterations) > 0:
        if server is None:
            res_r, _ = replay_recorded(rec, overhead_s=overhead_s)
            recd = _values(rec, res_r, compare(rec, res_r), overhead_s=overhead_s, overhead_in_log_s=overhead_s)
            recd["timing"] = recorded_step_timing(res_r)  # by index: an offline run's steps are the recording's
        else:  # recorded step times + the fitted front end (arrival, per-step and per-chunk time)
            res_r = replay(rec, profile=profile, step_times="recorded")
            if not res_r.ok:
                raise RuntimeError(f"{rec.path}: the recorded-step replay failed: {res_r.manifest['exception']}")
            recd = _values(rec, res_r, compare(rec, res_r, server=server), **acct)
            recd["timing"] = recorded_step_timing(res_r)
    return _RunReplays(rec=rec, prof=prof, recd=recd, draws=[d["twin"] for d in each] if draws > 1 else None)


def _tolerance_item(real: float | None, twin: float | None, reals: Sequence[float | None],
                    twin_recorded: float | None, tolerance: float) -> dict[str, Any]:
    """One item judged within max(``tolerance``, the run-to-run spread of ``reals``, the item's real values over the
    repeats of its workload, itself included), with the stricter rule beside it."""
    err = _rel(twin, real)
    sp = spread(reals) if len(reals) > 1 else None
    tol = max(tolerance, sp) if sp is not None else tolerance
    md = mean_deviation(reals) if len(reals) > 1 else None
    tol_strict = max(tolerance, md) if md is not None else tolerance
    mean_real = float(np.mean(_finite(reals))) if md is not None else None
    err_mean = _rel(mean_real, real)
    err_r = _rel(twin_recorded, real)
    return {
        "kind": "tolerance", "real": real, "twin": twin, "rel_error": err, "tolerance": tol, "spread": sp,
        "pass": None if err is None else bool(abs(err) <= tol),
        "twin_recorded_steps": twin_recorded, "rel_error_recorded_steps": err_r,
        "pass_recorded_steps": None if err_r is None else bool(abs(err_r) <= tol),
        "mean_deviation": md, "tolerance_strict": tol_strict,
        "pass_strict": None if err is None else bool(abs(err) <= tol_strict),
        "mean_of_repeats_pass_strict": None if err_mean is None else bool(abs(err_mean) <= tol_strict),
    }


def _server_timed_item(name: str, rp: _RunReplays, repeats: Sequence[_RunReplays], tolerance: float) -> dict[str, Any]:
    """A server run's step count or composition. On a server the engine batches what has arrived when a step
    starts, so both follow the arrival and step timing (the repeats of one workload differ in them too): the step
    count is judged like a latency item (tolerance and spread), the composition is reported and not judged."""
    if name == "steps":
        reals = [float(r.prof["exact_real"]["steps"]) for r in repeats if "steps" in r.prof["exact_real"]]
        item = _tolerance_item(float(rp.prof["exact_real"]["steps"]), float(rp.prof["exact_twin"]["steps"]), reals,
                               _as_float(rp.recd.get("exact_twin", {}).get("steps")), tolerance)
        item["real"], item["twin"] = rp.prof["exact_real"]["steps"], rp.prof["exact_twin"]["steps"]
        item["twin_recorded_steps"] = rp.recd.get("exact_twin", {}).get("steps")
        return item
    return {"kind": "reported", "real": rp.prof["exact_real"][name], "twin": rp.prof["exact_twin"][name],
            "rel_error": None, "tolerance": None, "spread": None, "pass": None,
            "identical": rp.prof["exact_match"][name],
            "twin_recorded_steps": rp.recd.get("exact_twin", {}).get(name), "pass_recorded_steps": None,
            "identical_recorded_steps": rp.recd.get("exact_match", {}).get(name)}


def _as_float(x: Any) -> float | None:
    return None if x is None else float(x)


def fidelity(run_dirs: Sequence[str | Path], *, profile: str, tolerance: float = DEFAULT_TOLERANCE,
             noise: bool | None = None, noise_seed: int = 0, draws: int = 1, host_witness: bool = False
             ) -> dict[str, Any]:
    """The fidelity report (a JSON-ready dict) of ``profile`` on the recorded runs ``run_dirs``. ``noise``: the
    profile replays draw each step's time from the profile's fitted ``step_time_noise`` (``replay``); None (the
    default) where the profile has that table; ``noise_seed`` as ``replay``'s. ``draws``: replay each run with
    that many noise draws (seeds ``noise_seed`` onwards) and judge the median over them (``_over_draws``); each
    tolerance item then also carries the draws' values and their spread (``twin_draws``, ``twin_spread``).
    Each run carries its steps against the profile's model (``step_level``, ``run_step_level``), and the report the
    latency items counted by how far their run's decode steps sat from it (``latency_by_step_level``).
    ``host_witness``: scale each profile replay's model-execution time by the level the profile's ``host_witness``
    term predicts from the run's own host witness (``twin.calibration.witness``; ``host_factor`` per run, None and
    unscaled for a run without a witness); a ValueError when the profile has no such term."""
    from twin.calibration.residuals import run_step_level
    from twin.calibration.witness import host_factor
    from twin.engine_profiles import load_profile

    if draws < 1:
        raise ValueError("draws must be at least 1")
    prof = load_profile(profile)
    noisy = noise if noise is not None else prof.spec.step_time_noise is not None
    if draws > 1 and not noisy:
        raise ValueError(f"{draws} draws need step-time noise: the profile replay is deterministic without it "
                         f"({'--no-noise' if noise is False else 'the profile has no step_time_noise'})")
    model = prof.step_time_model()
    overhead_s = prof.spec.step_time.overhead_s if prof.spec.step_time is not None else 0.0
    overhead_in_log_s = float(getattr(model, "overhead_s", 0.0) or 0.0)
    term = prof.spec.host_witness
    if host_witness and term is None:
        raise ValueError(f"profile {profile!r} has no host_witness term: refit it with twin calibrate from runs "
                         f"recorded with the host witness (twin record, since 2026-12-08)")
    recs = [load_recorded_run(p) for p in run_dirs]
    factors = [host_factor(r, term) if host_witness else None for r in recs]
    replays = [_replay_both(r, profile, overhead_s, overhead_in_log_s, noise=noise, noise_seed=noise_seed, draws=draws,
                            host_speed=f if f is not None else 1.0)
               for r, f in zip(recs, factors, strict=True)]
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(recs):
        groups.setdefault(workload_key(r), []).append(i)
    runs = []
    for i, rp in enumerate(replays):
        rec = rp.rec
        key = workload_key(rec)
        members = groups[key]
        server_mode = rec.run.mode == "server"
        items: dict[str, Any] = {}
        for name in EXACT_ITEMS:
            if name not in rp.prof["exact_match"]:
                continue
            if server_mode and name in SERVER_TIMED_ITEMS:
                items[name] = _server_timed_item(name, rp, [replays[j] for j in members], tolerance)
                continue
            match = rp.prof["exact_match"][name]
            items[name] = {
                "kind": "exact", "real": rp.prof["exact_real"][name], "twin": rp.prof["exact_twin"][name],
                "rel_error": None, "tolerance": "exact", "spread": None,
                "pass": match,  # None when the real value was not recorded
                "twin_recorded_steps": rp.recd.get("exact_twin", {}).get(name),
                "pass_recorded_steps": rp.recd.get("exact_match", {}).get(name),
            }
        for name in TOLERANCE_ITEMS:
            reals = [replays[j].prof["real"][name] for j in members]
            items[name] = _tolerance_item(rp.prof["real"][name], rp.prof["twin"][name], reals,
                                          rp.recd.get("twin", {}).get(name), tolerance)
            if rp.draws is not None:
                values = [d[name] for d in rp.draws]
                items[name]["twin_draws"] = values
                items[name]["twin_spread"] = spread(values)
        entry = {"run": str(rec.path), "name": rec.path.name, "mode": rec.run.mode, "requests": len(rec.requests),
                 "async_scheduling": rec.run.async_scheduling, "workload_key": key, "repeats": len(members),
                 "items": items}
        if rec.run.mode == "server" and prof.spec.server is not None:
            entry["cold_start"] = _cold_start(rec, prof.spec.server)
        if "timing" in rp.recd:
            entry["recorded_step_times"] = rp.recd["timing"]
        entry["step_level"] = run_step_level(rec, prof)
        if host_witness:
            entry["host_factor"] = None if factors[i] is None else round(factors[i], 6)
        runs.append(entry)
    verdicts = [it["pass"] for r in runs for it in r["items"].values() if it["pass"] is not None]
    tol_items = [it for r in runs for it in r["items"].values()
                 if it["kind"] == "tolerance" and it["pass"] is not None]
    repeated = [it for it in tol_items if it["mean_of_repeats_pass_strict"] is not None]
    recorded = [it["pass_recorded_steps"] for it in tol_items if it.get("pass_recorded_steps") is not None]
    sv = prof.spec.server
    return {
        "profile": profile, "profile_name": prof.name, "default_tolerance": tolerance,
        "latency_items": latency_counts([r["items"][k] for r in runs for k in LATENCY_ITEMS], tolerance),
        "latency_by_step_level": by_step_level([(decode_level(r), r["items"][k]["pass"]) for r in runs
                                                for k in LATENCY_ITEMS if r["items"][k]["pass"] is not None]),
        "overhead_s": overhead_s, "runs": runs,
        "step_time_noise": noisy,
        **({"noise_draws": draws} if draws > 1 else {}),
        **({"host_witness": term.model_dump()} if host_witness and term is not None else {}),
        "server_front_end": None if sv is None else {
            "arrival_s": sv.arrival_s, "per_step_s": sv.step_time.overhead_s, "per_chunk_s": sv.per_chunk_s,
            **({"per_first_chunk_s": sv.per_first_chunk_s, "per_last_chunk_s": sv.per_last_chunk_s}
               if sv.has_stream_ends else {}),
            **({"per_request_in_s": sv.per_request_in_s} if sv.per_request_in_s else {}),
            **({"per_request_in_step_s": sv.per_request_in_step_s} if sv.per_request_in_step_s else {})},
        "summary": {"items": len(verdicts), "passed": sum(1 for v in verdicts if v),
                    "failed": sum(1 for v in verdicts if not v),
                    "strict": {"tolerance_items": len(tol_items),
                               "passed": sum(1 for it in tol_items if it["pass_strict"]),
                               "repeated_items": len(repeated),
                               "mean_of_repeats_passed": sum(1 for it in repeated
                                                             if it["mean_of_repeats_pass_strict"])},
                    "recorded_steps": {"tolerance_items": len(recorded), "passed": sum(1 for v in recorded if v)}},
    }


# how far a run's decode steps sat from the profile's model (|median recorded / model - 1|, ``step_level``), in bands:
# near it a failure is the model's error, well off it the host ran at another speed than the sweep
# (docs/calibration.md, "Where the error is")
STEP_LEVEL_BANDS: tuple[tuple[str, float, float], ...] = (
    ("under 5 %", 0.0, 0.05), ("5-10 %", 0.05, 0.10), ("10 % or more", 0.10, float("inf")))


def decode_level(run: dict[str, Any]) -> float | None:
    """A fidelity report run's decode steps, median recorded / the profile's model (None where it has none)."""
    decode = (run.get("step_level") or {}).get("decode")
    return None if decode is None else float(decode["median_ratio"])


def step_level_band(level: float | None) -> str:
    """The ``STEP_LEVEL_BANDS`` label of a run's decode level (``not known`` for a run without one)."""
    if level is None:
        return "not known"
    return next(label for label, lo, hi in STEP_LEVEL_BANDS if lo <= abs(level - 1) < hi)


def by_step_level(judged: Sequence[tuple[float | None, bool]]) -> list[dict[str, Any]]:
    """Latency verdicts ``(the run's decode level, pass)`` counted per band (``step_level_band``), in the order of
    ``STEP_LEVEL_BANDS`` and ``not known`` last; a band without items is left out."""
    counts: dict[str, list[int]] = {}
    for level, ok in judged:
        c = counts.setdefault(step_level_band(level), [0, 0])
        c[0] += 1
        c[1] += not ok
    order = [label for label, _, _ in STEP_LEVEL_BANDS] + ["not known"]
    return [{"band": b, "items": counts[b][0], "failed": counts[b][1]} for b in order if b in counts]


def format_by_step_level(bands: Sequence[dict[str, Any]]) -> str | None:
    """One line: the failing latency items per band of the runs' step level (None without a known level)."""
    if not any(b["band"] != "not known" for b in bands):
        return None
    cells = "; ".join(f"{b['band']}{'' if b['band'] == 'not known' else ' off'}: {b['failed']} of {b['items']}"
                      for b in bands)
    return ("failing latency items by how far the run's decode steps sat from the model (near it, the model's "
            f"error; well off it, the host's speed): {cells}.")


def latency_counts(items: Sequence[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """The latency items with a verdict: how many, how many pass, how many are within ``tolerance`` of the real run
    outright (not widened by the repeats' spread), and their median |relative error| (None without items)."""
    judged = [it for it in items if it["pass"] is not None]
    errs = sorted(abs(it["rel_error"]) for it in judged)
    return {"items": len(judged), "passed": sum(1 for it in judged if it["pass"]),
            "within_tolerance_outright": sum(1 for e in errs if e <= tolerance),
            "median_abs_error": float(np.median(errs)) if errs else None}


def _cold_start(rec: RecordedRun, server: ServerFrontEnd) -> dict[str, Any] | None:
    """How much later a server run's first token came than the server section puts it, and the requests sent before
    it (``twin.calibration.ttft.cold_start``): a freshly started server's first requests are slow, and where more
    requests come in meanwhile the first few land in the TTFT tail (docs/calibration-sessions.md, "The server TTFT
    tail on the prefix mix"). None when the run's steps cannot be reconstructed (preemptions)."""
    from twin.calibration.server import ReconstructionError
    from twin.calibration.ttft import cold_start

    try:
        excess_s, sent = cold_start(rec, server)
    except ReconstructionError:
        return None
    return {"first_token_excess_s": excess_s, "sent_before_first_token": sent}


def _fmt(value: Any, scale: float) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not np.isfinite(value):
            return "n/a"
        v = value * scale
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}"
    return str(value)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _verdict(p: bool | None) -> str:
    return "n/a" if p is None else ("pass" if p else "FAIL")


def format_table(report: dict[str, Any]) -> str:
    """The report as text: one block per run, one line per item."""
    lines = [f"fidelity of profile {report['profile_name']} ({report['profile']}); per-step overhead "
             f"{report['overhead_s'] * 1e3:.3f} ms; default tolerance {report['default_tolerance']:.0%}"]
    fe = report.get("server_front_end")
    lines.append("server runs: " + ("no server section: offline step time, no front end" if fe is None else
                 f"server step time + front end (arrival {fe['arrival_s'] * 1e3:.1f} ms, {fe['per_step_s'] * 1e3:.3f} ms "
                 f"per step + {fe['per_chunk_s'] * 1e3:.3f} ms per streamed chunk"
                 + (f" + {fe['per_first_chunk_s'] * 1e3:.3f} ms per stream opened + "
                    f"{fe['per_last_chunk_s'] * 1e3:.3f} ms per stream closed" if "per_first_chunk_s" in fe else "")
                 + (f" + {fe['per_request_in_s'] * 1e3:.3f} ms per request sent while a step runs"
                    if "per_request_in_s" in fe else "")
                 + ")"
                 + (f"; the engine's step {fe['per_request_in_step_s'] * 1e3:.3f} ms longer per request sent while "
                    "it runs (profile replays)" if "per_request_in_step_s" in fe else "")))
    k = report.get("noise_draws", 1)
    if k > 1:
        lines.append(f"profile replays: {k} noise draws a run; twin = their median, twin sp. = their spread "
                     f"(max / min - 1)")
    hw = report.get("host_witness")
    if hw is not None:
        lines.append(f"profile replays scaled by each run's host witness (--host-witness): level = (witness / "
                     f"{hw['reference_ms']:.3f} ms) ^ {hw['exponent']:.2f}, fitted on {hw['runs']} calibration runs "
                     f"(correlation {hw['correlation']:.2f}); runs without a witness are not scaled")
    head = (f"  {'item':<16}{'real':>11}{'twin':>11}{'error':>9}{'tol':>7}{'spread':>8}  {'verdict':<8}"
            f"{'twin*':>11}{'error*':>9}" + (f"{'twin sp.':>10}" if k > 1 else ""))
    for r in report["runs"]:
        rep = f", {r['repeats']} repeats" if r["repeats"] > 1 else ""
        lines += ["", f"{r['name']} ({run_label(r)}{rep})", head]
        for name, it in r["items"].items():
            if it["kind"] == "reported":  # a server run's composition: follows arrival timing, not judged
                twin = "identical" if it["identical"] else "differs"
                twin_r = "identical" if it["identical_recorded_steps"] else "differs"
                lines.append(f"  {'composition':<16}{'':>11}{twin:>11}{'':>9}{'-':>7}{'':>8}  "
                             f"{'timing':<8}{twin_r:>11}")
                continue
            if it["kind"] == "exact":
                if name == "composition":
                    twin = "identical" if it["pass"] else "differs"
                    twin_r = "identical" if it["pass_recorded_steps"] else "differs"
                    lines.append(f"  {'composition':<16}{'':>11}{twin:>11}{'':>9}{'exact':>7}{'':>8}  "
                                 f"{_verdict(it['pass']):<8}{twin_r:>11}")
                    if not it["pass"]:
                        lines.append(f"      profile replay: {it['twin']}")
                    continue
                lines.append(f"  {EXACT_ITEMS[name]:<16}{_fmt(it['real'], 1):>11}{_fmt(it['twin'], 1):>11}{'':>9}"
                             f"{'exact':>7}{'':>8}  {_verdict(it['pass']):<8}{_fmt(it['twin_recorded_steps'], 1):>11}")
                continue
            label, scale, unit = TOLERANCE_ITEMS.get(name) or (EXACT_ITEMS[name], 1.0, "")
            lab = f"{label} ({unit})" if unit else label
            sp = "-" if it["spread"] is None else f"{it['spread']:.0%}"
            lines.append(f"  {lab:<16}{_fmt(it['real'], scale):>11}{_fmt(it['twin'], scale):>11}{_pct(it['rel_error']):>9}"
                         f"{it['tolerance']:>7.0%}{sp:>8}  {_verdict(it['pass']):<8}"
                         f"{_fmt(it['twin_recorded_steps'], scale):>11}{_pct(it['rel_error_recorded_steps']):>9}"
                         + (f"{'-' if it.get('twin_spread') is None else format(it['twin_spread'], '.0%'):>10}"
                            if k > 1 else ""))
        cold = r.get("cold_start")
        if cold is not None and cold["first_token_excess_s"] is not None:
            lines.append(f"  cold start: the first token came {cold['first_token_excess_s'] * 1e3:+.1f} ms after the "
                         f"server model puts it; {cold['sent_before_first_token']} more requests were sent before it")
        timing_line = format_step_timing(r.get("recorded_step_times") or {})
        if timing_line is not None:
            lines.append("  " + timing_line)
        level = r.get("step_level")
        if level is not None:
            cells = [f"{regime} {level[regime]['median_ratio']:.2f} ({level[regime]['steps']} steps)"
                     for regime in ("decode", "prefill") if level.get(regime) is not None]
            if cells:
                witness = level.get("host_witness_ms")
                factor = r.get("host_factor")
                lines.append("  recorded steps / the profile's model, median: " + ", ".join(cells)
                             + ("" if witness is None else f"; host witness {witness:.2f} ms")
                             + ("" if factor is None else f", the profile replay scaled x{factor:.3f} for it"))
    s = report["summary"]
    lines += ["", "twin = replay with the profile's step times (verdict); twin* = replay with the recorded step "
                  "times + the profile's overhead (server runs: + the server front end, each step timed from the "
                  "recorded steps that did the same work, since a server's steps do not line up with the recording's "
                  "one for one). "
                  "A server run's steps and composition follow arrival and step timing: its step count is judged "
                  "with a tolerance, its composition is reported (verdict `timing`) and not judged.",
              f"{s['passed']} of {s['items']} items pass, {s['failed']} fail."]
    lat = report.get("latency_items")
    if lat is not None and lat["items"]:
        lines.append(f"latency items (TTFT, ITL and E2E p50/p90): {lat['passed']} of {lat['items']} pass; "
                     f"{lat['within_tolerance_outright']} within {report['default_tolerance']:.0%} of the real run "
                     f"outright, median |error| {lat['median_abs_error']:.1%}.")
        line = format_by_step_level(report.get("latency_by_step_level") or [])
        if line is not None:
            lines.append(line)
    rs = s.get("recorded_steps")
    if rs is not None and rs["tolerance_items"]:
        lines.append(f"twin* (scheduling and latency accounting alone): {rs['passed']} of {rs['tolerance_items']} "
                     f"timing items pass.")
    st = s.get("strict")
    if st is not None and st["repeated_items"]:
        lines.append(f"stricter rule (tolerance widened only by the repeats' largest deviation from their mean): "
                     f"{st['passed']} of {st['tolerance_items']} timing items pass; the repeats' own mean would pass "
                     f"{st['mean_of_repeats_passed']} of the {st['repeated_items']} repeated ones.")
    return "\n".join(lines)
