"""Checks shared by the tests that pin a committed calibration session (tests/fixtures/calibration/*): its profile
is the refit of its sweep, and its fidelity table is what `twin fidelity` gives today (not a test module)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.calibration.fidelity import LATENCY_ITEMS, decode_level, fidelity
from twin.engine_profiles import load_profile
from twin.engine_profiles.derive import write_spec

REPEATS = ("held-out", "held-out-repeat2", "held-out-repeat3", "held-out-repeat4")
LATENCY = LATENCY_ITEMS  # the latency items, as fidelity counts them


def sweep_runs(root: Path) -> list[Path]:
    """The recorded runs of a session's sweep (``root/calibration``), in name order."""
    return sorted(p for p in (root / "calibration").iterdir() if (p / "run.json").exists())


# the one command's fit options (scripts/calibrate-cpu.sh) before it took --idle-wake on 2026-12-06, night (and
# --stream-ends --intake on 2026-12-07, morning: pinned_session's idle_wake and front_end)
ONE_COMMAND = FitOptions(server_offline_attention=True, decode_floor=True)


def pinned_session(root: Path, model: str, passed: int, latency: int, *, recorded: int,
                   idle_wake: bool = False, front_end: bool = False) -> tuple:
    """A session of the one command (``scripts/calibrate-cpu.sh --heldout-repeats 4``): its profile ``<model>.yaml``
    is the refit of its sweep with the command's options (``idle_wake``: the command's since 2026-12-06, night;
    ``front_end``: its ``--stream-ends --intake``, since 2026-12-07, morning), and its committed table (nine draws) is
    what fidelity gives today, with ``passed`` of 160 items, ``latency`` of 72 latency items and ``recorded`` of 128
    twin* items. Returns the committed profile spec, the sweep's runs, today's table and the committed one."""
    runs = sweep_runs(root)
    # the sweep has had a fourth server run (sweep-server-context) since 2026-12-06
    assert len(runs) == (11 if (root / "calibration" / "sweep-server-context").is_dir() else 10)
    committed = load_profile(str(root / f"{model}.yaml")).spec
    command = committed.provenance.command
    flags = set(command.split(f"--name {model}", 1)[1].split())
    expected = {"--server-offline-attention", "--decode-floor"} | ({"--idle-wake"} if idle_wake else set()) | (
        {"--stream-ends", "--intake"} if front_end else set())
    assert flags == expected, command
    refit = calibrate(runs, name=model, command="test", options=dataclasses.replace(
        ONE_COMMAND, idle_wake=idle_wake, stream_ends=front_end, intake=front_end))
    check_refit(committed, refit.spec)
    table = json.loads((root / "fidelity-held-out.json").read_text())
    assert table["noise_draws"] == 9
    report = held_out_table(root, str(root / f"{model}.yaml"))
    check_table(report, table)
    assert (table["summary"]["passed"], table["summary"]["items"], latency_passed(table)) == (passed, 160, latency)
    assert table["summary"]["recorded_steps"]["passed"] == recorded
    assert latency_passed(report) == latency
    return committed, runs, report, table


def held_out_runs(root: Path) -> list[Path]:
    """A four-repeat session's twelve held-out runs."""
    runs = sorted(p for rep in REPEATS for p in (root / rep).iterdir())
    assert len(runs) == 12
    return runs


def held_out_table(root: Path, profile: str) -> dict:
    """``twin fidelity`` of ``profile`` on a four-repeat session's twelve held-out runs, nine noise draws a run (the
    one command's table)."""
    return fidelity(held_out_runs(root), profile=profile, draws=9)


def spec_latency_passed(spec, runs: list[Path], path: Path) -> int:  # noqa: ANN001 (an EngineProfileSpec)
    """The latency items ``runs`` pass with ``spec`` (written to ``path``), nine noise draws a run."""
    write_spec(spec, path)
    return latency_passed(fidelity(runs, profile=str(path), draws=9))


def failing_latency(root: Path) -> dict[tuple[str, str, str], tuple[float, float]]:
    """A session's failing latency items in its committed table: (repeat folder, workload, item) -> (the twin's
    relative error, twin*'s)."""
    table = json.loads((root / "fidelity-held-out.json").read_text())
    return {(r["run"].split("/")[-2], r["name"], k): (r["items"][k]["rel_error"],
                                                      r["items"][k]["rel_error_recorded_steps"])
            for r in table["runs"] for k in LATENCY if r["items"][k]["pass"] is False}


def latency_passed(report: dict) -> int:
    """The TTFT/ITL/E2E p50/p90 items of a fidelity report that pass."""
    return sum(r["items"][k]["pass"] for r in report["runs"] for k in LATENCY)


def check_refit(committed, refit) -> None:  # noqa: ANN001 (two ProfileSpecs)
    """Every fitted coefficient of ``committed`` (offline and server regimes, front end, noise tables) equals the
    refit's."""
    assert_same_fit(committed.step_time, refit.step_time)
    assert committed.server is not None and refit.server is not None
    assert committed.server.arrival_s == pytest.approx(refit.server.arrival_s, rel=1e-9)
    assert committed.server.per_chunk_s == pytest.approx(refit.server.per_chunk_s, rel=1e-9)
    assert committed.server.idle_wake_s == pytest.approx(refit.server.idle_wake_s, rel=1e-9, abs=1e-15)
    for term in ("per_first_chunk_s", "per_last_chunk_s", "per_request_in_s"):
        assert getattr(committed.server, term) == pytest.approx(getattr(refit.server, term), rel=1e-9, abs=1e-15)
    assert committed.step_time_noise == refit.step_time_noise
    assert committed.server.step_time_noise == refit.server.step_time_noise
    assert_same_fit(committed.server.step_time, refit.server.step_time)


def assert_same_fit(got, want) -> None:  # noqa: ANN001 (two fitted pydantic models: coefficients, a regime)
    """Two fits equal in every field but the last bits: a committed file refitted on another CPU differs there (the
    least squares run through that machine's BLAS; 1e-13 relative on an AVX2 VM against a file fitted with AVX-512)."""
    def close(a, b, where: str) -> None:
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                close(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, float):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-15), where
        else:
            assert a == b, where

    close(got.model_dump(), want.model_dump(), type(got).__name__)


def held_out_key(run: str) -> str:
    """``held-out*/RUN`` of a run path, wherever the table was written from (the one command writes it from
    runs/calibrate-cpu/<model>/, a later `twin fidelity` from the fixture)."""
    return "held-out" + run.split("/held-out", 1)[1]


def decode_levels(report: dict) -> dict[str, float | None]:
    """Each run of a fidelity report (``held_out_key``) -> its decode steps' median recorded / modelled time."""
    return {held_out_key(r["run"]): decode_level(r) for r in report["runs"]}


def check_table(report: dict, committed: dict) -> None:
    """The same summary, and per run and item the same verdict, twin value and twin* value."""
    assert report["summary"] == committed["summary"]
    got = {(held_out_key(r["run"]), k): (i["pass"], i["twin"], i.get("twin_recorded_steps"))
           for r in report["runs"] for k, i in r["items"].items()}
    want = {(held_out_key(r["run"]), k): (i["pass"], i["twin"], i.get("twin_recorded_steps"))
            for r in committed["runs"] for k, i in r["items"].items()}
    assert set(got) == set(want)
    for key, (ok, twin, twin_recorded) in want.items():
        assert got[key][0] == ok, key
        for g, w in ((got[key][1], twin), (got[key][2], twin_recorded)):  # the profile's replay and twin*
            if isinstance(w, float):
                assert g == pytest.approx(w, rel=1e-9), key
            else:
                assert g == w, key
