"""What both recording modes share: engine arguments, the iteration-log and Prometheus parsers, the run writer,
keeping the front end off the model's cores (``pin_front_end``) and the machine's speed probe (``speed_probe``).

Standalone like ``_vllm_worker.py`` (standard library only; ``speed_probe`` imports torch when called, which the
vLLM environment has): the worker imports it as a sibling file when it runs in the vLLM environment, and twin
imports it as ``twin.calibration._vllm_common`` (tests).
"""

from __future__ import annotations

import csv
import importlib.metadata as _md
import json
import os
import platform
import re
import time
from pathlib import Path

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


def logged_kv_tokens(num_gpu_blocks: int, block_size: int, max_model_len: int) -> int:
    """The token count vLLM's start-up line "KV cache size: N tokens" states for a model with one full-attention
    KV group: the requests of ``max_model_len`` the blocks hold (each takes ceil(max_model_len / block_size) blocks),
    times ``max_model_len`` (``vllm.v1.core.kv_cache_utils.get_kv_cache_capacity``). It is ``num_gpu_blocks x
    block_size`` only where ``max_model_len`` is a multiple of the block size: 341 blocks of 128 at 2,112 tokens a
    request log 42,364 tokens, not 43,648."""
    blocks_per_request = -(-max_model_len // block_size)
    return int(num_gpu_blocks / blocks_per_request * max_model_len)


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


TORCH_DTYPES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                "auto": "bfloat16"}  # vLLM's --dtype spellings -> torch's (the CPU backend's auto is bf16)


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return fh.read()
    except OSError:
        return ""


def cpu_flags(info: str | None = None) -> set[str]:
    """The CPU's feature flags (the first ``flags`` line of ``/proc/cpuinfo``, or of ``info``); empty where there is
    none (off Linux, or an Arm CPU, whose lines are ``Features``)."""
    m = re.search(r"^flags\s*:(.*)$", _cpuinfo() if info is None else info, re.MULTILINE)
    return set(m.group(1).split()) if m else set()


def bf16_without_avx512(dtype: str, flags: set[str] | None = None) -> bool:
    """Whether ``dtype`` runs bf16 on an x86 CPU that has AVX2 but no AVX-512. There torch has no vector path for
    bf16 matrix products: on a 2-core AMD EPYC (Zen 3) VM a 16x256 by 256x1024 product took 7.3 ms in bf16 and
    0.15 ms in float32, and ``cpu-tiny-llama``'s decode steps of 33-48 requests 149 ms in bf16 and 22 ms in float32
    (docs/calibration.md, "Hosts without AVX-512")."""
    flags = cpu_flags() if flags is None else flags
    return TORCH_DTYPES.get(dtype, dtype) == "bfloat16" and "avx2" in flags and "avx512f" not in flags


def hardware_string(info: str | None = None) -> str:
    info = _cpuinfo() if info is None else info
    flags = cpu_flags(info)
    model = re.search(r"model name\s*:\s*(.*)", info)
    name = model.group(1).strip() if model else "cpu"
    isa = " avx512" if "avx512f" in flags else " avx2" if "avx2" in flags else ""
    return f"cpu {os.cpu_count()}-core {platform.machine()}{isa} ({name})"


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


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (the server and the engine processes it started)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    out.append(int(name))
            except OSError:
                continue
    return sorted(out)


def _bound_cpus(pgid: int) -> tuple[set[int], list[int], list[tuple[int, int, set[int]]], set[int]]:
    """``(allowed, pids, threads, bound)``: the CPUs this process may use, the group's processes, each of their
    threads as ``(pid, tid, affinity)``, and the CPUs of the threads bound to fewer than all (the model's cores)."""
    allowed = set(os.sched_getaffinity(0))
    threads: list[tuple[int, int, set[int]]] = []
    pids = _group_pids(pgid)
    for pid in pids:
        for tid in _threads(pid):
            try:
                threads.append((pid, tid, set(os.sched_getaffinity(tid))))
            except OSError:
                continue
    bound = set().union(*(aff for _, _, aff in threads if aff < allowed)) if threads else set()
    return allowed, pids, threads, bound


def engine_cpus(pgid: int) -> list[int]:
    """The CPUs the engine's bound threads (its model workers) run on; empty when none is bound."""
    return sorted(_bound_cpus(pgid)[3])


def _cpu_busy_s() -> dict[int, float]:
    """Each CPU's busy seconds since boot (``/proc/stat``: every column but idle and iowait); empty off Linux."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *cols = line.split()
                if name.startswith("cpu") and name[3:].isdigit():
                    v = [int(c) for c in cols[:8]]  # user nice system idle iowait irq softirq steal
                    out[int(name[3:])] = (sum(v) - v[3] - v[4]) / tick
    except OSError:
        return {}
    return out


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first); empty if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _process_cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds of ``pids`` (all their threads), from ``/proc/<pid>/stat``; gone pids count 0."""
    ticks = 0
    for pid in pids:
        cols = _stat(pid)
        ticks += int(cols[11]) + int(cols[12]) if len(cols) > 12 else 0
    return ticks / os.sysconf("SC_CLK_TCK")


def load_snapshot(pgid: int) -> dict:
    """What ``load_during`` compares: the CPUs' busy seconds and the CPU seconds of the engine's process group and of
    this process (the client; offline, the group's leader)."""
    own = _process_cpu_s(sorted({*_group_pids(pgid), os.getpid()}))
    return {"t": time.monotonic(), "busy": _cpu_busy_s(), "own": own}


def load_during(before: dict, after: dict) -> dict:
    """The machine's load over a run, from two ``load_snapshot``s: each CPU's busy share of the wall time
    (``busy_share``), the share of one core the engine's processes and the client used (``own_cores``), and what the
    rest of the machine used (``other_cores``: every CPU's busy time less the recording's own, in cores; the kernel's
    work on the recording's behalf lands there too, a few hundredths here). A process busy beside a server
    recording slows its steps ~2x (docs/calibration-sessions.md, "The engine core's core"); this says whether one
    was."""
    wall = after["t"] - before["t"]
    if wall <= 0 or not before["busy"] or set(before["busy"]) != set(after["busy"]):
        return {"wall_s": _r6(max(wall, 0.0)), "error": "no per-CPU times (/proc/stat)"}
    busy = {c: after["busy"][c] - before["busy"][c] for c in sorted(before["busy"])}
    own = after["own"] - before["own"]
    return {"wall_s": _r6(wall), "busy_share": {str(c): round(b / wall, 3) for c, b in busy.items()},
            "own_cores": round(own / wall, 3), "other_cores": round(max(sum(busy.values()) - own, 0.0) / wall, 3)}


PROBE_TRIALS = 21
PROBE_LAYERS = 24


def speed_probe(cpus: list[int], dtype: str = "bfloat16") -> dict:
    """How fast this machine runs right now, on the model's cores: the median and the least seconds of
    ``PROBE_TRIALS`` trials of a fixed workload in the engine's ``dtype`` shaped like a small decode step
    (``PROBE_LAYERS`` of two matrix products, a gated activation and a norm on 16 rows of 256), on one thread bound
    to ``cpus``, with the engine idle. On a shared VM the host's other tenants move the engine's speed by up to
    ~1.5x between recordings minutes apart, without load or steal time to show it (docs/calibration-sessions.md,
    "Pinning the front end"); this measures it beside each run. Needs torch (the vLLM environment); the calling
    thread's affinity and torch's thread count are restored afterwards."""
    import torch

    before = os.sched_getaffinity(0)
    n_threads = torch.get_num_threads()
    try:
        if cpus:
            os.sched_setaffinity(0, set(cpus))
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        dt = getattr(torch, TORCH_DTYPES.get(dtype, dtype))
        x = torch.randn(16, 256, generator=g).to(dt)
        w1 = torch.randn(256, 1024, generator=g).to(dt) * 0.05
        w2 = torch.randn(512, 256, generator=g).to(dt) * 0.05

        def trial() -> None:
            h = x
            for _ in range(PROBE_LAYERS):
                a = h @ w1
                a = torch.nn.functional.silu(a[:, :512]) * a[:, 512:]
                h = a @ w2
                h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(h.dtype)

        trial()  # first-call costs out of the measurement
        times = []
        for _ in range(PROBE_TRIALS):
            t0 = time.perf_counter()
            trial()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(n_threads)
        os.sched_setaffinity(0, before)
    times.sort()
    return {"cpus": sorted(cpus), "median_s": _r6(times[len(times) // 2]), "min_s": _r6(times[0]),
            "trials": len(times), "dtype": str(dt).removeprefix("torch.")}


def probe_or_error(cpus: list[int], dtype: str = "bfloat16") -> dict:
    """``speed_probe``, or what went wrong: a probe never fails a recording."""
    try:
        return speed_probe(cpus, dtype)
    except Exception as exc:  # noqa: BLE001 - recorded in run.json instead
        return {"error": f"{type(exc).__name__}: {exc}"}


WITNESS_PERIOD_S = 0.5
WITNESS_BUFFER_MB = 32
# The witness process: one sum over a buffer larger than the core's caches every period, timed by the clock and by
# the process's own CPU time (which leaves out any time the front end's threads held the core); one line per sample
# ("<monotonic start> <seconds> <CPU seconds>"), until its parent is gone or it is stopped. numpy: the vLLM
# environment has it.
_WITNESS_CODE = """
import os, sys, time
import numpy as np
period, mb, cpus, out, parent = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], os.getppid()
os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
a = np.ones(mb * 1024 * 1024 // 8)
a.sum()
with open(out, "w", buffering=1) as f:
    while os.getppid() == parent:
        t, c = time.monotonic(), time.thread_time()
        a.sum()
        e, ec = time.monotonic() - t, time.thread_time() - c
        f.write(f"{t:.6f} {e:.7f} {ec:.7f}\\n")
        time.sleep(max(period - e, 0.01))
"""


class HostWitness:
    """The host's speed while a run is served, sampled beside the engine rather than before and after it.

    On a shared VM a run's steps move by up to ~1.4x within seconds with the host's speed for work that leaves the
    core's caches (the model's weights, the engine's dispatch), which ``speed_probe``'s cache-resident product
    hardly sees; a sum over ``WITNESS_BUFFER_MB`` MB on a core the engine's model does not use, every
    ``WITNESS_PERIOD_S`` s (~2 ms of ~500: it does not load the front end's core), followed the level of an offline
    run's decode steps over twelve passes at a correlation of 0.78 where the speed probe's was 0.30
    (docs/calibration-sessions.md, "What moves a run's level"). ``start`` launches the sampling process (``python``:
    the vLLM environment's, which has numpy) on the CPUs this process may use less ``engine_cpus``, in process group
    ``pgid`` (None: this process's) so a recording's load snapshot counts it as the recording's own; ``result``
    stops it and returns the samples within a window of ``time.monotonic()``, for run.json. A witness never fails a
    recording: what went wrong is returned instead (``{"error": ...}``)."""

    def __init__(self, python: str, engine_cpus: list[int], scratch: Path, pgid: int | None = None) -> None:
        self.cpus = sorted(set(os.sched_getaffinity(0)) - set(engine_cpus))
        self.path = Path(scratch) / f"host-witness-{os.getpid()}-{time.monotonic_ns()}.txt"
        self.proc = None
        self.error: str | None = None
        if not engine_cpus or not self.cpus:
            self.error = "no CPU free of the engine's model workers"
            return
        import subprocess

        try:
            self.proc = subprocess.Popen(
                [python, "-c", _WITNESS_CODE, str(WITNESS_PERIOD_S), str(WITNESS_BUFFER_MB),
                 ",".join(map(str, self.cpus)), str(self.path)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                **({} if pgid is None else {"process_group": pgid}))
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def result(self, t0: float, t1: float) -> dict:
        """Stop sampling; the samples that started within ``[t0, t1]`` (``time.monotonic()``), as seconds from
        ``t0`` and milliseconds taken, with their median."""
        if self.proc is None:
            return {"error": self.error}
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
        except Exception:  # noqa: BLE001 - a witness never fails a recording
            self.proc.kill()
            err = b""
        try:
            lines = self.path.read_text().split("\n")
            self.path.unlink()
        except OSError:
            lines = []
        samples = []
        for line in lines:
            cols = line.split()
            if len(cols) == 3 and t0 <= float(cols[0]) <= t1:
                samples.append((float(cols[0]) - t0, float(cols[1]) * 1e3, float(cols[2]) * 1e3))
        if not samples:
            tail = (err or b"").decode(errors="replace").strip().splitlines()[-1:]
            return {"error": "no samples during the run" + (f" ({tail[0]})" if tail else "")}
        ms, cpu_ms = sorted(s[1] for s in samples), sorted(s[2] for s in samples)
        return {"cpus": self.cpus, "period_s": WITNESS_PERIOD_S, "buffer_mb": WITNESS_BUFFER_MB,
                "median_ms": round(ms[len(ms) // 2], 4), "median_cpu_ms": round(cpu_ms[len(cpu_ms) // 2], 4),
                "samples": len(samples), "t_s": [round(s[0], 3) for s in samples],
                "ms": [round(s[1], 4) for s in samples], "cpu_ms": [round(s[2], 4) for s in samples]}


def _parent_pid(pid: int) -> int | None:
    cols = _stat(pid)
    return int(cols[1]) if len(cols) > 1 else None


def _engine_core_pids(pids: list[int], threads: list[tuple[int, int, set[int]]], allowed: set[int]) -> list[int]:
    """The group's engine core: the processes that started a model worker (a process with a thread bound to fewer
    than all CPUs) and bind none of their own threads. vLLM's multiprocess executor runs the CPU worker as a child of
    the engine core process; where the worker runs inside the engine core there is none."""
    workers = {pid for pid, _, aff in threads if aff < allowed}
    parents = {_parent_pid(p) for p in workers}
    return sorted(p for p in pids if p in parents and p not in workers)


ENGINE_CORE_PLACES = ("front-end", "model")


def pin_front_end(pgid: int, *, engine_core: str = "front-end") -> dict:
    """Keep the API server, this client and (``engine_core="front-end"``) the engine core off the cores the model
    runs on.

    vLLM's CPU worker binds its threads to its cores (``VLLM_CPU_OMP_THREADS_BIND``, e.g. core 0 of 2) and
    reserves the rest "for the scheduler", but nothing binds the other processes: on a small machine the API
    server, the engine core and the client are scheduled onto the model's core too, so a step that runs while a
    request arrives takes longer and a whole run's steps move with the machine's load (docs/calibration-sessions.md,
    "Pinning the front end"). Every thread of process group ``pgid`` (the engine's processes) that may run on
    every CPU, and every thread of this process (the client), is bound to the CPUs that no bound thread uses;
    threads started later inherit it. With ``engine_core="model"`` the engine core's threads (``_engine_core_pids``)
    are bound to the model's CPUs instead, so that the front end's load on its cores does not reach the engine's
    step times (the engine core waits on the worker's output in a busy loop, on whichever core it runs on;
    docs/calibration-sessions.md, "The engine core's core"). Nothing is done (``pinned`` false) when no thread is
    bound or no CPU is left over. Returns what was done, for run.json."""
    if engine_core not in ENGINE_CORE_PLACES:
        raise ValueError(f"engine_core must be one of {ENGINE_CORE_PLACES}, not {engine_core!r}")
    allowed, pids, threads, bound = _bound_cpus(pgid)
    free = sorted(allowed - bound)
    info = {"pinned": False, "engine_cpus": sorted(bound), "front_end_cpus": free, "processes": len(pids),
            "threads": len(threads)}
    if not bound or not free:
        return info
    core_pids = _engine_core_pids(pids, threads, allowed) if engine_core == "model" else []
    core_tids = {tid for pid, tid, _ in threads if pid in core_pids}
    moved = 0
    for tid, aff in [(t, a) for _, t, a in threads] + [(t, allowed) for t in _threads(os.getpid())]:
        if aff == allowed:
            try:
                os.sched_setaffinity(tid, bound if tid in core_tids else free)
                moved += 1
            except OSError:
                continue
    info.update(pinned=True, threads_pinned=moved, engine_core=engine_core)
    if engine_core == "model":
        info.update(engine_core_pids=core_pids, engine_core_threads=len(core_tids))
    return info


# ------------------------------------------------------------------------------------------ warm-up
# Token ids of the warm-up's prompts: the Llama special tokens, which no workload prompt uses (workloads.py's
# FIRST_TOKEN_ID is 3), so no block the warm-up leaves in the prefix cache can match a block of the run.
WARMUP_IDS = (1, 2)


def prefill_warmup_requests(engine: dict, block_size: int, num_blocks: int | None) -> list[list[dict]]:
    """The prefill part of the warm-up: waves of requests, each wave sent together after the previous one ended.

    A fresh engine runs its first long prefill slow as well as its first decode batch sizes: in the server
    recordings of 2026-11-29 (late) to 2026-12-02 a run's first step of 256+ prefill tokens took 1.3-2.1x the
    server fit (each session's median) and its later ones ~1.0x (docs/calibration-sessions.md, "The first long
    prefill of a fresh server"), and an offline ``LLM``'s 1.3-3.6x the offline fit; one-token warm-up requests never
    reach that path. So the warm-up also sends
    (1) one prompt as long as the engine admits (``max_model_len`` - 2 tokens, chunked at the budget where it is
        longer), the largest prefill step the run can make;
    (2) two prompts at once: one that hits (1)'s cached blocks for half its length and computes the rest after them
        (prefill attending to cached context), and one of the same new length from nothing, so one step holds two
        prefills, one of them behind a cached prefix.
    Prompts are made of ``WARMUP_IDS`` only; each asks for 2 tokens (one decode at a long context). With
    ``num_gpu_blocks_override`` the prompts shrink to fit the blocks with one to spare, and (2) is left out where
    both cannot be resident at once; nothing is sent where not even one block's prompt fits.
    """
    first, second = WARMUP_IDS
    room = engine["max_model_len"] - 2
    if num_blocks is not None:
        room = min(room, (num_blocks - 1) * block_size - 2)
    if room < block_size:
        return []
    waves = [[{"request_id": "warmup-prefill-0", "arrival_s": 0.0, "prompt_token_ids": [first] * room,
               "max_tokens": 2}]]
    cached = (room // 2) // block_size * block_size
    new = room - cached
    blocks_needed = -(-(room + 2) // block_size) + -(-(new + 2) // block_size)
    if cached >= block_size and new > 0 and (num_blocks is None or blocks_needed <= num_blocks - 1):
        waves.append([
            {"request_id": "warmup-prefill-1", "arrival_s": 0.0, "prompt_token_ids": [first] * cached + [second] * new,
             "max_tokens": 2},
            {"request_id": "warmup-prefill-2", "arrival_s": 0.0, "prompt_token_ids": [second] * new, "max_tokens": 2},
        ])
    return waves


def decode_warmup_requests(engine: dict, block_size: int) -> list[dict]:
    """The decode part of the warm-up: ``n`` one-token prompts asking for 1..n tokens, sent together.

    They decode at every batch size from n down to 1 (a decode step at a batch size not yet seen ran 1.3-1.6x
    slower on a fresh engine). The prompt is ``WARMUP_IDS[0]``; each request stays inside one KV block (n <
    block size), which is never full, so nothing is hashed into the prefix cache; n fits the block count, so
    none is preempted.
    """
    n = min(engine["max_num_seqs"], block_size - 1)
    if engine.get("num_gpu_blocks_override"):
        n = min(n, int(engine["num_gpu_blocks_override"]) - 1)  # one block each, none preempted
    n = max(n, 1)
    return [{"request_id": f"warmup-{i}", "arrival_s": 0.0, "prompt_token_ids": [WARMUP_IDS[0]], "max_tokens": i + 1}
            for i in range(n)]


def rehearsal_requests(requests: list[dict], max_tokens: int = 4) -> list[dict]:
    """The offline run's opening, rehearsed: the run's own requests, sent together, with prompts of the same lengths
    made of ``WARMUP_IDS`` and at most ``max_tokens`` tokens each.

    An offline run starts with every request at once, so its first steps (a prefill of up to the whole budget over
    as many prompts as fit, then the largest decode batch) are its largest, and a fresh engine runs a step of a
    size it has not run yet slow: without a warm-up the first step of an offline run took 1.5-3.3x the later steps'
    level, and after the long prompts of :func:`prefill_warmup_requests` still 1.5-2.1x where it held 46 prompts
    (docs/calibration-sessions.md, "An offline warm-up"). Each prompt starts with a tag unique to it (``WARMUP_IDS[1]``,
    ``WARMUP_IDS[0]``, then its index in 16 binary digits of the two ids) and is filled with ``WARMUP_IDS[0]``, so
    no two share a block, none shares a block with the long prompts (whose first blocks are all one id) and none
    with the run (whose ids start at 3).
    """
    if len(requests) >= 1 << 16:
        raise ValueError(f"{len(requests)} requests: the rehearsal's tags are 16 binary digits")
    one, two = WARMUP_IDS
    out = []
    for j, r in enumerate(requests):
        n = len(r["prompt_token_ids"])
        tag = [two, one] + [WARMUP_IDS[(j >> b) & 1] for b in range(16)]
        out.append({"request_id": f"warmup-rehearsal-{j}", "arrival_s": 0.0, "prompt_token_ids": (tag + [one] * n)[:n],
                    "max_tokens": min(int(r["max_tokens"]), max_tokens)})
    return out


def warmup_plan(engine: dict, block_size: int, num_blocks: int | None,
                prefill: bool = True) -> tuple[list[dict], list[list[dict]]]:
    """What the recorder serves before a measured run, in either mode: the decode wave, then (with ``prefill``)
    the prefill waves; each wave is sent together after the previous one has finished. (Offline mode then
    rehearses the run's opening, :func:`rehearsal_requests`.)"""
    waves = prefill_warmup_requests(engine, block_size, num_blocks) if prefill else []
    return decode_warmup_requests(engine, block_size), waves


def warmup_summary(decode: list[dict], waves: list[list[dict]], rehearsal: list[dict] | None = None) -> dict:
    """``run.json`` ``workload.warmup``: ``decode_requests`` (n), ``prefill_prompt_tokens`` (per wave, each
    prompt's length) and, offline, ``rehearsal_requests`` (how many requests rehearsed the run's opening)."""
    out = {"decode_requests": len(decode),
           "prefill_prompt_tokens": [[len(r["prompt_token_ids"]) for r in w] for w in waves]}
    if rehearsal is not None:
        out["rehearsal_requests"] = len(rehearsal)
    return out


def warmup_fields(warmup: dict) -> dict:
    """The workload fields a run records of its warm-up (``warmup_requests``: how many requests it served)."""
    served = warmup["decode_requests"] + sum(len(w) for w in warmup["prefill_prompt_tokens"])
    return {"warmup_requests": served + warmup.get("rehearsal_requests", 0), "warmup": warmup}


def out_dirs(job: dict) -> list[str]:
    """The run folders a job writes, one per pass of its workload through one engine start (``job["out_dirs"]``;
    a job without it writes one run to ``job["out_dir"]``)."""
    return list(job.get("out_dirs") or [job["out_dir"]])


def engine_start_field(k: int, passes: int) -> dict:
    """The workload field that marks pass ``k`` of ``passes`` through one engine start (none for a run that had its
    engine to itself, so such runs' run.json is as before): ``twin record --repeats``."""
    return {} if passes == 1 else {"engine_start": {"pass": k, "passes": passes}}
