"""Every committed recorded run (tests/fixtures/recorded/*) follows the recorded-run format, and the
reader rejects folders that do not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from twin.calibration.recorded import ITERATION_COLUMNS, RecordedRunError, load_recorded_run

FIXTURES = Path(__file__).parent / "fixtures" / "recorded"
RUN_DIRS = sorted(p.parent for p in FIXTURES.rglob("run.json"))


def test_fixtures_exist() -> None:
    assert len(RUN_DIRS) >= 5, f"expected committed recorded runs under {FIXTURES}"


@pytest.mark.parametrize("run_dir", RUN_DIRS, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixture_format(run_dir: Path) -> None:
    rec = load_recorded_run(run_dir)
    run = rec.run
    assert run.engine == "vllm" and run.engine_version.endswith("+cpu")
    assert run.model_config_["architectures"] == ["LlamaForCausalLM"]
    assert run.usable_blocks == run.num_gpu_blocks - 1
    assert run.metrics_delta is not None
    # ignore_eos with min_tokens = max_tokens: every request produced exactly max_tokens.
    assert all(r.output_tokens == r.max_tokens for r in rec.requests)
    assert all(len(r.prompt_token_ids) <= run.max_model_len for r in rec.requests)
    assert rec.metric("generation_tokens") == sum(r.output_tokens for r in rec.requests)
    assert rec.metric("request_success") == len(rec.requests)
    it = rec.iterations
    assert it is not None and len(it) > 0
    assert (it.ctx_tokens + it.gen_tokens <= run.max_num_batched_tokens).all()
    assert (it.ctx_requests + it.gen_requests <= run.max_num_seqs).all()
    # Without preemption, every prompt token not served from the prefix cache is logged as ctx, once.
    prompt = sum(r.prompt_tokens for r in rec.requests)
    if rec.metric("num_preemptions") == 0 and all(r.num_cached_tokens is not None for r in rec.requests):
        cached = sum(r.num_cached_tokens or 0 for r in rec.requests)
        assert int(it.ctx_tokens.sum()) == prompt - cached
        assert cached == rec.metric("prefix_cache_hits")
    # Decode tokens: one per output token after the first, plus re-prefills of preempted requests
    # (vLLM logs those under gen because the request already has output).
    decode = sum(r.output_tokens - 1 for r in rec.requests)
    if rec.metric("num_preemptions") == 0:
        assert int(it.gen_tokens.sum()) == decode
    else:
        assert int(it.gen_tokens.sum()) > decode
    if run.mode == "offline":
        assert all(r.arrival_s == 0.0 for r in rec.requests)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def some_run(tmp_path: Path) -> Path:
    if not RUN_DIRS:
        pytest.skip("no fixtures")
    return _copy(RUN_DIRS[0], tmp_path)


def test_reader_rejects_unknown_run_key(some_run: Path) -> None:
    data = json.loads((some_run / "run.json").read_text())
    data["num_gpu_block"] = 3
    (some_run / "run.json").write_text(json.dumps(data))
    with pytest.raises(RecordedRunError, match="num_gpu_block"):
        load_recorded_run(some_run)


def test_reader_rejects_token_count_mismatch(some_run: Path) -> None:
    lines = (some_run / "requests.jsonl").read_text().splitlines()
    obj = json.loads(lines[0])
    obj["output_tokens"] += 1
    obj["max_tokens"] += 1
    lines[0] = json.dumps(obj)
    (some_run / "requests.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RecordedRunError, match="token_times_s"):
        load_recorded_run(some_run)


def test_reader_rejects_bad_iterations_header(some_run: Path) -> None:
    text = (some_run / "iterations.csv").read_text().replace("gen_tokens", "decode_tokens", 1)
    (some_run / "iterations.csv").write_text(text)
    with pytest.raises(RecordedRunError, match="header"):
        load_recorded_run(some_run)


def test_iterations_are_arrays(some_run: Path) -> None:
    it = load_recorded_run(some_run).iterations
    assert it is not None
    for name in ITERATION_COLUMNS:
        assert isinstance(getattr(it, name), np.ndarray)
    assert len(it.composition()) == len(it)


def test_offline_repeat_has_identical_step_composition() -> None:
    """The same offline workload recorded twice: vLLM scheduled exactly the same steps."""
    a = load_recorded_run(FIXTURES / "offline-mixed")
    b = load_recorded_run(FIXTURES / "offline-mixed-rep2")
    assert a.run.workload == b.run.workload
    assert a.iterations is not None and b.iterations is not None
    assert a.iterations.composition() == b.iterations.composition()
    assert not np.array_equal(a.iterations.elapsed_ms, b.iterations.elapsed_ms)  # timings are real, not copied


@pytest.mark.parametrize("run_dir", RUN_DIRS, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixture_requests_rebuild_from_their_spec(run_dir: Path) -> None:
    """run.json's workload spec regenerates exactly the prompts that were sent (seeded numpy streams)."""
    from twin.calibration.workloads import WorkloadSpec, build_requests

    rec = load_recorded_run(run_dir)
    spec = WorkloadSpec.model_validate(rec.run.workload["spec"])
    built = build_requests(spec)
    assert [r.prompt_token_ids for r in built] == [r.prompt_token_ids for r in rec.requests]
    assert [r.max_tokens for r in built] == [r.max_tokens for r in rec.requests]
    if rec.run.mode == "server":  # measured send times trail the planned ones by a little
        lag = np.array([r.arrival_s for r in rec.requests]) - np.array([b.arrival_s for b in built])
        assert (np.abs(lag) < 0.5).all()


def test_workload_spec_rejects_unknown_and_inconsistent_fields() -> None:
    from pydantic import ValidationError

    from twin.calibration.workload_sets import FIXTURES as SPECS
    from twin.calibration.workloads import WorkloadSpec

    data = SPECS["offline-mixed"].model_dump()
    with pytest.raises(ValidationError, match="prompt_token"):
        WorkloadSpec.model_validate({**data, "prompt_token": data["prompt_tokens"]})
    with pytest.raises(ValidationError, match="all_at_once"):
        WorkloadSpec.model_validate({**data, "arrivals": {"kind": "poisson", "rate_per_s": 2.0}})
    with pytest.raises(ValidationError, match="max_model_len"):
        WorkloadSpec.model_validate({**data, "engine": {**data["engine"], "max_model_len": 256}})


def test_worker_parses_vllm_iteration_lines_and_metrics() -> None:
    """The recorder's parsers, on lines copied from a real vLLM 0.32.0+cpu log and /metrics page."""
    import importlib.metadata

    from twin.calibration import _vllm_common as common
    from twin.calibration import _vllm_server as server  # noqa: F401  (imports without vLLM or aiohttp)
    from twin.calibration import _vllm_worker as worker

    assert importlib.metadata.version is not worker._version  # importing it patches nothing
    lines = [
        "Engine 000: Iteration(0): 1 context requests, 256 context tokens, 0 generation requests, "
        "0 generation tokens, iteration elapsed time: 45.90 ms, CPU KV cache usage: 18.2%",
        "Engine 000: Iteration(7): 0 context requests, 0 context tokens, 0 generation requests, "
        "0 generation tokens, iteration elapsed time: 0.00 ms (dummy), CPU KV cache usage: 0.0%",
        "Engine 000: Iteration(1): 3 context requests, 132 context tokens, 2 generation requests, "
        "2 generation tokens, iteration elapsed time: 27.08 ms, CPU KV cache usage: 45.5%",
        "Avg prompt throughput: 0.0 tokens/s",
    ]
    rows = common.parse_iterations(lines)
    assert [tuple(r[c] for c in ITERATION_COLUMNS) for r in rows] == [
        (0, 1, 256, 0, 0, 45.90, 18.2),
        (1, 3, 132, 2, 2, 27.08, 45.5),
    ]
    page = "\n".join(
        [
            "# TYPE vllm:num_preemptions_total counter",
            'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0',
            "# TYPE vllm:request_success_total counter",
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 5.0',
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="128",num_gpu_blocks="1024",enable_prefix_caching="True"} 1.0',
        ]
    )
    counters, cache = common.parse_prometheus(page)
    assert counters == {"num_preemptions": 3.0, "request_success": 6.0}
    assert cache["num_gpu_blocks"] == "1024" and cache["block_size"] == "128"
    assert common.delta({"num_preemptions": 5.0}, {"num_preemptions": 3.0}) == {"num_preemptions": 2}
