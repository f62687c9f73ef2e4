"""Server mode of the recorder: ``vllm serve`` on loopback, a warm-up, the measured requests streamed at their times.

Standalone like ``_vllm_worker.py`` (standard library, plus aiohttp from the vLLM environment); the worker
imports it as a sibling file. See ``_vllm_worker`` for the whole recording.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

try:  # imported as part of twin (tests)
    from twin.calibration import _vllm_common as common
except ImportError:  # run as a script in the vLLM environment, where twin is not installed: the sibling file
    import _vllm_common as common  # type: ignore[no-redef]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
            return resp.status, resp.read().decode()
    except Exception:
        return 0, ""


def http_post(url: str, timeout: float = 30.0) -> tuple[int, str]:
    try:
        req = urllib.request.Request(url, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback only
            return resp.status, resp.read().decode()
    except Exception:
        return 0, ""


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left."""
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


async def _send_all(base: str, model: str, reqs: list[dict], timeout_s: float) -> tuple[list[dict], float]:
    import asyncio

    import aiohttp

    results: dict[str, dict] = {}
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(session: aiohttp.ClientSession, r: dict) -> None:
        delay = t0 + r["arrival_s"] - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = loop.time()
        body = {
            "model": model,
            "prompt": list(r["prompt_token_ids"]),
            "max_tokens": r["max_tokens"],
            "min_tokens": r["max_tokens"],
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        }
        times: list[float] = []
        cached = None
        async with session.post(base + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{r['request_id']}: HTTP {resp.status}: {(await resp.text())[:500]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = loop.time() - sent
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    times.extend([now] * len(ids))
                usage = chunk.get("usage")
                if usage and usage.get("prompt_tokens_details"):
                    cached = usage["prompt_tokens_details"].get("cached_tokens")
        results[r["request_id"]] = {
            "request_id": r["request_id"],
            "arrival_s": common._r6(sent - t0),
            "prompt_token_ids": list(r["prompt_token_ids"]),
            "max_tokens": r["max_tokens"],
            "output_tokens": len(times),
            "token_times_s": [common._r6(t) for t in times],
            "e2e_s": common._r6(times[-1]) if times else None,
            "num_cached_tokens": cached,
        }

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(session, r) for r in reqs))
    return [results[r["request_id"]] for r in reqs], loop.time() - t0


def _num_gpu_blocks(cache_info: dict[str, str]) -> int | None:
    """``num_gpu_blocks`` of ``vllm:cache_config_info``'s labels, None where the label is missing or unset."""
    value = cache_info.get("num_gpu_blocks")
    return None if value in (None, "", "None") else int(value)


def warm_up(base: str, model: str, engine: dict, cache_info: dict[str, str], timeout_s: float,
            prefill: bool = True) -> dict:
    """Serve :func:`_vllm_common.warmup_plan`'s requests before the measured run, each wave after the one before.

    As ``vllm bench serve`` does its initial test prompt: a fleet's servers are warm, a freshly started ``vllm
    serve`` is not (its first requests came 5-37 ms later than the server model in 2026-11-29 recordings,
    docs/calibration-sessions.md, "The server TTFT tail"; a decode step at a batch size not yet seen ran 1.3-1.6x
    slower; its first long prefill 1.3-2.1x, "The first long prefill of a fresh server"). The ``/metrics`` baseline and
    the iteration log are taken after the warm-up, so neither counts it. Returns
    :func:`_vllm_common.warmup_summary` of what was sent.
    """
    import asyncio

    block_size = int(cache_info.get("block_size") or 16)
    blocks = engine.get("num_gpu_blocks_override") or _num_gpu_blocks(cache_info)
    decode, waves = common.warmup_plan(engine, block_size, blocks, prefill)
    for wave in [decode, *waves]:
        asyncio.run(_send_all(base, model, wave, timeout_s))
    time.sleep(1.0)  # the warm-up's last iteration lines reach the log before the run's offset is taken
    return common.warmup_summary(decode, waves)


def run_server(job: dict) -> None:
    engine = job["engine"]
    dirs = common.out_dirs(job)
    passes: list[dict] = []
    scratch = Path(job["scratch_dir"])
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    model = "twin-model"
    args = common.engine_cli_args(engine) + ["--served-model-name", model, "--enable-prompt-tokens-details"]
    cmd = [job["launcher"], "serve", job["model_dir"], "--host", "127.0.0.1", "--port", str(port), *args]
    log_path = scratch / "engine.log"
    log = open(log_path, "w")
    # Own process group (so it can be killed as a whole) but the caller's session: under setsid the API
    # process lands in another scheduling autogroup and starves on a busy machine (recipe).
    # More than one pass through this server: its development API, for /reset_prefix_cache between them.
    env = dict(os.environ) | ({"VLLM_SERVER_DEV_MODE": "1"} if len(dirs) > 1 else {})
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0,
                            env=env)
    (scratch / "server.pgid").write_text(str(proc.pid))
    try:
        deadline = time.monotonic() + job.get("startup_timeout_s", 300)
        while http_get(base + "/health", timeout=2)[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError("vllm serve did not become healthy in time")
            time.sleep(0.5)
        pinning = (common.pin_front_end(proc.pid, engine_core=job.get("engine_core", "front-end"))
                   if job.get("pin_front_end", False) else {"pinned": False})
        cpus = pinning.get("engine_cpus") or common.engine_cpus(proc.pid)
        for k in range(1, len(dirs) + 1):
            if k > 1:  # the next pass starts from an empty prefix cache, as the first did
                status, text = http_post(base + "/reset_prefix_cache")
                if status != 200 or not json.loads(text or "{}").get("success"):
                    raise RuntimeError(f"pass {k}: the server did not reset its prefix cache ({status} {text[:200]})")
            passes.append(_one_pass(job, base, model, log, log_path, proc.pid, cpus))
    finally:
        stop_group(proc)
        log.close()
    full_log = log_path.read_text(errors="replace")
    for k, (out_dir, rec) in enumerate(zip(dirs, passes, strict=True), start=1):
        start = passes[k - 2]["end"] if k > 1 else 0
        end = rec["end"] if k < len(dirs) else None  # the last pass's lines run to the end of the log, as before
        _write_pass(job, args, engine, full_log, rec, start, end, pinning, k, len(dirs), out_dir)


def _one_pass(job: dict, base: str, model: str, log, log_path: Path, pid: int, cpus: list[int]) -> dict:
    """One pass of the measured requests (after its warm-up and speed probe); returns what ``_write_pass`` needs, with
    the log offsets where its warm-up's lines end (``offset``) and its own end (``end``)."""
    import asyncio

    engine = job["engine"]
    # started before the warm-up, so its start-up is over before the measured requests; in the server's process
    # group, so the load snapshot counts it as the recording's own and the group's teardown takes it
    witness = (common.HostWitness(sys.executable, cpus, log_path.parent, pgid=pid)
               if job.get("host_witness", True) else None)
    warmup: dict = {"decode_requests": 0, "prefill_prompt_tokens": []}
    if job.get("warmup", True):
        status, text = http_get(base + "/metrics")
        if status != 200:
            raise RuntimeError("could not scrape /metrics before the warm-up")
        warmup = warm_up(base, model, engine, common.parse_prometheus(text)[1], job["timeout_s"],
                         prefill=job.get("warmup_prefill", True))
    probe_before = common.probe_or_error(cpus, engine["dtype"]) if job.get("speed_probe", True) else None
    status, text = http_get(base + "/metrics")
    if status != 200:
        raise RuntimeError("could not scrape /metrics before the run")
    before, cache_info = common.parse_prometheus(text)
    log.flush()
    offset = log_path.stat().st_size
    load_before = common.load_snapshot(pid)
    t0 = time.monotonic()
    requests, _ = asyncio.run(_send_all(base, model, job["requests"], job["timeout_s"]))
    t_end = time.monotonic()
    host_load = common.load_during(load_before, common.load_snapshot(pid))
    host_witness = witness.result(t0, t_end) if witness is not None else None
    # Iteration lines are logged by the API process right after each step's outputs; give the
    # last ones a moment to reach the log.
    time.sleep(1.0)
    status, text = http_get(base + "/metrics")
    if status != 200:
        raise RuntimeError("could not scrape /metrics after the run")
    after, cache_info_after = common.parse_prometheus(text)
    probe_after = common.probe_or_error(cpus, engine["dtype"]) if probe_before is not None else None
    log.flush()
    return {"warmup": warmup, "probe": None if probe_before is None else {"before": probe_before, "after": probe_after},
            "before": before, "after": after, "cache_info": cache_info_after or cache_info, "offset": offset,
            "end": log_path.stat().st_size, "requests": requests, "host_load": host_load, "host_witness": host_witness}


def _write_pass(job: dict, args: list[str], engine: dict, full_log: str, rec: dict, start: int, end: int | None,
                pinning: dict, pass_no: int, passes: int, out_dir: str) -> None:
    """Write one pass's run folder: its iteration lines are the log's bytes from ``rec["offset"]`` to ``end``, its
    warm-up's from ``start`` (the previous pass's end) to ``rec["offset"]``."""
    raw = full_log.encode()
    offset, cache_info = rec["offset"], rec["cache_info"]
    run_lines = raw[offset:end].decode(errors="replace").splitlines()
    iterations = common.parse_iterations(run_lines)
    warmup_rows = common.parse_iterations(raw[start:offset].decode(errors="replace").splitlines())

    num_gpu_blocks, source = None, None
    m = common.OVERRIDE_RE.search(full_log)
    if m:
        num_gpu_blocks, source = int(m.group(2)), "log: Overriding num_gpu_blocks"
    elif _num_gpu_blocks(cache_info) is not None:
        num_gpu_blocks, source = _num_gpu_blocks(cache_info), "metrics: cache_config_info"
    if num_gpu_blocks is None:
        raise RuntimeError("num_gpu_blocks not found in the start-up log nor in /metrics")
    if _num_gpu_blocks(cache_info) not in (None, num_gpu_blocks):
        raise RuntimeError(f"num_gpu_blocks: log says {num_gpu_blocks}, /metrics says {cache_info['num_gpu_blocks']}")
    block_size = int(cache_info["block_size"]) if cache_info.get("block_size") else None
    mnbt = re.search(r"max_num_batched_tokens=(\d+)", full_log)
    if mnbt and int(mnbt.group(1)) != engine["max_num_batched_tokens"]:
        raise RuntimeError(f"engine runs max_num_batched_tokens={mnbt.group(1)}, asked {engine['max_num_batched_tokens']}")
    if block_size is None:
        raise RuntimeError("block_size not found in /metrics cache_config_info")

    run = common.base_run(job, "server", args)
    workload = dict(job["workload"])
    workload["num_gpu_blocks_source"] = source
    workload.update(common.warmup_fields(rec["warmup"]))
    workload["front_end_pinning"] = pinning
    workload["host_load"] = rec["host_load"]
    if warmup_rows:
        workload["warmup_steps"] = {k: [r[k] for r in warmup_rows]
                                    for k in ("ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens", "elapsed_ms")}
    if rec["probe"] is not None:
        workload["speed_probe"] = rec["probe"]
    if rec.get("host_witness") is not None:
        workload["host_witness"] = rec["host_witness"]
    workload.update(common.engine_start_field(pass_no, passes))
    kv = common.KV_SIZE_RE.search(full_log)
    if kv:
        # The start-up line "KV cache size: N tokens" counts every block, the null block included, as requests of
        # max_model_len tokens (common.logged_kv_tokens).
        logged = int(kv.group(1).replace(",", ""))
        workload["kv_cache_size_tokens_logged"] = logged
        expected = common.logged_kv_tokens(num_gpu_blocks, block_size, engine["max_model_len"])
        if logged != expected:
            raise RuntimeError(f"start-up log says {logged} KV tokens, not the {expected} of {num_gpu_blocks} blocks "
                               f"x {block_size} at max_model_len {engine['max_model_len']}")
    run.update(
        {
            "block_size": block_size,
            "num_gpu_blocks": num_gpu_blocks,
            "max_num_batched_tokens": engine["max_num_batched_tokens"],
            "max_num_seqs": engine["max_num_seqs"],
            "max_model_len": engine["max_model_len"],
            "enable_chunked_prefill": engine["enable_chunked_prefill"],
            "enable_prefix_caching": cache_info.get("enable_prefix_caching", str(engine["enable_prefix_caching"])) == "True",
            "engine_args": args,
            "metrics_delta": common.delta(rec["after"], rec["before"]),
            "workload": workload,
        }
    )
    common.write_run(Path(out_dir), run, rec["requests"], iterations)
