"""The engine emulator: real-time steps from the profile, vLLM metric names, token ids, text prompts."""

from __future__ import annotations

import http.client
import json
import time

import pytest

pytest.importorskip("aiohttp")

from twin.engine_profiles import StepShape, prefill_attention_work  # noqa: E402
from twin.router.emulator import build_emulator, output_token_id  # noqa: E402
from twin.router.local import LocalServers  # noqa: E402
from twin.router.prom import parse_exposition  # noqa: E402
from twin.router.prompt import text_token_ids  # noqa: E402

PROFILE = "llama3-8b-bf16-tp1-h100"


@pytest.fixture
def emulator():
    servers = LocalServers()
    emu = build_emulator(profile=PROFILE, engine_overrides={"max_model_len": 2048, "num_gpu_blocks": 1024})
    port = servers.start(emu.app())
    yield emu, port
    servers.close()


def call(port: int, path: str, body: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30.0)
    try:
        conn.request("POST" if body is not None else "GET", path,
                     body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    status, body = call(port, "/metrics")
    assert status == 200
    return parse_exposition(body.decode())


def test_exposes_vllm_metric_names(emulator) -> None:
    _, port = emulator
    m = metrics(port)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert name in m, name
    assert call(port, "/health")[0] == 200


def test_counters_and_prefix_hits_follow_the_engine(emulator) -> None:
    emu, port = emulator
    shared = list(range(100, 164))  # 4 full blocks of 16
    for tail in ([1, 2, 3], [4, 5, 6, 7]):
        status, body = call(port, "/v1/completions", {"prompt": shared + tail, "max_tokens": 5})
        assert status == 200
        out = json.loads(body)
        assert out["choices"][0]["token_ids"] == [output_token_id(k, 32000) for k in range(5)]
    m = metrics(port)
    assert m["vllm:prompt_tokens_total"] == 67 + 68
    assert m["vllm:generation_tokens_total"] == 10
    assert m["vllm:prefix_cache_queries_total"] == 67 + 68
    assert m["vllm:prefix_cache_hits_total"] == 64  # the second request hits the 4 shared blocks
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert m["vllm:time_to_first_token_seconds_count"] == 2
    assert m["vllm:request_success_total"] == 2
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0


def test_a_lone_request_takes_the_profiles_step_times_in_real_time(emulator) -> None:
    emu, port = emulator
    prompt, n_out = 1000, 40
    model = emu.step_model
    expected = model.step_time_s(StepShape(prefill_requests=1, prefill_tokens=prompt,
                                           prefill_attention_pairs=prefill_attention_work(0, prompt)))
    expected += sum(model.step_time_s(StepShape(decode_requests=1, decode_context_tokens=prompt + k))
                    for k in range(1, n_out))
    t0 = time.monotonic()
    status, _ = call(port, "/v1/completions", {"prompt": [7] * prompt, "max_tokens": n_out})
    elapsed = time.monotonic() - t0
    assert status == 200
    assert emu.num_steps == n_out
    assert expected <= elapsed < 1.5 * expected + 0.1, (expected, elapsed)


def test_text_prompts_use_four_bytes_per_token_and_stream_token_ids(emulator) -> None:
    _, port = emulator
    text = "The quick brown fox jumps over the lazy dog!!!"  # 46 bytes -> 12 tokens
    assert len(text_token_ids(text)) == 12
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30.0)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "prompt": text, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}).encode())
    resp = conn.getresponse()
    events = [ln[5:].strip() for ln in resp.read().split(b"\n") if ln.startswith(b"data:")]
    conn.close()
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert ids == [output_token_id(k, 32000) for k in range(6)]
    assert chunks[-1]["usage"]["prompt_tokens"] == 12
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_a_gpu_profile_schedules_asynchronously_an_arrival_waits_out_the_step_after_it() -> None:
    # vLLM on a GPU formed the next step while the one in flight ran, so a request that arrives mid-step is left out of
    # the first step formed after it and waits that whole step (a CPU profile resolves it off: test_async_scheduling).
    # Counted in steps formed, not in seconds: the loop's steps follow the profile's clock, and a request that comes
    # while a sleep overshoots its step's end is stamped after that end, less than a step before its own.
    import threading

    servers = LocalServers()
    emu = build_emulator(profile=PROFILE, engine_overrides={"max_model_len": 2048, "num_gpu_blocks": 1024})
    assert emu.engine.cfg.async_scheduling
    added, formed = [], []  # (request, steps formed before it came); each step formed, with its requests
    add, schedule = emu.engine.add, emu.engine.schedule

    def adding(r, held=False):  # noqa: ANN001, ANN202
        added.append((r, len(formed)))
        return add(r, held=held)

    def scheduling(t):  # noqa: ANN001, ANN202
        step = schedule(t)
        if step is not None:
            formed.append(list(step.reqs))
        return step

    emu.engine.add, emu.engine.schedule = adding, scheduling  # type: ignore[method-assign]
    port = servers.start(emu.app())
    try:
        first = threading.Thread(target=call, args=(port, "/v1/completions", {"prompt": [7] * 500, "max_tokens": 80}))
        first.start()
        time.sleep(0.15)  # well inside the first request's decode steps
        assert call(port, "/v1/completions", {"prompt": [9] * 10, "max_tokens": 2})[0] == 200
        first.join()
    finally:
        servers.close()
    late, before = added[1]
    joined = next(i for i, reqs in enumerate(formed) if late in reqs)
    assert joined == before + 1, (before, joined)  # one step formed after it came, without it


@pytest.mark.parametrize(("flags", "expected"), [([], True), (["--no-async-scheduling"], False),
                                                 (["--async-scheduling"], True)])
def test_emulate_takes_async_scheduling_from_the_profile_or_its_flag(flags, expected) -> None:
    import argparse

    from twin.commands.emulate import add_arguments, engine_overrides

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--profile", PROFILE, "--port", "1", "--num-gpu-blocks", "64", *flags])
    emu = build_emulator(profile=PROFILE, engine_overrides=engine_overrides(args))
    assert emu.engine.cfg.async_scheduling is expected and emu.engine.cfg.num_gpu_blocks == 64
    cpu = build_emulator(profile="cpu-tiny-llama", engine_overrides={"max_model_len": 2048})
    assert not cpu.engine.cfg.async_scheduling  # (vLLM's CPU backend forces it off)
