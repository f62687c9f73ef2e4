"""The dashboard's tables, figures and what-if overrides, without Streamlit (docs/dashboard.md)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("plotly")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the dashboard package lives at the repo root

from dashboard import figures, runs, tables  # noqa: E402
from twin.capacity import PRESETS, compute_capacity  # noqa: E402
from twin.scenario import ScenarioError, load_scenario  # noqa: E402

SEED_10M = PRESETS["seed-10m"]


def _requests(rows: list[tuple[float, float, str, float, float]]) -> pa.Table:
    """(arrival_s, finish_s, outcome, ttft_s, tpot_s) rows as a requests table."""
    a, f, o, t, p = zip(*rows)
    return pa.table({"arrival_s": list(a), "finish_s": list(f), "outcome": list(o), "ttft_s": list(t),
                     "tpot_s": list(p)})


def _no_data(fig) -> bool:
    return len(fig.data) == 0 and len(fig.layout.annotations) == 1


# ------------------------------------------------------------------------------------------ capacity

def test_planner_inputs_take_memory_facts_from_the_profile():
    base = tables.planner_inputs(SEED_10M, daily_users=20_000_000)
    assert base.daily_users == 20_000_000 and base.tp == 4 and base.gpu_memory_bytes == 80 * 10**9
    with_profile = tables.planner_inputs(SEED_10M, profile="llama3-8b-fp8-tp1-h100")
    assert with_profile.profile == "llama3-8b-fp8-tp1-h100"
    assert all(getattr(with_profile, f) is None for f in tables.PROFILE_FIELDS)
    result = compute_capacity(with_profile)  # the profile fills them: no conflict with the preset's numbers
    assert result.gpus == result.replicas  # TP1


def test_fleet_size_table_and_figure_follow_the_capacity_result():
    result = compute_capacity(SEED_10M)
    df = tables.fleet_size_table(result)
    assert list(df["step"]) == ["at saturation", "at planning utilisation", "by concurrency (cross-check)",
                                "with prefill time", "with failover reserve"]
    assert df.set_index("step")["replicas"]["with failover reserve"] == result.replicas_with_reserve == 536
    fig = figures.fig_fleet_size(df)
    assert list(fig.data[0].x) == list(df["replicas"]) and list(fig.data[0].y) == list(df["step"])
    # the 1M note states no latency cap or step model beyond a measured capacity: rows it cannot give are dropped
    one_m = tables.fleet_size_table(compute_capacity(PRESETS["seed-1m"]))
    assert "with prefill time" not in set(one_m["step"]) and one_m["replicas"].iloc[0] == 463


def test_streams_table_marks_the_binding_limit():
    df = tables.streams_table(compute_capacity(SEED_10M))
    assert dict(zip(df["limit"], df["streams"])) == {"by KV memory": 803, "by latency target": 170}
    assert dict(zip(df["limit"], df["binding"])) == {"by KV memory": False, "by latency target": True}
    fig = figures.fig_streams_per_replica(df)
    assert list(fig.data[0].marker.color) == ["#1f77b4", "#d62728"]
    assert "binds: by latency target" in fig.layout.title.text
    memory_bound = tables.streams_table(compute_capacity(tables.planner_inputs(
        SEED_10M, max_streams_per_replica_at_target=1000)))
    assert dict(zip(memory_bound["limit"], memory_bound["binding"]))["by KV memory"]


def test_prefix_hit_table_reruns_the_model_per_hit_rate():
    curve = tables.prefix_hit_table(SEED_10M)
    assert curve["hit"].iloc[0] == 0.0 and curve["hit"].iloc[-1] == pytest.approx(0.95)
    assert (np.diff(curve["replicas_with_prefill"]) <= 0).all() and curve["replicas_with_prefill"].iloc[0] > \
        curve["replicas_with_prefill"].iloc[-1]
    assert set(curve["replicas_decode_only"]) == {compute_capacity(SEED_10M).replicas}  # ignores the hit rate
    at70 = curve.set_index("hit").loc[0.7]
    assert at70["replicas_with_prefill"] == compute_capacity(SEED_10M).replicas_with_prefill
    fig = figures.fig_prefix_hit(curve, current_hit=0.7)
    assert [t.name for t in fig.data] == ["replicas incl. prefill time", "decode only (the notes' sizing)"]
    assert fig.layout.shapes[0].x0 == 0.7
    # no prefill capacity stated (the 1M note): only the flat decode line
    one_m = figures.fig_prefix_hit(tables.prefix_hit_table(PRESETS["seed-1m"], hits=[0.0, 0.5]))
    assert [t.name for t in one_m.data] == ["decode only (the notes' sizing)"]


# ------------------------------------------------------------------------------------- run summaries

def test_summary_comparison_and_change_figure():
    base = {"ttft_s": {"p99": 0.5}, "goodput_rps": 10.0, "requests": {"arrived": 100, "failed": 0},
            "fleet": {"usd_per_m_output_tokens": 4.0}}
    run = {"ttft_s": {"p99": 1.0}, "goodput_rps": 12.0, "requests": {"arrived": 100, "failed": 3},
           "fleet": {"usd_per_m_output_tokens": float("nan")}}
    df = tables.summary_comparison(run, base).set_index("metric")
    assert df.loc["TTFT p99 (s)", "change"] == pytest.approx(1.0)
    assert df.loc["goodput (req/s)", "change"] == pytest.approx(0.2)
    assert df.loc["arrived", "change"] == pytest.approx(0.0)
    assert df.loc["failed", "change"] is None or math.isnan(df.loc["failed", "change"])  # baseline 0
    assert df.loc["$ per M output tokens", "what_if"] is None or math.isnan(df.loc["$ per M output tokens", "what_if"])
    fig = figures.fig_summary_change(tables.summary_comparison(run, base))
    colours = dict(zip(fig.data[0].y, fig.data[0].marker.color))
    assert colours == {"arrived": "#2ca02c", "TTFT p99 (s)": "#d62728", "goodput (req/s)": "#2ca02c"}
    assert _no_data(figures.fig_summary_change(tables.summary_comparison({}, {})))


def test_latency_vs_baseline_windows_both_runs_alike():
    run = _requests([(1.0, 2, "completed", 0.1, 0.01), (2.0, 3, "completed", 0.3, 0.01), (12.0, 13, "completed", 0.5, 0.01),
                     (13.0, 14, "rejected", float("nan"), float("nan"))])
    base = _requests([(1.0, 2, "completed", 0.1, 0.01), (11.0, 12, "completed", 0.2, 0.01)])
    fig = figures.fig_latency_vs_baseline(run, base, window_s=10.0)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"what-if p50", "what-if p99", "baseline p50", "baseline p99"}
    assert list(by_name["what-if p50"].x) == [5.0, 15.0]
    assert list(by_name["what-if p50"].y) == [0.1, 0.5]  # inverse-CDF p50 of (0.1, 0.3) is 0.1
    assert list(by_name["what-if p99"].y) == [0.3, 0.5]
    assert list(by_name["baseline p50"].y) == [0.1, 0.2] and by_name["baseline p50"].line.dash == "dash"
    assert _no_data(figures.fig_latency_vs_baseline(_requests([(1, 2, "failed", 0, 0)]), None))


# ---------------------------------------------------------------------------------------------- drills

REPORT = {
    "region": "us-east", "at_s": 20.0, "streams_dropped": 7, "turns_retried": 3, "turns_resumed": 2,
    "timeline": [
        {"t_s": 20.0, "kind": "fault.injected", "scope": "failures", "value": None, "reason": "region_loss"},
        {"t_s": 20.0, "kind": "region.lost", "scope": "fleet.us-east", "value": None, "reason": None},
        {"t_s": 20.0, "kind": "replica.crashed", "scope": "fleet.us-east.n0.r0", "value": 7.0, "reason": None,
         "count": 2},
        {"t_s": 30.0, "kind": "dns.failed_over", "scope": "fleet.us-east", "value": None, "reason": "to eu-west"},
        {"t_s": 50.0, "kind": "region.recovering", "scope": "fleet.us-east", "value": None, "reason": None},
        {"t_s": 60.0, "kind": "replica.recovered", "scope": "fleet.us-east.n0.r0", "value": None, "reason": None,
         "count": 2},
    ],
    "phases": [{"phase": "before", "from_s": 0.0, "to_s": 20.0, "turns": 4, "completed": 3,
                "not_completed": {"failed:region_lost": 1}, "ttft_s": {"p50": 0.1, "p99": 0.2},
                "tpot_s": {"p50": 0.01, "p99": 0.02}, "turns_homed_in_region": 2, "served_elsewhere": 0}],
}


def test_drill_tables():
    tl = tables.timeline_table(REPORT)
    assert list(tl["kind"]) == [it["kind"] for it in REPORT["timeline"]]
    assert tl.loc[tl["kind"] == "replica.crashed", "detail"].item() == "2 replicas, 7 live streams dropped"
    assert tl.loc[tl["kind"] == "dns.failed_over", "detail"].item() == "to eu-west"
    ph = tables.phases_table(REPORT)
    assert ph.loc[0, "not_completed"] == 1 and ph.loc[0, "ttft_p99_s"] == 0.2


def test_drill_timeline_marks_events_and_failed_share():
    req = _requests([(5.0, 6, "completed", 0.1, 0.01), (15.0, 16, "completed", 0.2, 0.01),
                     (21.0, 22, "failed", float("nan"), float("nan")), (25.0, 27, "completed", 2.0, 0.01),
                     (27.0, 28, "rejected", float("nan"), float("nan"))])
    fig = figures.fig_drill_timeline(req, tables.timeline_table(REPORT), window_s=10.0, slo_s=0.8)
    lines = {a.text: s.x0 for s, a in zip(fig.layout.shapes, fig.layout.annotations)}
    assert lines["region.lost"] == 20.0 and lines["dns.failed_over"] == 30.0
    assert lines["region.recovering"] == 50.0 and lines["replica.recovered"] == 60.0
    assert "replica.crashed" not in lines  # the crash lines are the region loss itself; not marked twice
    bars = next(t for t in fig.data if t.type == "bar")
    assert list(bars.x) == [5.0, 15.0, 25.0] and list(bars.y) == [0.0, 0.0, pytest.approx(2 / 3)]
    p99 = next(t for t in fig.data if t.name == "ttft_s p99")
    assert list(p99.y) == [0.1, 0.2, 2.0]
    assert fig.layout.shapes[-1].y0 == 0.8  # the SLO line
    assert _no_data(figures.fig_drill_timeline(None, tables.timeline_table({})))


# ---------------------------------------------------------------------------------------------- sweeps

def test_mean_ci95_matches_student_t():
    stats = pytest.importorskip("scipy.stats")
    for values in ([1.0, 2.0, 4.0], [0.3, 0.1, 0.4, 0.15, 0.9], list(np.linspace(0, 1, 40))):
        m, hw, n = tables.mean_ci95(values)
        sd = np.std(values, ddof=1)
        exact = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
        assert n == len(values) and m == pytest.approx(np.mean(values))
        assert hw == pytest.approx(exact, rel=2e-3)
    assert tables.mean_ci95([None, float("nan"), 2.0])[:1] == (2.0,) and math.isnan(tables.mean_ci95([2.0])[1])
    assert tables.mean_ci95([])[2] == 0


def test_ci_table_and_error_bar_figure():
    rows = [{"scenario": "s", "policy": p, "seed": i, "run_hash": f"h{i}", "ttft_p99_s": v, "goodput_rps": g}
            for i, (p, v, g) in enumerate([("rr", 1.0, 5.0), ("rr", 3.0, 5.0), ("lot", 0.5, 6.0)])]
    ci = tables.ci_table(rows)
    assert set(ci["metric"]) == {"ttft_p99_s", "goodput_rps"}  # labels are not metrics
    rr = ci[(ci["policy"] == "rr") & (ci["metric"] == "ttft_p99_s")].iloc[0]
    assert rr["mean"] == 2.0 and rr["n"] == 2 and rr["ci95"] == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2))
    fig = figures.fig_policy_ci(ci, "ttft_p99_s")
    bar = fig.data[0]
    assert list(bar.x) == ["lot", "rr"] and list(bar.y) == [0.5, 2.0]
    assert list(bar.error_y.array) == [0.0, pytest.approx(12.706)]  # n = 1: no interval, drawn as no bar
    assert _no_data(figures.fig_policy_ci(ci, "itl_p99_s"))
    assert tables.ci_table([]).empty


# ----------------------------------------------------------------------------------- what-if overrides

LAUNCH = runs.SCENARIO_DIR / "launch-day-10x.yaml"


def test_whatif_overrides_load_and_change_what_they_say():
    size = runs.size_overrides(scale=0.001, duration_s=10)
    sized = load_scenario(LAUNCH, overrides=size)
    assert sized.fleet.scale == 0.001 and sized.fleet.traffic.duration_s == 10
    assert runs.whatif_overrides(sized) == []
    ov = runs.whatif_overrides(sized, traffic_multiplier=2.0, router="round_robin", clear_surges=True,
                               surge={"start_s": 2.0, "ramp_s": 1.0, "hold_s": 5.0, "multiplier": 3.0},
                               keep_faults=False, region_loss={"region": "eu-west", "at_s": 4.0, "recover_at_s": None},
                               dns_failover_s=7.0)
    assert all("\n" not in o for o in ov)  # one line each, as `twin run --set` takes them
    sc = load_scenario(LAUNCH, overrides=size + ov)
    assert sc.fleet.traffic.daily_users == 2 * sized.fleet.traffic.daily_users
    assert sc.fleet.policy.router.kind == "round_robin"
    assert [(s.start_s, s.multiplier) for s in sc.fleet.traffic.surges] == [(2.0, 3.0)]
    assert [(f.kind, f.region, f.at_s, f.recover_at_s) for f in sc.fleet.faults] == [("region_loss", "eu-west", 4.0, None)]
    assert sc.fleet.failover.dns_failover_s == 7.0
    kept = load_scenario(LAUNCH, overrides=size + runs.whatif_overrides(
        sized, surge={"start_s": 1.0, "ramp_s": 0.0, "hold_s": 2.0, "multiplier": 2.0}))
    assert len(kept.fleet.traffic.surges) == len(sized.fleet.traffic.surges) + 1


def test_engine_knobs_reach_every_served_model_and_only_where_they_change():
    sized = load_scenario(LAUNCH, overrides=runs.size_overrides(scale=0.001, duration_s=10))
    models = sized.fleet.models
    assert len(models) >= 2
    assert runs.engine_overrides(sized, {}) == []
    same = {m.engine.max_num_seqs for m in models.values()}
    assert len(same) == 1
    assert runs.engine_overrides(sized, {"max_num_seqs": same.pop(), "async_scheduling": None}) == []
    ov = runs.whatif_overrides(sized, engine={"max_num_seqs": 96, "max_num_batched_tokens": 4096,
                                              "enable_prefix_caching": False, "async_scheduling": False})
    assert len(ov) == 4 * len(models) and all("\n" not in o for o in ov)
    sc = load_scenario(LAUNCH, overrides=runs.size_overrides(scale=0.001, duration_s=10) + ov)
    for m in sc.fleet.models.values():
        assert (m.engine.max_num_seqs, m.engine.max_num_batched_tokens) == (96, 4096)
        assert m.engine.enable_prefix_caching is False and m.engine.async_scheduling is False
    with pytest.raises(ScenarioError):
        runs.engine_overrides(sized, {"max_num_seq": 8})


def test_ladder_flags_force_rungs_or_remove_the_ladder():
    rungs = runs.ladder_rungs()
    if not rungs:
        pytest.skip("this twin's scenario schema has no fleet.ladder")
    sized = load_scenario(LAUNCH)
    assert sized.fleet.ladder is not None
    forced = load_scenario(LAUNCH, overrides=runs.whatif_overrides(sized, ladder={"shed": "off", "cap_output": "on",
                                                                                  "queue_eta": "auto"}))
    assert "\n" not in runs.ladder_override(sized, flags={"shed": "off"})[0]
    assert [(o.rung, o.at_s, o.state) for o in forced.fleet.ladder.policy.overrides][-2:] == [
        ("shed", 0.0, "off"), ("cap_output", 0.0, "on")]
    assert forced.fleet.ladder.small_model == sized.fleet.ladder.small_model
    off = load_scenario(LAUNCH, overrides=runs.whatif_overrides(sized, ladder_enabled=False))
    assert off.fleet.ladder is None
    baseline = runs.SCENARIO_DIR / "baseline-day.yaml"
    plain = load_scenario(baseline)
    if plain.fleet.ladder is None:
        added = load_scenario(baseline, overrides=runs.whatif_overrides(plain, ladder={"speculative_decoding": "on"}))
        assert added.fleet.ladder.policy.kind == "threshold_ladder"
        assert [(o.rung, o.state) for o in added.fleet.ladder.policy.overrides] == [("speculative_decoding", "on")]
    with pytest.raises(ScenarioError):
        runs.ladder_override(sized, flags={"no_such_rung": "on"})


def test_fleet_scenarios_lists_only_fleet_scenarios():
    found = runs.fleet_scenarios()
    assert {"launch-day-10x", "baseline-day", "region-loss-drill"} <= set(found)
    assert "single-replica-demo" not in found


def test_policy_sweep_writes_a_twin_sweep_folder_and_reads_it_back(tmp_path):
    pytest.importorskip("duckdb")
    seen = []
    folder = runs.policy_sweep(runs.SCENARIO_DIR / "baseline-day.yaml", routers=["round_robin", "least_outstanding_tokens"],
                               seeds=[1, 2], overrides=runs.size_overrides(scale=0.001, duration_s=5), out=tmp_path,
                               name="tiny", progress=lambda i, n, what: seen.append((i, n, what)))
    assert folder == tmp_path / "tiny" and len(list(folder.glob("runs/*/run.parquet"))) == 4
    assert [(i, n) for i, n, _ in seen] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert sorted(w for _, _, w in seen) == ["least_outstanding_tokens seed 1", "least_outstanding_tokens seed 2",
                                             "round_robin seed 1", "round_robin seed 2"]
    rows = runs.sweep_rows(folder)
    assert sorted((r["policy"], r["seed"]) for r in rows) == [("least_outstanding_tokens", 1), ("least_outstanding_tokens", 2),
                                                               ("round_robin", 1), ("round_robin", 2)]
    assert all(0.0 <= r["slo_attainment"] <= 1.0 and r["usd_per_m_output_tokens"] > 0 for r in rows)
    ci = tables.ci_table(rows, metrics=["ttft_p99_s", "goodput_rps", "slo_attainment"])
    assert set(ci["n"]) == {2} and len(ci) == 6 and all(math.isfinite(m) for m in ci["mean"])
    assert len(figures.fig_policy_ci(ci, "goodput_rps").data[0].x) == 2
    again = []
    runs.policy_sweep(runs.SCENARIO_DIR / "baseline-day.yaml", routers=["round_robin", "least_outstanding_tokens"],
                      seeds=[1, 2, 3], overrides=runs.size_overrides(scale=0.001, duration_s=5), out=tmp_path,
                      name="tiny", progress=lambda i, n, what: again.append((i, n, what)))
    assert sorted(w for _, _, w in again) == ["least_outstanding_tokens seed 3", "round_robin seed 3"]  # only new runs
    assert {n for _, n, _ in again} == {2} and len(runs.sweep_rows(folder)) == 6
