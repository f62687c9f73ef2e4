"""The CI policy gate: the comparison rule on hand-made numbers, the committed suite and baselines agree,
and a deliberately broken policy (prefix_affinity ignoring load, monkeypatched under its own key) fails
the gate naming the regressed metric, while the intact policy passes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from twin.check import CheckSuite, compare_metric, config_sha
from twin.cli import main
from twin.policies import ROUTERS
from twin.results_db import METRICS
from twin.policies.routing import PrefixAffinityRouter
from twin.sweep import expand, load_spec

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("duckdb")


def test_rule_regresses_only_beyond_k_standard_errors_or_the_floor():
    base = {"mean": 1.0, "std": 0.1, "n": 4}
    se = math.sqrt(0.1**2 / 4 * 2)
    same = {"mean": 1.0, "std": 0.1, "n": 4}
    assert compare_metric(base, same, higher_better=False, k=3, floor=0.0)[0] == "ok"
    just_in = {"mean": 1.0 + 3 * se * 0.99, "std": 0.1, "n": 4}
    just_out = {"mean": 1.0 + 3 * se * 1.01, "std": 0.1, "n": 4}
    assert compare_metric(base, just_in, higher_better=False, k=3, floor=0.0)[0] == "ok"
    status, worse, tol = compare_metric(base, just_out, higher_better=False, k=3, floor=0.0)
    assert status == "regressed" and tol == pytest.approx(3 * se) and worse > tol
    # the same shift is an improvement when higher is better
    assert compare_metric(base, just_out, higher_better=True, k=3, floor=0.0)[0] == "improved"
    # zero spread (deterministic metric): the floor decides
    flat = {"mean": 0.5, "std": 0.0, "n": 3}
    assert compare_metric(flat, {"mean": 0.509, "std": 0.0, "n": 3}, higher_better=False, k=4, floor=0.01)[0] == "ok"
    assert compare_metric(flat, {"mean": 0.52, "std": 0.0, "n": 3}, higher_better=False, k=4,
                          floor=0.01)[0] == "regressed"
    # the same seeds on both sides: the paired standard error (a consistent shift is detected even when
    # the seed-to-seed spread is wide)
    b = {"mean": 0.3, "std": 0.15, "n": 3, "seeds": [1, 2, 3], "values": [0.15, 0.3, 0.45]}
    c = {"mean": 0.4, "std": 0.15, "n": 3, "seeds": [1, 2, 3], "values": [0.24, 0.41, 0.55]}
    status, worse, tol = compare_metric(b, c, higher_better=False, k=4, floor=0.0)
    assert status == "regressed" and worse == pytest.approx(0.1)
    assert tol == pytest.approx(4 * 0.01 / math.sqrt(3))
    c_other = dict(c, seeds=[4, 5, 6])  # other seeds: Welch, and the shift is within the noise
    assert compare_metric(b, c_other, higher_better=False, k=4, floor=0.0)[0] == "ok"
    # defined <-> undefined is a regression
    assert compare_metric(flat, {"mean": None, "std": None, "n": 3}, higher_better=True, k=4, floor=0)[0] == "regressed"


def test_committed_baselines_cover_the_suite():
    """Every scenario x router of experiments/check_suite.yaml has a baseline over the suite's seeds
    (a new router or scenario: rerun ``twin check --update``). Whether a baseline's effective config
    still matches is reported by ``twin check`` itself (a note), not asserted here: a new schema field
    with a default changes the config without changing the runs."""
    suite = load_spec(REPO / "experiments" / "check_suite.yaml", CheckSuite)
    tasks = expand(suite.sweep_spec(), base=REPO / "experiments")
    assert {t.policy for t in tasks} == set(ROUTERS.keys())
    folder = REPO / "experiments" / "baselines"
    for t in tasks:
        doc = json.loads((folder / f"{t.config['name']}__{t.policy}.json").read_text())
        assert sorted(doc["seeds"]) == sorted(suite.sweep_spec().seed_list())
        assert set(doc["metrics"]) == set(METRICS)
        assert all(m["n"] == len(doc["seeds"]) == len(m["values"]) for m in doc["metrics"].values())
        assert len(config_sha(t.config)) == len(doc["config_sha"]) == 16


class LoadBlindPrefixAffinity(PrefixAffinityRouter):
    """prefix_affinity broken on purpose: the bounded-load cap never binds, so every request with the
    same prompt start goes to one replica however busy it is."""

    def capacity(self, candidates):
        return 1 << 30


def test_gate_fails_on_a_load_blind_prefix_affinity_and_passes_intact(tmp_path, monkeypatch, capsys):
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "tiny-check", "routers": ["prefix_affinity"], "seeds": [1, 2, 3],
        # one region of 4 replicas and two tenants: a load-blind key (the tenant's system prompt) piles
        # each tenant onto one replica
        "scenarios": [{"path": "scenarios/baseline-day.yaml",
                       "overrides": ["fleet.scale=0.002", "fleet.traffic.duration_s=10",
                                     "fleet.traffic.daily_users=20000000",
                                     "fleet.topology.regions=[{name: us-east, pools: [{model: large, nodes: 1000}]}]",
                                     "fleet.traffic.tenants=[{name: consumer-free, share: 0.7, tier: free}, "
                                     "{name: consumer-plus, share: 0.3, tier: paid}]"]}],
        "tolerance": {"k": 4.0, "floor": {"ttft_p99_s": 0.01, "load_spread_cv": 0.02, "goodput_rps": 0.02}}}))
    bl = tmp_path / "baselines"
    common = ["check", "--suite", str(suite), "--baselines", str(bl), "--workers", "0", "--quiet"]
    assert main([*common, "--update"]) == 0
    assert (bl / "baseline-day__prefix_affinity.json").exists()
    capsys.readouterr()

    md = tmp_path / "ok.md"
    assert main([*common, "--out", str(md)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "check: 6 passed, 0 failed"
    assert "twin check: passed" in md.read_text()

    monkeypatch.setitem(ROUTERS._items, "prefix_affinity", LoadBlindPrefixAffinity)
    md = tmp_path / "bad.md"
    assert main([*common, "--out", str(md)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "REGRESSED" in out
    n_bad = int(out.strip().splitlines()[-1].split(", ")[1].split()[0])
    assert n_bad >= 1 and out.strip().endswith(f"check: {6 - n_bad} passed, {n_bad} failed")
    text = md.read_text()
    assert "FAILED" in text
    regressed = [line for line in text.split("### Regressed")[1].split("###")[0].splitlines()
                 if line.startswith("| baseline-day")]
    assert regressed and all("prefix_affinity" in line for line in regressed)
    assert any("| load_spread_cv |" in line for line in regressed)
    assert "load_spread_cv" in out
