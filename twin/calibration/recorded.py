"""Read a recorded real-engine run (format ``twin-recorded-run/1``, see recorded-run-format.md).

    from twin.calibration.recorded import load_recorded_run
    rec = load_recorded_run("tests/fixtures/recorded/offline-mixed")
    rec.run.num_gpu_blocks          # run.json, validated (pydantic, frozen, unknown keys rejected)
    rec.requests[0].token_times_s   # requests.jsonl, one frozen RecordedRequest per line, in send order
    rec.iterations.ctx_tokens       # iterations.csv, one numpy array per column (None if the file is absent)

Field names are exactly the format's names. The reader checks the format, not the engine's behaviour:
types, required keys and columns, unique request ids, ``output_tokens == len(token_times_s)``,
``output_tokens <= max_tokens``, offline arrivals at 0, non-decreasing token times, and step numbers 0..n-1.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from twin.engine_settings import cpu_hardware

FORMAT = "twin-recorded-run/1"
ITERATION_COLUMNS: tuple[str, ...] = (
    "step",
    "ctx_requests",
    "ctx_tokens",
    "gen_requests",
    "gen_tokens",
    "elapsed_ms",
    "kv_usage_pct",
)
REQUEST_KEYS: tuple[str, ...] = (
    "request_id",
    "arrival_s",
    "prompt_token_ids",
    "max_tokens",
    "output_tokens",
    "token_times_s",
    "e2e_s",
    "num_cached_tokens",
)


class RecordedRunError(ValueError):
    """A recorded-run folder does not follow the format; the message names the file and the field."""


class RunInfo(BaseModel):
    """``run.json``: engine configuration and run facts.

    Every key is the format's own name, except that ``model_config`` (a name pydantic reserves) is the
    attribute ``model_config_``; it is still read from and written to the ``model_config`` key.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), populate_by_name=True)

    format: Literal["twin-recorded-run/1"]
    engine: str
    engine_version: str
    hardware: str
    mode: Literal["offline", "server"]
    model_config_: dict[str, Any] = Field(alias="model_config")
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int = Field(ge=1)
    block_size: int = Field(ge=1)
    num_gpu_blocks: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    engine_args: list[str]
    metrics_delta: dict[str, int | float] | None
    workload: dict[str, Any]

    @property
    def async_scheduling(self) -> bool:
        """Whether the engine formed each step while the one before it ran (vLLM's ``async_scheduling``,
        ../shared/reference/vllm-engine-semantics.md §2.12): the run's own ``--async-scheduling`` or
        ``--no-async-scheduling`` in ``engine_args`` where given (the last one wins, as on vLLM's command line); else
        off on a CPU (``hardware`` beginning with "cpu": vLLM's CPU backend forces it off) and on elsewhere (vLLM's
        GPU default)."""
        for a in reversed(self.engine_args):
            flag, _, value = a.partition("=")
            if flag == "--no-async-scheduling":
                return False
            if flag == "--async-scheduling":
                return value.lower() not in ("false", "0", "no") if value else True
        return not cpu_hardware(self.hardware)

    @property
    def usable_blocks(self) -> int:
        """KV blocks a request can use: vLLM keeps one block (the null block) for itself."""
        return self.num_gpu_blocks - 1


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One line of ``requests.jsonl``."""

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    output_tokens: int
    token_times_s: tuple[float, ...] | None
    e2e_s: float | None
    num_cached_tokens: int | None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None


@dataclass(frozen=True, slots=True)
class Iterations:
    """``iterations.csv``: one numpy array per column, one entry per engine step."""

    step: np.ndarray
    ctx_requests: np.ndarray
    ctx_tokens: np.ndarray
    gen_requests: np.ndarray
    gen_tokens: np.ndarray
    elapsed_ms: np.ndarray
    kv_usage_pct: np.ndarray

    def __len__(self) -> int:
        return int(self.step.shape[0])

    def composition(self) -> list[tuple[int, int, int, int]]:
        """The machine-independent part: ``(ctx_requests, ctx_tokens, gen_requests, gen_tokens)`` per step."""
        return list(
            zip(
                self.ctx_requests.tolist(),
                self.ctx_tokens.tolist(),
                self.gen_requests.tolist(),
                self.gen_tokens.tolist(),
                strict=True,
            )
        )


@dataclass(frozen=True, slots=True)
class RecordedRun:
    """A whole recorded-run folder."""

    path: Path
    run: RunInfo
    requests: tuple[RecordedRequest, ...]
    iterations: Iterations | None

    def metric(self, name: str) -> int | float | None:
        """A counter from ``metrics_delta`` (e.g. ``num_preemptions``), or None if not recorded."""
        if self.run.metrics_delta is None:
            return None
        return self.run.metrics_delta.get(name)

    def summary(self) -> str:
        steps = "no iterations" if self.iterations is None else f"{len(self.iterations)} steps"
        return (
            f"{self.path.name}: {self.run.mode}, {len(self.requests)} requests, {steps}, "
            f"num_gpu_blocks {self.run.num_gpu_blocks}, preemptions {self.metric('num_preemptions')}, "
            f"prefix hits {self.metric('prefix_cache_hits')}/{self.metric('prefix_cache_queries')} tokens"
            + ("" if self.other_load_cores is None else f", other processes {self.other_load_cores:.2f} cores")
        )

    @property
    def other_load_cores(self) -> float | None:
        """The rest of the machine's load during the run, in cores (``workload.host_load.other_cores``, which the
        recorder measures since 2026-12-07); None where not recorded."""
        load = (self.run.workload or {}).get("host_load") or {}
        value = load.get("other_cores")
        return float(value) if isinstance(value, (int, float)) else None


def _fail(path: Path, msg: str) -> RecordedRunError:
    return RecordedRunError(f"{path}: {msg}")


def _request(path: Path, lineno: int, obj: Any, mode: str) -> RecordedRequest:
    where = f"{path.name} line {lineno}"
    if not isinstance(obj, dict):
        raise _fail(path, f"{where}: not a JSON object")
    missing = [k for k in REQUEST_KEYS if k not in obj]
    extra = sorted(set(obj) - set(REQUEST_KEYS))
    if missing or extra:
        raise _fail(path, f"{where}: missing keys {missing}, unknown keys {extra}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if not isinstance(obj["request_id"], str):
        raise _fail(path, f"{where}: request_id must be a string")
    if not is_num(obj["arrival_s"]) or obj["arrival_s"] < 0:
        raise _fail(path, f"{where}: arrival_s must be a number >= 0")
    if mode == "offline" and obj["arrival_s"] != 0:
        raise _fail(path, f"{where}: offline runs have arrival_s 0.0")
    ids = obj["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(is_int(t) for t in ids):
        raise _fail(path, f"{where}: prompt_token_ids must be a non-empty list of ints")
    for key in ("max_tokens", "output_tokens"):
        if not is_int(obj[key]) or obj[key] < 0:
            raise _fail(path, f"{where}: {key} must be an int >= 0")
    if obj["output_tokens"] > obj["max_tokens"]:
        raise _fail(path, f"{where}: output_tokens {obj['output_tokens']} > max_tokens {obj['max_tokens']}")
    times = obj["token_times_s"]
    if times is not None:
        if not isinstance(times, list) or not all(is_num(t) for t in times):
            raise _fail(path, f"{where}: token_times_s must be a list of numbers or null")
        if len(times) != obj["output_tokens"]:
            raise _fail(path, f"{where}: {len(times)} token_times_s for output_tokens {obj['output_tokens']}")
        if any(b < a for a, b in zip(times, times[1:], strict=False)) or (times and times[0] < 0):
            raise _fail(path, f"{where}: token_times_s must be >= 0 and non-decreasing")
    if obj["e2e_s"] is not None and not is_num(obj["e2e_s"]):
        raise _fail(path, f"{where}: e2e_s must be a number or null")
    if obj["num_cached_tokens"] is not None and not is_int(obj["num_cached_tokens"]):
        raise _fail(path, f"{where}: num_cached_tokens must be an int or null")
    return RecordedRequest(
        request_id=obj["request_id"],
        arrival_s=float(obj["arrival_s"]),
        prompt_token_ids=tuple(ids),
        max_tokens=obj["max_tokens"],
        output_tokens=obj["output_tokens"],
        token_times_s=None if times is None else tuple(float(t) for t in times),
        e2e_s=None if obj["e2e_s"] is None else float(obj["e2e_s"]),
        num_cached_tokens=obj["num_cached_tokens"],
    )


def _iterations(path: Path) -> Iterations:
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or tuple(header) != ITERATION_COLUMNS:
            raise _fail(path, f"header must be {','.join(ITERATION_COLUMNS)}, got {header}")
        rows = list(reader)
    cols: dict[str, np.ndarray] = {}
    try:
        for j, name in enumerate(ITERATION_COLUMNS):
            values = [r[j] for r in rows]
            if name in ("elapsed_ms", "kv_usage_pct"):
                cols[name] = np.asarray([float(v) for v in values], dtype=float)
            else:
                cols[name] = np.asarray([int(v) for v in values], dtype=np.int64)
    except (ValueError, IndexError) as exc:
        raise _fail(path, f"bad row: {exc}") from exc
    if not np.array_equal(cols["step"], np.arange(len(rows))):
        raise _fail(path, "step must number the rows 0..n-1")
    for name in ITERATION_COLUMNS[1:]:
        if (cols[name] < 0).any():
            raise _fail(path, f"{name} has negative values")
    return Iterations(**cols)


def load_recorded_run(path: str | Path) -> RecordedRun:
    """Read and check a recorded-run folder; raises :class:`RecordedRunError` naming the problem."""
    path = Path(path)
    run_path = path / "run.json"
    if not run_path.is_file():
        raise _fail(path, "no run.json")
    try:
        run = RunInfo.model_validate(json.loads(run_path.read_text()))
    except (ValueError, json.JSONDecodeError) as exc:  # pydantic's ValidationError is a ValueError
        raise _fail(run_path, str(exc)) from exc
    req_path = path / "requests.jsonl"
    if not req_path.is_file():
        raise _fail(path, "no requests.jsonl")
    requests = []
    with open(req_path) as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _fail(req_path, f"line {lineno}: {exc}") from exc
            requests.append(_request(req_path, lineno, obj, run.mode))
    if not requests:
        raise _fail(req_path, "no requests")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise _fail(req_path, "request_id values are not unique")
    it_path = path / "iterations.csv"
    iterations = _iterations(it_path) if it_path.is_file() else None
    return RecordedRun(path=path, run=run, requests=tuple(requests), iterations=iterations)
