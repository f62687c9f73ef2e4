"""``twin fidelity --sessions``: several calibration sessions' held-out tables at once (``twin.calibration.sessions``).

The sessions here are committed ones, judged again with one noise draw; every count the report gives is checked
against ``fidelity`` run on the same session directly, so nothing in these tests is a remembered number.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from twin.calibration.fidelity import (LATENCY_ITEMS, decode_level, fidelity, format_by_step_level, format_table,
                                      latency_counts)
from twin.calibration.sessions import format_sessions, session_parts, sessions_report
from twin.cli import main

ROOT = Path(__file__).parent / "fixtures" / "calibration"
A, B = ROOT / "cpu-tiny-llama-interleaved2", ROOT / "cpu-tiny-llama-warmupsteps"


@pytest.fixture(scope="module")
def report() -> dict:
    return sessions_report([A, B, ROOT / "cpu-tiny-llama-diag-decode-context"], draws=1)


def test_each_session_is_its_own_fidelity_table(report) -> None:
    assert [Path(s["folder"]).name for s in report["sessions"]] == [A.name, B.name]
    for s, folder in zip(report["sessions"], (A, B)):
        own, runs, why = session_parts(folder)
        assert why is None and s["profile"] == str(own) and s["runs"] == len(runs) == 12
        direct = fidelity(runs, profile=str(own), draws=1)
        assert (s["items"], s["passed"]) == (direct["summary"]["items"], direct["summary"]["passed"])
        lat = [r["items"][k]["pass"] for r in direct["runs"] for k in LATENCY_ITEMS]
        assert (s["latency_items"], s["latency_passed"]) == (len(lat), sum(lat)) == (72, sum(lat))
        exact = [it["pass"] for r in direct["runs"] if r["mode"] == "offline" for it in r["items"].values()
                 if it["kind"] == "exact"]
        assert s["offline_exact_items"] == len(exact) == 16 and s["offline_exact_passed"] == sum(exact)
        failing = {}
        for r in direct["runs"]:
            for k in LATENCY_ITEMS:
                if not r["items"][k]["pass"]:
                    failing[r["name"]] = failing.get(r["name"], 0) + 1
        assert s["failing_latency"] == failing
        errs = [abs(r["items"][k]["rel_error"]) for r in direct["runs"] for k in LATENCY_ITEMS]
        assert s["latency_within_tolerance_outright"] == sum(e <= 0.10 for e in errs)
        assert s["latency_median_abs_error"] == pytest.approx(statistics.median(errs))
        # each latency item carries twin*'s error (the recorded step times) as fidelity gives it
        assert [x["rel_error_recorded_steps"] for x in s["latency"]] == [
            r["items"][k]["rel_error_recorded_steps"] for r in direct["runs"] for k in LATENCY_ITEMS]
        # and its run's decode level, counted by band as fidelity counts its own runs
        assert [x["decode_level"] for x in s["latency"]] == [
            decode_level(r) for r in direct["runs"] for k in LATENCY_ITEMS]
        assert s["latency_by_step_level"] == direct["latency_by_step_level"]
        assert sum(b["items"] for b in s["latency_by_step_level"]) == 72
    t = report["totals"]
    assert t["sessions"] == 2
    assert t["latency_passed"] == sum(s["latency_passed"] for s in report["sessions"])
    assert t["passed"] == sum(s["passed"] for s in report["sessions"])
    assert t["latency_within_tolerance_outright"] == sum(s["latency_within_tolerance_outright"]
                                                         for s in report["sessions"])
    for band in t["latency_by_step_level"]:
        mine = [b for s in report["sessions"] for b in s["latency_by_step_level"] if b["band"] == band["band"]]
        assert (band["items"], band["failed"]) == (sum(b["items"] for b in mine), sum(b["failed"] for b in mine))
    assert sum(b["failed"] for b in t["latency_by_step_level"]) == t["latency_items"] - t["latency_passed"]
    every = [abs(x["rel_error"]) for s in report["sessions"] for x in s["latency"]]
    assert t["latency_median_abs_error"] == pytest.approx(statistics.median(every))
    # one of the two is the slow-host session whose offline KV-pressure run fails: the table must show it
    assert report["sessions"][0]["failing_latency"].get("heldout-offline-kv-prefix", 0) > 0


def test_the_latency_items_by_workload(report) -> None:
    rows = {(b["workload"], b["item"]): b for b in report["by_workload"]}
    assert set(rows) == {(w, k) for w in ("heldout-offline-kv-prefix", "heldout-server-bursty",
                                          "heldout-server-prefix-mix") for k in LATENCY_ITEMS}
    latency = [x for s in report["sessions"] for x in s["latency"]]
    for (w, k), b in rows.items():
        xs = [x for x in latency if x["workload"] == w and x["item"] == k]
        assert b["runs"] == len(xs) == 8  # four repeats in each of the two sessions
        assert b["passed"] == sum(x["pass"] for x in xs)
        errs = [x["rel_error"] for x in xs]
        assert b["median_rel_error"] == pytest.approx(statistics.median(errs))
        assert b["twin_slow_share"] == pytest.approx(sum(e > 0 for e in errs) / 8)
        recorded = [x["rel_error_recorded_steps"] for x in xs]
        assert None not in recorded
        assert b["median_rel_error_recorded_steps"] == pytest.approx(statistics.median(recorded))
        assert b["failed_twin_slow"] + b["failed_twin_fast"] == b["runs"] - b["passed"]
    assert sum(b["passed"] for b in rows.values()) == report["totals"]["latency_passed"]


def test_folders_that_are_not_sessions_are_skipped_and_named(report, tmp_path) -> None:
    assert report["skipped"] == [{"folder": str(ROOT / "cpu-tiny-llama-diag-decode-context"),
                                  "why": "no held-out runs (held-out*/<workload>/run.json)"}]
    two = tmp_path / "two-profiles"
    (two / "held-out").mkdir(parents=True)
    (two / "held-out" / "heldout-server-bursty").symlink_to(A / "held-out" / "heldout-server-bursty")
    for name in ("a.yaml", "b.yaml"):
        (two / name).write_text((A / "cpu-tiny-llama.yaml").read_text())
    own, runs, why = session_parts(two)
    assert own is None and len(runs) == 1 and why == "2 profile files at its top level, not one"
    assert session_parts(two / "a.yaml") == (None, [], "not a folder")  # a shell glob over a folder picks up files
    with pytest.raises(ValueError, match="no session among the folders: .*two-profiles: 2 profile files"):
        sessions_report([two], draws=1)
    # one profile for every folder: the folder's own files do not matter then
    one = sessions_report([two], profile=str(A / "cpu-tiny-llama.yaml"), draws=1)
    assert one["profile"] == str(A / "cpu-tiny-llama.yaml") and one["sessions"][0]["latency_items"] == 6


def test_the_text_table(report) -> None:
    text = format_sessions(report)
    for s in report["sessions"]:
        line = next(x for x in text.splitlines() if x.startswith(Path(s["folder"]).name))
        assert f"{s['latency_passed']} / 72" in line
    t = report["totals"]
    assert f"{t['latency_passed']:,} of {t['latency_items']:,} latency items" in text
    assert "skipped " + str(ROOT / "cpu-tiny-llama-diag-decode-context") in text
    assert format_by_step_level(t["latency_by_step_level"]) in text.splitlines()
    bursty = report["by_workload"][LATENCY_ITEMS.index("ttft_p90_s") + len(LATENCY_ITEMS)]
    assert (bursty["workload"], bursty["item"]) == ("heldout-server-bursty", "ttft_p90_s")
    row = next(x for x in text.splitlines() if "heldout-server-bursty" in x and "TTFT p90" in x)
    assert row.split()[-1] == f"{bursty['median_rel_error_recorded_steps']:+.1%}"


def test_the_command(tmp_path, capsys) -> None:
    out = tmp_path / "sessions.json"
    assert main(["fidelity", "--sessions", str(B), "--draws", "1", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["totals"]["sessions"] == 1 and saved["draws"] == 1
    assert "1 session(s), each session's held-out runs with its own profile" in capsys.readouterr().out
    # bad input: exit 2 and a message naming what is wrong
    assert main(["fidelity", "--sessions", str(tmp_path)]) == 2
    assert "no session among the folders" in capsys.readouterr().err
    assert main(["fidelity", str(B)]) == 2
    assert "--profile is required" in capsys.readouterr().err
    assert main(["fidelity", "--sessions", "--steps", str(B)]) == 2
    # --no-noise reaches each session's fidelity: nine draws of a deterministic replay are refused by name
    assert main(["fidelity", "--sessions", "--no-noise", str(B)]) == 2
    assert "need step-time noise" in capsys.readouterr().err
    assert main(["fidelity", "--sessions", "--no-noise", "--draws", "1", str(B)]) == 0


def test_fidelity_counts_the_latency_items() -> None:
    """Every fidelity report carries the issue's latency items apart: passing, within the default tolerance outright
    (the repeats' spread aside) and their median |error|; the table prints them."""
    own, runs, _ = session_parts(B)
    rep = fidelity(runs[:3], profile=str(own), draws=1)
    items = [r["items"][k] for r in rep["runs"] for k in LATENCY_ITEMS]
    errs = [abs(it["rel_error"]) for it in items]
    lat = rep["latency_items"]
    assert lat["items"] == 18 and lat["passed"] == sum(it["pass"] for it in items)
    assert lat["within_tolerance_outright"] == sum(e <= 0.10 for e in errs)
    assert lat["median_abs_error"] == pytest.approx(statistics.median(errs))
    assert (f"latency items (TTFT, ITL and E2E p50/p90): {lat['passed']} of 18 pass; "
            f"{lat['within_tolerance_outright']} within 10% of the real run outright") in format_table(rep)
    # an item without a verdict is left out; none at all gives no median
    assert latency_counts([{"pass": None, "rel_error": None}], 0.1) == {
        "items": 0, "passed": 0, "within_tolerance_outright": 0, "median_abs_error": None}

