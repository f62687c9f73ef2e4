"""Trace replay: the requests match the published traces (stats.json), and the window, time-scale,
rate-multiplier and prefix-content rules do what docs/traces.md says."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from twin.models.tokens import TokenSeq
from twin.models.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TRACE_NAMES,
    TraceWorkload,
    load_trace,
    missing_trace_files,
    trace_requests,
)
from twin.paths import shared_dir
from shared_data import needs_traces

STATS_KEY = {"azure-conv": "azure2023_conv", "azure-code": "azure2023_code",
             "mooncake-conversation": "mooncake_conversation", "mooncake-synthetic": "mooncake_synthetic",
             "burstgpt-1": "burstgpt1_first400", "burstgpt-3": "burstgpt3_first400", "ragpulse": "ragpulse"}
ROUND = 0.05 + 1e-9  # stats.json rounds to 0.1


@pytest.fixture(scope="module")
def stats() -> dict:
    return json.loads((shared_dir() / "traces" / "stats.json").read_text())


def _requests(trace: str, **kw):
    seed = kw.pop("seed", 7)
    kw.setdefault("jitter_within_quantum", False)
    return trace_requests(TraceWorkload(trace=trace, **kw), seed=seed, replication=0)


def _row(spec) -> int:
    return int(spec.request_id.rsplit(".r", 1)[1])


def _arrivals(reqs) -> np.ndarray:
    return np.array([r.arrival_s for r in reqs])


@needs_traces
@pytest.mark.parametrize("trace", TRACE_NAMES)
def test_full_trace_matches_stats(trace, stats):
    s = stats[STATS_KEY[trace]]
    reqs = _requests(trace)
    a = _arrivals(reqs)
    assert len(reqs) == s["rows"] == s["arrivals"]["n"]
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0.0)
    assert a[-1] == pytest.approx(s["arrivals"]["span_s"], abs=ROUND)
    table = load_trace(trace)
    rows = np.array([_row(r) for r in reqs])
    assert sorted(rows.tolist()) == list(range(len(reqs)))
    prompt = np.array([r.prompt_tokens for r in reqs])
    out = np.array([r.output_tokens for r in reqs])
    # zero lengths (BurstGPT's failed requests) are clamped to 1; everything else is the trace's number
    assert np.array_equal(prompt, np.maximum(table.prompt_tokens[rows], 1))
    assert np.array_equal(out, np.maximum(table.output_tokens[rows], 1))
    raw_in, raw_out = table.prompt_tokens, table.output_tokens
    if trace.startswith("burstgpt"):
        assert int((raw_out == 0).sum()) == s["zero_response_rows"]
        raw_in, raw_out = raw_in[raw_in > 0], raw_out[raw_out > 0]
        s_in, s_out = s["input_nonzero"], s["output_nonzero"]
    else:
        s_in, s_out = s["input"], s["output"]
    assert raw_in.size == s_in["n"] and raw_out.size == s_out["n"]
    assert raw_in.mean() == pytest.approx(s_in["mean"], abs=ROUND)
    assert raw_out.mean() == pytest.approx(s_out["mean"], abs=ROUND)
    # every request's pieces cover exactly its prompt; output segments are unique
    assert all(sum(p[1][1] for p in r.pieces) == r.prompt_tokens for r in reqs)
    assert len({r.output_segment for r in reqs}) == len(reqs)
    assert all(r.max_tokens == r.output_tokens for r in reqs)


@needs_traces
@pytest.mark.parametrize("trace", ["mooncake-conversation", "burstgpt-3", "ragpulse"])
def test_jitter_stays_inside_the_timestamp_quantum(trace):
    plain = {r.request_id: r.arrival_s for r in _requests(trace)}
    jittered = _requests(trace, jitter_within_quantum=True)
    a = _arrivals(jittered)
    assert len(jittered) == len(plain) and a[0] == 0.0 and np.all(np.diff(a) >= 0.0)
    q = load_trace(trace).quantum_s
    shift = np.array([r.arrival_s - plain[r.request_id] for r in jittered])
    assert np.all(np.abs(shift) < q) and shift.std() > 0.1 * q  # moved, but never out of its bucket


@needs_traces
def test_time_scale_halves_the_span():
    full = _requests("azure-code", jitter_within_quantum=True)
    fast = _requests("azure-code", jitter_within_quantum=True, time_scale=0.5)
    assert [r.request_id for r in fast] == [r.request_id for r in full]
    assert np.allclose(_arrivals(fast), 0.5 * _arrivals(full), rtol=1e-12, atol=1e-9)
    assert _arrivals(fast)[-1] == pytest.approx(0.5 * _arrivals(full)[-1], rel=1e-12)


@needs_traces
def test_rate_multiplier_below_one_thins_deterministically():
    n = len(_requests("azure-code"))
    half = _requests("azure-code", rate_multiplier=0.5)
    assert abs(len(half) - n / 2) < 4 * math.sqrt(n * 0.25)  # binomial(n, 1/2), 4 sigma
    assert [r.request_id for r in _requests("azure-code", rate_multiplier=0.5)] == [r.request_id for r in half]
    other = _requests("azure-code", rate_multiplier=0.5, seed=8)
    assert {r.request_id for r in other} != {r.request_id for r in half}
    assert all(".c0." in r.request_id for r in half)
    a = _arrivals(half)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0.0)


@needs_traces
def test_rate_multiplier_two_doubles_with_a_shifted_copy():
    one = _requests("azure-code")
    two = _requests("azure-code", rate_multiplier=2.0)
    assert len(two) == 2 * len(one)
    a = _arrivals(two)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0.0)
    c0 = {r.request_id: r.arrival_s for r in two if ".c0." in r.request_id}
    assert c0 == {r.request_id: r.arrival_s for r in one}  # copy 0 is the trace itself
    c1 = np.array([r.arrival_s for r in two if ".c1." in r.request_id])
    assert c1.size == len(one) and c1.max() < _arrivals(one)[-1] + 1.0
    # the copy is rotated, not aligned: its per-minute counts are not copy 0's
    bins = np.arange(0.0, a[-1] + 60.0, 60.0)
    assert not np.array_equal(np.histogram(c1, bins)[0], np.histogram(list(c0.values()), bins)[0])
    # non-integer multipliers: floor(m) whole copies and one thinned copy
    n = len(one)
    m25 = _requests("azure-code", rate_multiplier=2.5)
    assert abs(len(m25) - 2.5 * n) < 4 * math.sqrt(n * 0.25)
    assert sum(".c0." in r.request_id for r in m25) == n == sum(".c1." in r.request_id for r in m25)


@needs_traces
def test_window_and_limits():
    table = load_trace("mooncake-synthetic")
    reqs = _requests("mooncake-synthetic", start_s=200.0, duration_s=300.0)
    inside = np.flatnonzero((table.t_s >= 200.0) & (table.t_s < 500.0))
    assert sorted(_row(r) for r in reqs) == inside.tolist()
    assert _arrivals(reqs)[0] == 0.0 and _arrivals(reqs)[-1] < 300.0
    first = _requests("mooncake-synthetic", start_s=200.0, duration_s=300.0, max_requests=50, max_tokens_cap=64)
    assert [r.request_id for r in first] == [r.request_id for r in reqs[:50]]
    assert all(r.max_tokens == 64 for r in first)
    assert [r.output_tokens for r in first] == [r.output_tokens for r in reqs[:50]]
    assert _requests("mooncake-synthetic", start_s=1e6) == []


def _first_shared_pair(reqs, min_shared: int):
    """Two requests that agree on at least ``min_shared`` leading segments and then differ in one."""
    first: dict[tuple, object] = {}
    for r in reqs:
        ids = [p[1][0] for p in r.pieces]
        key = tuple(ids[:min_shared])
        if len(ids) <= min_shared:
            continue
        a = first.setdefault(key, r)
        a_ids = [p[1][0] for p in a.pieces]  # type: ignore[attr-defined]
        if any(x != y for x, y in zip(a_ids, ids)):
            return a, r
    raise AssertionError("no pair shares a prefix")


@needs_traces
@pytest.mark.parametrize("trace", ["mooncake-conversation", "mooncake-synthetic"])
def test_mooncake_hash_ids_become_shared_prefix_blocks(trace, stats):
    reqs = _requests(trace)
    table = load_trace(trace)
    bs = MOONCAKE_BLOCK_TOKENS
    for r in reqs[:500]:
        n = r.prompt_tokens
        assert [p[1][1] for p in r.pieces] == [bs] * (math.ceil(n / bs) - 1) + [n - bs * (math.ceil(n / bs) - 1)]
    a, b = _first_shared_pair(reqs, 3)
    shared = next(i for i, (x, y) in enumerate(zip(a.pieces, b.pieces)) if x[1][0] != y[1][0])
    assert shared >= 3 and a.pieces[:shared] == b.pieces[:shared]
    ha = TokenSeq(a.pieces, block_size=16, output_segment=0).block_hashes(a.prompt_tokens // 16)
    hb = TokenSeq(b.pieces, block_size=16, output_segment=1).block_hashes(b.prompt_tokens // 16)
    k = shared * bs // 16
    assert ha[:k] == hb[:k] and ha[k] != hb[k]
    # infinite-cache prefix reuse over the whole trace equals the published figure: with chained
    # hashes, misses = distinct chain prefixes, whatever the order
    assert table.segments is not None

    def hit_ratio(rs):
        nodes, refs = set(), 0
        for r in rs:
            h = 0
            for p in r.pieces:
                h = hash((h, p[1][0]))
                nodes.add(h)
            refs += len(r.pieces)
        return 1.0 - len(nodes) / refs

    s = stats[STATS_KEY[trace]]
    assert hit_ratio(reqs) == pytest.approx(s["infinite_cache_prefix_block_hit_ratio"], abs=5e-5)
    if trace != "mooncake-synthetic":
        return  # the copy rules below are trace-independent; check them on the smaller trace
    # copies use their own segment ids unless told to share them
    two = _requests(trace, rate_multiplier=2.0)
    assert hit_ratio(two) == pytest.approx(hit_ratio(reqs), abs=1e-12)
    shared_two = _requests(trace, rate_multiplier=2.0, copies_share_prefixes=True)
    assert hit_ratio(shared_two) == pytest.approx(1.0 - (1.0 - hit_ratio(reqs)) / 2.0, abs=1e-12)


@needs_traces
def test_ragpulse_components_share_segments():
    reqs = _requests("ragpulse")
    a, b = _first_shared_pair(reqs, 2)  # the same two leading system-prompt blocks
    ha = TokenSeq(a.pieces, block_size=16, output_segment=0).block_hashes(a.prompt_tokens // 16)
    hb = TokenSeq(b.pieces, block_size=16, output_segment=1).block_hashes(b.prompt_tokens // 16)
    k = sum(p[1][1] for p in a.pieces[:2]) // 16
    assert k > 0 and ha[:k] == hb[:k]
    # the tokens no component accounts for (6-12 per request) are a unique last segment
    lasts = [r.pieces[-1][1][0] for r in reqs]
    assert len(set(lasts)) == len(reqs)
    assert all(1 <= r.pieces[-1][1][1] <= 12 for r in reqs)


@needs_traces
def test_traces_without_content_have_one_unique_segment_per_request():
    reqs = _requests("azure-code", rate_multiplier=2.0)
    assert all(len(r.pieces) == 1 for r in reqs)
    assert len({r.pieces[0][1][0] for r in reqs}) == len(reqs)


@needs_traces
def test_same_seed_same_requests_and_loader_cache():
    cfg = TraceWorkload(trace="burstgpt-3", rate_multiplier=1.7)
    assert trace_requests(cfg, seed=3, replication=1) == trace_requests(cfg, seed=3, replication=1)
    assert trace_requests(cfg, seed=3, replication=1) != trace_requests(cfg, seed=3, replication=2)
    t = load_trace("burstgpt-3")
    assert load_trace("burstgpt-3") is t and not t.t_s.flags.writeable


def test_bad_config_names_the_field():
    with pytest.raises(ValidationError) as exc:
        TraceWorkload.model_validate({"kind": "trace", "trace": "azure-chat"})
    assert exc.value.errors()[0]["loc"] == ("trace",)
    for field, value in [("time_scale", 0.0), ("rate_multiplier", -1.0), ("start_s", -5.0), ("max_requests", 0)]:
        with pytest.raises(ValidationError) as exc:
            TraceWorkload.model_validate({"trace": "ragpulse", field: value})
        assert exc.value.errors()[0]["loc"] == (field,)
    with pytest.raises(ValidationError) as exc:
        TraceWorkload.model_validate({"trace": "ragpulse", "rate_multipler": 2.0})
    assert exc.value.errors()[0]["type"] == "extra_forbidden"


def test_import_stays_below_the_scenario_layer():
    """twin.scenario may import TraceWorkload from here: this module must not import it back."""
    code = ("import sys, twin.models.traces; "
            "print(sorted(m for m in ('twin.scenario', 'twin.models.workload', 'simpy', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_missing_trace_file_is_named_with_where_traces_are_read_from(monkeypatch, tmp_path):
    monkeypatch.setenv("TWIN_SHARED", str(tmp_path))
    assert missing_trace_files("azure-conv") == [tmp_path / "traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"]
    with pytest.raises(FileNotFoundError) as err:
        load_trace("azure-conv")
    msg = str(err.value)
    assert str(tmp_path / "traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv") in msg
    assert "../shared" in msg and "$TWIN_SHARED" in msg
