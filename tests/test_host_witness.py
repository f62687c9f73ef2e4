"""The recorder's host witness (``_vllm_common.HostWitness``): a sampling process on a core the engine's model does
not use, its samples cut to a run's window, nothing left running after it; shown under each run by fidelity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twin.calibration import _vllm_common as common
from twin.calibration.fidelity import MEASURED_WORKLOAD_FIELDS

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="the witness needs a CPU free of the model's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@needs_two
def test_samples_within_the_window_on_the_other_cpus(tmp_path):
    w = common.HostWitness(sys.executable, CPUS[:1], tmp_path)
    assert w.cpus == CPUS[1:]
    time.sleep(0.8)  # numpy's import and the first sum are over before the window opens
    t0 = time.monotonic()
    time.sleep(1.6)
    t1 = time.monotonic()
    pid = w.proc.pid
    r = w.result(t0, t1)
    assert "error" not in r, r
    assert r["cpus"] == CPUS[1:] and r["period_s"] == common.WITNESS_PERIOD_S
    assert r["buffer_mb"] == common.WITNESS_BUFFER_MB
    assert 2 <= r["samples"] <= 4  # one every 0.5 s in 1.6 s (3 or 4; 2 if the machine is busy)
    assert r["samples"] == len(r["t_s"]) == len(r["ms"]) == len(r["cpu_ms"])
    assert all(0 <= t <= t1 - t0 for t in r["t_s"]) and r["t_s"] == sorted(r["t_s"])
    assert all(m > 0 for m in r["ms"]) and sorted(r["ms"])[len(r["ms"]) // 2] == r["median_ms"]
    assert not _alive(pid)  # stopped
    assert not list(tmp_path.iterdir())  # its sample file removed


@needs_two
def test_a_window_without_samples_is_an_error_not_a_failure(tmp_path):
    w = common.HostWitness(sys.executable, CPUS[:1], tmp_path)
    r = w.result(0.0, 1.0)  # long before this process started
    assert set(r) == {"error"} and r["error"].startswith("no samples during the run")


def test_no_free_cpu_no_process(tmp_path):
    for engine_cpus in (CPUS, []):  # every CPU the model's; no bound thread found
        w = common.HostWitness(sys.executable, engine_cpus, tmp_path)
        assert w.proc is None
        assert w.result(0.0, 1e9) == {"error": "no CPU free of the engine's model workers"}


@needs_two
def test_the_witness_stops_when_its_recorder_dies(tmp_path):
    """A recording killed mid-run (the worker's group is killed by record.py, but a crash may not be) leaves no
    sampling process behind: it watches its parent."""
    code = (f"import sys, time; sys.path.insert(0, {str(Path(common.__file__).parent)!r}); import _vllm_common as c; "
            f"from pathlib import Path; w = c.HostWitness(sys.executable, [{CPUS[0]}], Path({str(tmp_path)!r})); "
            "print(w.proc.pid, flush=True); time.sleep(0.6)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_passes_with_different_witnesses_are_repeats():
    assert "host_witness" in MEASURED_WORKLOAD_FIELDS


def test_fidelity_prints_the_witness_under_a_run(tmp_path):
    from twin.calibration.fidelity import fidelity, format_table

    run = SESSION / "held-out" / "heldout-offline-kv-prefix"
    dst = _copy_run(run, tmp_path / "run", 2.345)
    rep = fidelity([dst], profile=str(PROFILE), noise=False)
    assert rep["runs"][0]["step_level"]["host_witness_ms"] == 2.345
    assert "; host witness 2.35 ms" in format_table(rep)
    plain = fidelity([run], profile=str(PROFILE), noise=False)
    assert plain["runs"][0]["step_level"]["host_witness_ms"] is None
    assert "host witness" not in format_table(plain)


# --- the term: fitted by calibrate, used by fidelity --host-witness -------------------------------------------------

SESSION = Path(__file__).parent / "fixtures" / "calibration" / "cpu-tiny-llama-avx2-3"
PROFILE = SESSION / "cpu-tiny-llama.yaml"


def _copy_run(src: Path, dst: Path, witness_ms: float | None) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    if witness_ms is not None:
        meta = json.loads((dst / "run.json").read_text())
        meta["workload"]["host_witness"] = {"cpus": [1], "period_s": 0.5, "buffer_mb": 32, "median_ms": witness_ms,
                                            "median_cpu_ms": witness_ms, "samples": 1, "t_s": [0.1],
                                            "ms": [witness_ms], "cpu_ms": [witness_ms]}
        (dst / "run.json").write_text(json.dumps(meta))
    return dst


def _levels(runs: list[Path], profile: str) -> list[float]:
    from twin.calibration.recorded import load_recorded_run
    from twin.calibration.residuals import run_step_level
    from twin.engine_profiles import load_profile

    prof = load_profile(profile)
    return [run_step_level(load_recorded_run(r), prof)["decode"]["median_ratio"] for r in runs]


def _witnessed_sweep(tmp_path: Path, exponent: float, reference: float) -> list[Path]:
    """The avx2-3 session's sweep, each run given the witness at which ``(w / reference) ** exponent`` is its level
    against the session's profile."""
    src = sorted(p for p in (SESSION / "calibration").iterdir() if (p / "run.json").exists())
    levels = _levels(src, str(PROFILE))
    return [_copy_run(s, tmp_path / "sweep" / s.name, reference * lvl ** (1 / exponent))
            for s, lvl in zip(src, levels, strict=True)]


def test_the_fit_recovers_a_witness_the_levels_follow(tmp_path):
    from twin.calibration.recorded import load_recorded_run
    from twin.calibration.witness import fit_host_witness
    from twin.engine_profiles import load_profile

    runs = _witnessed_sweep(tmp_path, exponent=2.0, reference=2.2)
    recs = [load_recorded_run(r) for r in runs]
    term = fit_host_witness(recs, load_profile(str(PROFILE)))
    assert term is not None and term.runs == len(runs) == 11
    assert term.exponent == pytest.approx(2.0, abs=1e-4) and term.reference_ms == pytest.approx(2.2, rel=1e-4)
    assert term.correlation == pytest.approx(1.0, abs=1e-4)
    assert "offline, server" in term.notes
    assert fit_host_witness(recs[:2], load_profile(str(PROFILE))) is None  # too few runs
    plain = [load_recorded_run(r) for r in sorted((SESSION / "calibration").iterdir())]
    assert fit_host_witness(plain, load_profile(str(PROFILE))) is None  # recorded before the witness


def test_calibrate_keeps_the_term_in_the_profile(tmp_path):
    from twin.calibration.calibrate import FitOptions, calibrate
    from twin.engine_profiles import load_profile
    from twin.engine_profiles.derive import write_spec

    runs = _witnessed_sweep(tmp_path, exponent=1.5, reference=2.0)
    opts = FitOptions(server_offline_attention=True, decode_floor=True, idle_wake=True, stream_ends=True, intake=True)
    spec = calibrate(runs, name="cpu-tiny-llama", command="test", options=opts).spec
    assert spec.host_witness is not None and spec.host_witness.runs == 11
    # the refit is the committed profile's fit (its levels made the witnesses), so the term comes back close
    assert spec.host_witness.exponent == pytest.approx(1.5, rel=0.05)
    assert spec.host_witness.reference_ms == pytest.approx(2.0, rel=0.02)
    out = tmp_path / "p.yaml"
    write_spec(spec, out)
    assert load_profile(str(out)).spec.host_witness == spec.host_witness
    assert load_profile(str(PROFILE)).spec.host_witness is None  # the committed profiles have none


def test_the_host_speed_scales_model_time_only():
    from twin.engine_profiles import load_profile
    from twin.engine_profiles.step import StepShape
    from twin.replay import HostSpeedStepTimes

    base = load_profile(str(PROFILE)).step_time_model()
    fixed = lambda n: 0.001  # noqa: E731
    scaled = HostSpeedStepTimes(base, 1.25, fixed_s=fixed)
    shape = StepShape(decode_requests=6, decode_context_tokens=600, prefill_requests=0, prefill_tokens=0)
    assert scaled.step_time_s(shape) == pytest.approx(0.001 + (base.step_time_s(shape) - 0.001) * 1.25)
    run = scaled.decode_run_s(6, 600, 4)
    assert run == pytest.approx(0.001 + (base.decode_run_s(6, 600, 4) - 0.001) * 1.25)
    with pytest.raises(ValueError, match="positive"):
        HostSpeedStepTimes(base, 0.0, fixed_s=fixed)


def test_fidelity_scales_each_run_by_its_own_witness(tmp_path):
    from twin.calibration.calibrate import FitOptions, calibrate
    from twin.calibration.fidelity import fidelity, format_table
    from twin.engine_profiles.derive import write_spec

    runs = _witnessed_sweep(tmp_path, exponent=2.0, reference=2.0)
    opts = FitOptions(server_offline_attention=True, decode_floor=True, idle_wake=True, stream_ends=True, intake=True)
    prof = tmp_path / "cpu-tiny-llama.yaml"
    write_spec(calibrate(runs, name="cpu-tiny-llama", command="test", options=opts).spec, prof)
    held = SESSION / "held-out" / "heldout-offline-kv-prefix"
    slow = _copy_run(held, tmp_path / "slow" / held.name, 2.2)  # a witness 10 % slower: ~1.2x the model time
    bare = _copy_run(held, tmp_path / "bare" / held.name, None)
    with pytest.raises(ValueError, match="no host_witness term"):
        fidelity([slow], profile=str(PROFILE), noise=False, host_witness=True)
    plain = fidelity([slow, bare], profile=str(prof), noise=False)
    scaled = fidelity([slow, bare], profile=str(prof), noise=False, host_witness=True)
    term = scaled["host_witness"]
    factor = (2.2 / term["reference_ms"]) ** term["exponent"]
    assert 1.15 < factor < 1.3
    assert scaled["runs"][0]["host_factor"] == pytest.approx(factor, rel=1e-5)
    assert scaled["runs"][1]["host_factor"] is None  # no witness: not scaled
    assert "host_factor" not in plain["runs"][0] and "host_witness" not in plain
    e2e = lambda rep, i: rep["runs"][i]["items"]["e2e_p50_s"]["twin"]  # noqa: E731
    assert e2e(scaled, 0) / e2e(plain, 0) == pytest.approx(factor, rel=0.05)
    assert e2e(scaled, 1) == e2e(plain, 1)
    text = format_table(scaled)
    assert "profile replays scaled by each run's host witness (--host-witness)" in text
    assert f"the profile replay scaled x{factor:.3f} for it" in text


def test_the_cli_refuses_the_option_with_sessions_or_steps(capsys):
    from twin.cli import main

    for extra in (["--sessions"], ["--steps", "--profile", str(PROFILE)]):
        assert main(["fidelity", "--host-witness", str(SESSION), *extra]) == 2
        assert "--host-witness goes with a plain table" in capsys.readouterr().err
