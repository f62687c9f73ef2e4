"""Replay of committed real-vLLM recordings: exact step composition offline, stated tolerances otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twin.calibration.recorded import load_recorded_run
from twin.cli import main
from twin.replay import compare, replay

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "recorded"
RUNS = sorted(p for p in FIXTURES.glob("*") if (p / "run.json").exists())
OFFLINE = [p for p in RUNS if json.loads((p / "run.json").read_text())["mode"] == "offline"]


def test_there_are_recorded_runs():
    assert OFFLINE, "no offline recordings committed under tests/fixtures/recorded"


@pytest.mark.parametrize("path", OFFLINE, ids=lambda p: p.name)
def test_offline_replay_reproduces_step_composition_exactly(path):
    rec = load_recorded_run(path)
    res = replay(rec, profile=None, step_times="recorded")
    assert res.ok, res.manifest.get("traceback")
    c = compare(rec, res)
    assert c["composition"]["match"], c["composition"]
    assert c["steps"]["match"]
    if c["preemptions"]["real"] is not None:
        assert c["preemptions"]["match"], c["preemptions"]
    if c["prefix_cache_hits"]["real"] is not None:
        assert c["prefix_cache_hits"]["match"], c["prefix_cache_hits"]
    n = c["num_cached_tokens"]
    assert n["match"] == n["compared"]


@pytest.mark.parametrize("path", OFFLINE, ids=lambda p: p.name)
def test_offline_latencies_with_recorded_step_times_within_15_percent(path):
    """With the real step durations substituted, only the time outside model execution is missing.

    Tolerance 15%: vLLM's iteration log excludes scheduling and output processing (a few ms per step on
    these CPUs), which the replay does not add without a fitted profile overhead.
    """
    rec = load_recorded_run(path)
    c = compare(rec, replay(rec, profile=None, step_times="recorded"))
    for key in ("ttft_s", "e2e_s"):
        for p in ("p50", "p90"):
            err = c["latency"][key][p]["rel_error"]
            assert err is not None and abs(err) < 0.15, (key, p, c["latency"][key][p])


def test_replay_command_writes_the_twin_iteration_log_and_comparison(tmp_path, capsys):
    run = OFFLINE[0]
    out = tmp_path / "rp"
    assert main(["replay", str(run), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert {"iterations.csv", "requests.parquet", "comparison.json", "manifest.json"} <= set(names)
    header = (out / "iterations.csv").read_text().splitlines()[0]
    assert header == (run / "iterations.csv").read_text().splitlines()[0]
    import pyarrow.parquet as pq

    cols = set(pq.read_table(out / "requests.parquet").column_names)
    assert {"request_id", "arrival_s", "ttft_s", "e2e_s", "output_tokens", "num_cached_tokens", "preemptions",
            "token_times_s"} <= cols
    comp = json.loads((out / "comparison.json").read_text())
    assert comp["composition"]["match"] is True
    assert "step composition" in capsys.readouterr().out


def test_replay_of_a_missing_folder_exits_2(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err


def test_a_server_replay_sends_each_request_at_its_own_time() -> None:
    """A recorded server run lists its requests by id, and a burst's concurrent sends can leave in another order
    (0010 was sent 0.37 ms before 0009 here). The replay sends each at its own time: the requests table's
    arrival (measured from the send) is the recorded send, not the time of a later request listed before it."""
    root = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-offlinewarm2"
    rec = load_recorded_run(root / "held-out-repeat2" / "heldout-server-bursty")
    sends = [r.arrival_s for r in rec.requests]
    assert sum(b < a for a, b in zip(sends, sends[1:])) >= 3  # listed out of send order
    result = replay(rec, profile=str(root / "cpu-tiny-llama.yaml"), noise=False)
    got = dict(zip(result.tables["requests"].column("request_id").to_pylist(),
                   result.tables["requests"].column("arrival_s").to_pylist(), strict=True))
    for r in rec.requests:
        assert got[r.request_id] == pytest.approx(r.arrival_s, abs=1e-9), r.request_id
