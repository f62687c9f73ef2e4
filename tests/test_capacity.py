"""The capacity model reproduces both design notes, and ``twin capacity`` exposes it.

Figures the notes give with exact digits are pinned exactly (at the note's printed precision); figures
the notes give with "~"/"≈" are pinned within the note's own rounding (half a unit of its last digit).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from twin import capacity as cap
from twin.capacity import PRESETS, CapacityInputs, compute_capacity
from twin.cli import main


def _about(value: float, note: float, half_unit: float) -> bool:
    """``value`` rounds to the note's figure: |value − note| ≤ half a unit of the note's last digit."""
    return abs(value - note) <= half_unit


@pytest.fixture(scope="module")
def one_m() -> cap.CapacityResult:
    return compute_capacity(PRESETS["seed-1m"])


@pytest.fixture(scope="module")
def ten_m() -> cap.CapacityResult:
    return compute_capacity(PRESETS["seed-10m"])


# ------------------------------------------------------------------------------------- the 1M note


def test_seed_1m_reproduces_the_note_exactly(one_m: cap.CapacityResult) -> None:
    assert round(one_m.avg_rps, 2) == 115.74
    assert round(one_m.peak_rps, 2) == 925.93
    assert round(one_m.peak_prompt_tokens_per_s / 1e6, 3) == 1.852
    assert round(one_m.peak_output_tokens_per_s) == 462_963
    assert one_m.replicas_at_saturation == 463
    assert one_m.replicas == 662  # the snippet's `assert replicas == 662`
    assert round(one_m.active_streams) == 13_889


def test_seed_1m_leaves_what_the_note_does_not_state_null(one_m: cap.CapacityResult) -> None:
    for field in ("kv_bytes_per_stream", "streams_per_replica_by_memory", "gpus", "gpus_with_reserve", "nodes",
                  "usd_per_month", "usd_per_m_output_tokens", "fleet_fraction_saved_per_10pt_prefix_hit",
                  "usd_per_long_context_stream_hour"):
        assert getattr(one_m, field) is None, field


# ------------------------------------------------------------------------------------ the 10M note


def test_seed_10m_demand(ten_m: cap.CapacityResult) -> None:
    assert ten_m.turns_per_day == 150e6
    assert _about(ten_m.avg_rps, 1_736, 0.5)
    assert _about(ten_m.peak_rps, 5_200, 50)
    assert _about(ten_m.peak_output_tokens_per_s, 2.1e6, 0.05e6)
    assert _about(ten_m.generation_duration_s, 14, 0.5)
    assert _about(ten_m.active_streams, 73_000, 500)


def test_seed_10m_memory_and_latency(ten_m: cap.CapacityResult) -> None:
    assert _about(ten_m.kv_bytes_per_stream, 300e6, 50e6)
    assert _about(ten_m.free_kv_bytes_per_replica, 250e9, 5e9)
    assert _about(ten_m.streams_per_replica_by_memory, 800, 50)
    assert ten_m.streams_per_replica_by_latency == 170
    assert ten_m.binding_constraint == "latency"  # "Latency binds before memory."
    assert ten_m.decode_capacity_per_replica_tokens_per_s == 5_100
    assert ten_m.decode_capacity_per_gpu_tokens_per_s == 1_275


def test_seed_10m_fleet_and_cost(ten_m: cap.CapacityResult) -> None:
    assert _about(ten_m.gpus, 1_650, 25)
    assert _about(ten_m.gpus_with_reserve, 2_150, 25)
    assert _about(ten_m.nodes, 270, 5)
    assert ten_m.output_tokens_per_month == 1.8e12
    assert _about(ten_m.usd_per_month, 3.9e6, 0.05e6)
    assert _about(ten_m.usd_per_m_output_tokens, 2.2, 0.05)


def test_seed_10m_prefix_hit_and_long_context(ten_m: cap.CapacityResult) -> None:
    assert 0.03 <= ten_m.fleet_fraction_saved_per_10pt_prefix_hit <= 0.05  # "roughly 3–5% of the fleet"
    assert _about(ten_m.long_context_kv_ratio, 50, 5)  # "~50× the KV of a 2k chat user"
    assert ten_m.long_context_streams_per_replica_by_memory == 250_000_000_000 // (163_840 * 100_000)
    assert ten_m.usd_per_long_context_stream_hour > 10 * ten_m.usd_per_stream_hour


def test_the_notes_rounding_is_load_bearing() -> None:
    """Without the note's explicit roundings the figures move: they are inputs, not decoration."""
    exact = compute_capacity(PRESETS["seed-10m"].model_copy(update={
        "round_peak_rps_to": None, "round_peak_output_tokens_per_s_to": None, "round_generation_duration_s_to": None}))
    assert exact.peak_rps == pytest.approx(150e6 / 86_400 * 3)
    assert exact.peak_output_tokens_per_s == pytest.approx(exact.peak_rps * 400)
    assert exact.active_streams == pytest.approx(exact.peak_rps * (0.5 + 400 / 30))
    assert not _about(exact.active_streams, 73_000, 500)  # the note's 73k needs "≈ 14 s"
    assert exact.gpus == 4 * cap.ceil_count(exact.peak_output_tokens_per_s / 5_100)


# ------------------------------------------------------------------------------------ single steps


def test_ceil_count_ignores_float_noise_only() -> None:
    assert cap.ceil_count(412.0 * (1 + 1e-12)) == 412
    assert cap.ceil_count(412.001) == 413


def test_stream_cap_from_a_step_model() -> None:
    # step 5 ms + 0.1 ms per stream; 30 tok/s needs step <= 33.33 ms -> 283 streams (284 gives 33.4 ms)
    assert cap.streams_at_speed_from_step_model(base_s=0.005, per_stream_s=0.0001, speed_tokens_per_s=30) == 283
    assert cap.streams_at_speed_from_step_model(base_s=0.05, per_stream_s=0.0001, speed_tokens_per_s=30) == 0
    inputs = PRESETS["seed-10m"].model_copy(update={
        "max_streams_per_replica_at_target": None, "decode_step_base_s": 0.005, "decode_step_per_stream_s": 0.0001})
    result = compute_capacity(inputs)
    assert result.streams_per_replica_by_latency == 283
    assert result.decode_capacity_per_replica_tokens_per_s == 283 * 30


def test_region_n_minus_1_reserve() -> None:
    assert cap.replicas_with_reserve(100, reserve_fraction=0.0, regions=3, survive_region_loss=True) == 150
    assert cap.replicas_with_reserve(100, reserve_fraction=0.0, regions=3, survive_region_loss=False) == 102
    assert cap.replicas_with_reserve(100, reserve_fraction=0.3, regions=1, survive_region_loss=False) == 130


def test_memory_binds_when_the_latency_cap_is_loose() -> None:
    result = compute_capacity(PRESETS["seed-10m"].model_copy(update={"max_streams_per_replica_at_target": 2_000}))
    assert result.binding_constraint == "memory"
    assert result.streams_per_replica == result.streams_per_replica_by_memory
    assert result.decode_capacity_per_replica_tokens_per_s == result.streams_per_replica_by_memory * 30


def test_prefix_hit_sensitivity_follows_the_prefill_share() -> None:
    base = compute_capacity(PRESETS["seed-10m"])
    # +10 points removes a third of the uncached prompt (30% -> 20%), so a third of the prefill share
    assert base.fleet_fraction_saved_per_10pt_prefix_hit == pytest.approx(base.prefill_share_of_replica_time / 3)
    slower_prefill = compute_capacity(PRESETS["seed-10m"].model_copy(update={"prefill_mfu_fraction": 0.3}))
    assert slower_prefill.fleet_fraction_saved_per_10pt_prefix_hit > base.fleet_fraction_saved_per_10pt_prefix_hit
    higher_hit = compute_capacity(PRESETS["seed-10m"].model_copy(update={"prefix_cache_hit_fraction": 0.8}))
    assert higher_hit.replicas_with_prefill < base.replicas_with_prefill
    assert higher_hit.replicas == base.replicas  # the note's decode-only sizing ignores prefill


# ---------------------------------------------------------------------------------- profile hook


def _fake_profile(**overrides: int) -> SimpleNamespace:
    facts = {"kv_bytes_per_token": 163_840, "weight_bytes": 70 * 10**9, "tp": 4}
    facts.update(overrides)
    return SimpleNamespace(**facts, hardware=SimpleNamespace(gpu_memory_bytes=80 * 10**9, gpus_per_node=8))


def _bare_10m() -> CapacityInputs:
    return PRESETS["seed-10m"].model_copy(update={
        "profile": "fake", "kv_bytes_per_token": None, "weight_bytes": None, "gpu_memory_bytes": None,
        "tp": None, "gpus_per_node": None})


def test_profile_fills_memory_facts() -> None:
    assert compute_capacity(_bare_10m(), profile=_fake_profile()) == compute_capacity(PRESETS["seed-10m"])
    with pytest.raises(ValueError, match="tp: inputs say 4, profile 'fake' says 8"):
        compute_capacity(_bare_10m().model_copy(update={"tp": 4}), profile=_fake_profile(tp=8))


def test_profile_by_name_goes_through_engine_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    fake_module = SimpleNamespace(load_profile=lambda name: seen.append(name) or _fake_profile(tp=8))
    monkeypatch.setattr(cap.importlib, "import_module", lambda name: fake_module)
    assert compute_capacity(_bare_10m()).gpus == 8 * compute_capacity(_bare_10m()).replicas
    assert seen[0] == "fake"
    monkeypatch.setattr(cap.importlib, "import_module", lambda name: SimpleNamespace())
    with pytest.raises(ValueError, match="load_profile is not available"):
        compute_capacity(_bare_10m())


def test_shipped_70b_profile_agrees_with_the_notes_kv_figure(capsys: pytest.CaptureFixture[str]) -> None:
    """The real hook: the 70B FP8 TP4 H100 profile's KV per token is the preset's 2·80·8·128·1 bytes."""
    bare = _bare_10m().model_copy(update={"profile": "llama3-70b-fp8-tp4-h100"})
    result = compute_capacity(bare)
    assert result.kv_bytes_per_stream == PRESETS["seed-10m"].kv_bytes_per_token * 1_900
    assert result.gpus == 4 * result.replicas
    assert main(["capacity", "--preset", "seed-10m", "--set", "profile=llama3-70b-fp8"]) == 2
    err = capsys.readouterr().err
    assert "profile:" in err and "llama3-70b-fp8-tp4-h100" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------ validation


def test_inputs_are_strict() -> None:
    with pytest.raises(ValidationError, match="daily_user"):
        CapacityInputs.model_validate({**PRESETS["seed-1m"].model_dump(), "daily_user": 3})
    with pytest.raises(ValidationError, match="survive_region_loss needs regions >= 2"):
        PRESETS["seed-1m"].model_validate({**PRESETS["seed-1m"].model_dump(), "survive_region_loss": True})
    with pytest.raises(ValidationError, match="go together"):
        PRESETS["seed-1m"].model_validate({**PRESETS["seed-1m"].model_dump(), "decode_step_base_s": 0.01})


def test_the_model_imports_nothing_heavy() -> None:
    code = "import sys, twin.capacity; print(sorted({'simpy', 'pandas', 'numpy'} & set(sys.modules)))"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------- CLI


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["capacity", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cli_json_carries_every_output(capsys: pytest.CaptureFixture[str], preset: str) -> None:
    data = _json(capsys, "--preset", preset)
    expected = compute_capacity(PRESETS[preset]).model_dump()
    assert {k: data[k] for k in expected} == expected
    assert data["inputs"]["daily_users"] == PRESETS[preset].daily_users


def test_cli_table_lists_inputs_then_outputs_with_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--preset", "seed-1m"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines.index("INPUTS") < lines.index("OUTPUTS")
    assert [line.split() for line in lines if line.startswith("peak_rps ")] == [["peak_rps", "925.93", "req/s"]]
    assert [line.split() for line in lines if line.startswith("replicas ")] == [["replicas", "662", "replicas"]]


def test_cli_file_and_set(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in PRESETS["seed-1m"].model_dump().items()))
    assert _json(capsys, "--file", str(path))["replicas"] == 662
    data = _json(capsys, "--file", str(path), "--set", "planning_utilisation_fraction=1", "--set", "tp=8")
    assert data["replicas"] == 463 and data["gpus"] == 463 * 8


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "seed-2m"], "unknown preset 'seed-2m'"),
    ([], "give --preset"),
    (["--preset", "seed-1m", "--set", "daily_user=3"], "daily_user: not an input field (did you mean 'daily_users'?)"),
    (["--preset", "seed-1m", "--set", "peak_factor=0.5"], "peak_factor: Input should be greater than or equal to 1"),
    (["--preset", "seed-1m", "--set", "tp=four"], "tp: Input should be a valid integer"),
    (["--preset", "seed-1m", "--set", "tp"], "expected KEY=VALUE"),
])
def test_cli_bad_input_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               message: str) -> None:
    assert main(["capacity", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_bad_files_exit_2(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({**PRESETS["seed-1m"].model_dump(), "peak_factr": 8}))
    assert main(["capacity", "--file", str(typo)]) == 2
    assert "peak_factr: unknown field (did you mean 'peak_factor'?)" in capsys.readouterr().err
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    assert main(["capacity", "--file", str(listing)]) == 2
    assert "expected a mapping" in capsys.readouterr().err
    assert main(["capacity", "--file", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
