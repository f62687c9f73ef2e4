"""Replay of the public LLM-serving traces in ``shared/traces/`` as twin workloads.

``trace_requests(TraceWorkload(trace="azure-conv"), seed=0, replication=0)`` returns the trace's requests
as ``RequestSpec`` values, ready for the same client process as a synthetic workload. What each trace
gives twin, and the exact rules for windows, time scaling and rate multiplication, are in
``docs/traces.md``; the short version:

* arrival times come from the trace (seconds since the trace's first request), optionally jittered
  inside the trace's timestamp quantum, cut to a window ``[start_s, start_s + duration_s)``, then
  made relative to the first kept arrival (which is at 0.0) and multiplied by ``time_scale``;
* ``rate_multiplier = m`` takes ``ceil(m)`` copies of the window: copy 0 unshifted, copy k >= 1
  rotated cyclically by an offset drawn uniformly over the window; the first ``floor(m)`` copies are
  kept whole and the last, if ``m`` is not an integer, is thinned to ``m - floor(m)``;
* prompts are content (virtual segments): Mooncake ``hash_ids`` become one 512-token segment each and
  RAGPulse component ids one segment each, so requests that share ids share real prefix blocks in
  twin's prefix cache; traces without content identity get one unique segment per request.

The module imports neither ``twin.scenario`` nor ``twin.models.workload`` at import time, so the
scenario schema can import ``TraceWorkload`` from here without a cycle.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from twin.paths import shared_dir
from twin.rng import stable_hash, stream

if TYPE_CHECKING:
    from twin.models.workload import RequestSpec

TraceName = Literal[
    "azure-conv", "azure-code", "mooncake-conversation", "mooncake-synthetic", "burstgpt-1", "burstgpt-3", "ragpulse"
]
TRACE_NAMES: tuple[str, ...] = TraceName.__args__  # type: ignore[attr-defined]

MOONCAKE_BLOCK_TOKENS = 512  # SOURCES.md: hash_ids are chained hashes of 512-token blocks
RAGPULSE_COMPONENTS = ("sys_prompt", "passages_ids", "history", "web_search", "user_input")  # the trace's key order
_RAGPULSE_FILES = {"sys_prompt": ("1_sys_prompt.jsonl", "sys_prompt_id"),
                   "passages_ids": ("2_passages.jsonl", "passage_id"),
                   "history": ("3_history.jsonl", "history_id"),
                   "user_input": ("4_user_input.jsonl", "user_input_id"),
                   "web_search": ("5_web_search.jsonl", "web_search_id")}


class TraceWorkload(BaseModel):
    """A window of a real public trace, replayed request by request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["trace"] = "trace"
    trace: TraceName
    time_scale: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0  # 0.5: the trace plays twice as fast
    rate_multiplier: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0  # see the module docstring
    start_s: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0  # trace seconds after its first request
    duration_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None  # trace seconds; None: to the end
    max_requests: Annotated[int, Field(gt=0)] | None = None  # keep the first N arrivals after all the above
    max_tokens_cap: Annotated[int, Field(gt=0)] | None = None  # client max_tokens; None: the trace's output length
    jitter_within_quantum: bool = True  # spread arrivals uniformly inside the trace's timestamp resolution
    copies_share_prefixes: bool = False  # rate_multiplier > 1: copies reuse copy 0's segment ids


# ---- loading ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TraceTable:
    """One trace as published, sorted by arrival (stable): raw lengths, no clamping."""

    name: str
    t_s: np.ndarray  # float64, seconds since the trace's first request
    prompt_tokens: np.ndarray  # int64, as published (may be 0)
    output_tokens: np.ndarray  # int64, as published (may be 0)
    # per row, the prompt's pieces that have an identity in the trace, as ("seg", (segment id, tokens)) pieces
    # trimmed to max(prompt_tokens, 1); None for traces without content identity
    segments: tuple[tuple[tuple[str, tuple[int, int]], ...], ...] | None
    segment_tokens: np.ndarray  # int64, tokens covered by ``segments`` per row (0 without segments)
    quantum_s: float  # timestamp resolution of the published file


_CACHE: dict[tuple[str, tuple[tuple[str, int], ...]], TraceTable] = {}


def trace_files(name: str) -> list[Path]:
    root = shared_dir() / "traces"
    if name in ("azure-conv", "azure-code"):
        return [root / "azure-llm-2023" / f"AzureLLMInferenceTrace_{name.split('-')[1]}.csv"]
    if name.startswith("mooncake-"):
        return [root / "mooncake-fast25" / f"{name.split('-')[1]}_trace.jsonl"]
    if name.startswith("burstgpt-"):
        return [root / "burstgpt" / f"BurstGPT_{name.split('-')[1]}_first400.csv"]
    if name == "ragpulse":
        return [root / "ragpulse" / "0_trace.jsonl"] + [root / "ragpulse" / f for f, _ in _RAGPULSE_FILES.values()]
    raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACE_NAMES)}")


def missing_trace_files(name: str) -> list[Path]:
    """The files of trace ``name`` that are not there (none when it can be loaded)."""
    return [p for p in trace_files(name) if not p.is_file()]


def load_trace(name: str) -> TraceTable:
    """The parsed trace, cached per process by file path and modification time (nothing is written). Raises
    FileNotFoundError, saying where the traces are read from, when a file of the trace is not there."""
    files = trace_files(name)
    missing = missing_trace_files(name)
    if missing:
        raise FileNotFoundError(
            f"trace {name!r} needs {missing[0]}, which is not there: the public traces are read from the shared "
            f"data folder, ../shared beside the repository or the folder $TWIN_SHARED names (docs/traces.md)")
    key = (name, tuple((str(p), p.stat().st_mtime_ns) for p in files))
    table = _CACHE.get(key)
    if table is None:
        table = _PARSERS[name.split("-")[0]](name, files)
        for arr in (table.t_s, table.prompt_tokens, table.output_tokens, table.segment_tokens):
            arr.flags.writeable = False
        _CACHE[key] = table
    return table


def _jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _table(name: str, t, prompt, output, segments, quantum_s: float) -> TraceTable:
    """Sort by time (stable); ``segments``: per row, a tuple of ("seg", (id, tokens)) pieces, or None."""
    t = np.asarray(t, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order[0]]
    prompt = np.asarray(prompt, dtype=np.int64)[order]
    covered = np.zeros(t.size, dtype=np.int64)
    segs = None
    if segments is not None:
        segs = tuple(segments[i] for i in order.tolist())
        covered = np.array([sum(piece[1][1] for piece in row) for row in segs], dtype=np.int64)
        limit = np.maximum(prompt, 1)
        over = np.flatnonzero(covered > limit)
        if over.size:  # never in the published files; kept so that pieces always sum to the prompt
            segs = tuple(_trim(row, int(limit[i])) if covered[i] > limit[i] else row for i, row in enumerate(segs))
            covered = np.minimum(covered, limit)
    return TraceTable(name=name, t_s=t, prompt_tokens=prompt, output_tokens=np.asarray(output, dtype=np.int64)[order],
                      segments=segs, segment_tokens=covered, quantum_s=quantum_s)


def _trim(row: tuple[tuple[str, tuple[int, int]], ...], tokens: int) -> tuple[tuple[str, tuple[int, int]], ...]:
    """Pieces cut to at most ``tokens`` tokens."""
    out: list[tuple[str, tuple[int, int]]] = []
    for _, (sid, n) in row:
        if tokens <= 0:
            break
        out.append(("seg", (sid, min(n, tokens))))
        tokens -= n
    return tuple(out)


def _segment_ids(namespace: str, ids: np.ndarray) -> list[int]:
    """63-bit segment ids for a trace's integer content ids: splitmix64 of (id + stable_hash(namespace)).

    A bijection of the 64-bit id for each namespace (before the top bit is dropped), vectorised because
    Mooncake has ~180k distinct block ids and one ``stable_hash`` string per id costs a second.
    """
    x = np.asarray(ids, dtype=np.uint64) + np.uint64(stable_hash(namespace))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(1)).tolist()


def _parse_azure(name: str, files: list[Path]) -> TraceTable:
    with files[0].open(encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    stamps = np.array([r["TIMESTAMP"] for r in rows], dtype="datetime64[ns]")
    t = (stamps - stamps.min()).astype(np.int64) / 1e9
    # 100 ns resolution: no jitter needed
    return _table(name, t, [int(r["ContextTokens"]) for r in rows], [int(r["GeneratedTokens"]) for r in rows],
                  None, 0.0)


def _parse_burstgpt(name: str, files: list[Path]) -> TraceTable:
    with files[0].open(encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    t = [float(r["Timestamp"]) for r in rows]  # whole seconds
    return _table(name, t, [int(r["Request tokens"]) for r in rows], [int(r["Response tokens"]) for r in rows],
                  None, 1.0)


def _parse_mooncake(name: str, files: list[Path]) -> TraceTable:
    rows = _jsonl(files[0])
    bs = MOONCAKE_BLOCK_TOKENS
    counts = [len(r["hash_ids"]) for r in rows]
    sids = _segment_ids(f"{name}/block", np.fromiter((h for r in rows for h in r["hash_ids"]), dtype=np.int64))
    segments = []
    pos = 0
    for r, nb in zip(rows, counts):
        n = int(r["input_length"])
        if nb != math.ceil(n / bs):
            raise ValueError(f"{files[0]}: a row has {nb} hash ids for {n} input tokens (block {bs})")
        full = tuple(("seg", (sid, bs)) for sid in sids[pos : pos + nb - 1])
        segments.append(full + (("seg", (sids[pos + nb - 1], n - bs * (nb - 1))),))  # last block: the remainder
        pos += nb
    # conversation timestamps are quantised to ~3 s buckets (SOURCES.md); synthetic ones are whole ms
    quantum = 3.0 if name == "mooncake-conversation" else 0.001
    return _table(name, [r["timestamp"] / 1000.0 for r in rows], [r["input_length"] for r in rows],
                  [r["output_length"] for r in rows], segments, quantum)


def _parse_ragpulse(name: str, files: list[Path]) -> TraceTable:
    rows = _jsonl(files[0])
    pieces: dict[str, dict[int, tuple[str, tuple[int, int]]]] = {}
    for comp, (fname, id_key) in _RAGPULSE_FILES.items():
        objs = _jsonl(files[0].parent / fname)
        sids = _segment_ids(f"{name}/{comp}", np.array([int(o[id_key]) for o in objs], dtype=np.int64))
        pieces[comp] = {int(o[id_key]): ("seg", (sid, int(o["token_length"]))) for o, sid in zip(objs, sids)}
    segments = [tuple(pieces[comp][int(i)] for comp in RAGPULSE_COMPONENTS for i in r["hash_ids"][comp])
                for r in rows]
    return _table(name, [float(r["timestamp"]) for r in rows], [r["input_length"] for r in rows],
                  [r["output_length"] for r in rows], segments, 1.0)


_PARSERS = {"azure": _parse_azure, "burstgpt": _parse_burstgpt, "mooncake": _parse_mooncake,
            "ragpulse": _parse_ragpulse}


# ---- replay ---------------------------------------------------------------------------------------------
def _copy_times(cfg: TraceWorkload, table: TraceTable, *, copy: int, period_s: float, keep_p: float,
                seed: int, replication: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows and window-relative times of one copy of the window (before time scaling)."""
    t = table.t_s
    if cfg.jitter_within_quantum and table.quantum_s > 0.0:
        t = t + stream(seed, replication, f"workload.trace.jitter.c{copy}").uniform(0.0, table.quantum_s, t.size)
    end = math.inf if cfg.duration_s is None else cfg.start_s + cfg.duration_s
    rows = np.flatnonzero((t >= cfg.start_s) & (t < end))
    rel = t[rows] - cfg.start_s
    if copy > 0:
        shift = stream(seed, replication, f"workload.trace.shift.c{copy}").uniform(0.0, period_s)
        rel = np.mod(rel + shift, period_s)
    if keep_p < 1.0:
        keep = stream(seed, replication, f"workload.trace.thin.c{copy}").random(rows.size) < keep_p
        rows, rel = rows[keep], rel[keep]
    return rows, rel


def _pieces(table: TraceTable, row: int, salt: int, prompt: int, unique: int) -> tuple[tuple[str, object], ...]:
    """The row's identified segments (ids XOR ``salt``), then one unique segment for the rest of the prompt."""
    if table.segments is None:
        return (("seg", (unique, prompt)),)
    segs = table.segments[row]
    if salt:
        segs = tuple(("seg", (sid ^ salt, n)) for _, (sid, n) in segs)
    rest = prompt - int(table.segment_tokens[row])
    return segs + (("seg", (unique, rest)),) if rest > 0 else segs


def trace_requests(cfg: TraceWorkload, *, seed: int, replication: int) -> list[RequestSpec]:
    """The window of the trace as requests, sorted by arrival, the first at 0.0 (see ``docs/traces.md``)."""
    from twin.models.workload import RequestSpec

    table = load_trace(cfg.trace)
    t = table.t_s
    if t.size == 0:
        return []
    # length of the window for the cyclic shift of copies >= 1
    if cfg.duration_s is not None:
        period = cfg.duration_s
    else:
        mean_gap = (t[-1] - t[0]) / max(t.size - 1, 1)
        period = max(t[-1] - cfg.start_s, 0.0) + mean_gap + table.quantum_s
    m = cfg.rate_multiplier
    whole = math.floor(m)
    frac = m - whole
    n_copies = whole + (1 if frac > 1e-12 else 0)
    parts = []
    for k in range(n_copies):
        keep_p = 1.0 if k < whole else frac
        rows, rel = _copy_times(cfg, table, copy=k, period_s=period, keep_p=keep_p, seed=seed,
                                replication=replication)
        parts.append((np.full(rows.size, k, dtype=np.int64), rows, rel))
    copies = np.concatenate([p[0] for p in parts])
    rows = np.concatenate([p[1] for p in parts])
    rel = np.concatenate([p[2] for p in parts])
    if rel.size == 0:
        return []
    order = np.lexsort((rows, copies, rel))  # by time, then copy, then trace row: fully deterministic
    if cfg.max_requests is not None:
        order = order[: cfg.max_requests]
    arrivals = (rel[order] - rel[order].min()) * cfg.time_scale
    out: list[RequestSpec] = []
    salts = [0 if (k == 0 or cfg.copies_share_prefixes) else stable_hash(f"{cfg.trace}/copy/{k}")
             for k in range(n_copies)]
    kept_copy, kept_row = copies[order], rows[order]
    # per-request content ids: a pure function of (trace, copy, row), never of the seed
    key = kept_copy * t.size + kept_row
    uniques = _segment_ids(f"{cfg.trace}/prompt", key)
    outputs = _segment_ids(f"{cfg.trace}/output", key)
    prompts = np.maximum(table.prompt_tokens[kept_row], 1).tolist()  # 0 (failed BurstGPT rows) -> 1
    outs = np.maximum(table.output_tokens[kept_row], 1).tolist()
    cap = cfg.max_tokens_cap
    out: list[RequestSpec] = []
    for j, (a, k, row) in enumerate(zip(arrivals.tolist(), kept_copy.tolist(), kept_row.tolist())):
        p, o = prompts[j], outs[j]
        out.append(RequestSpec(request_id=f"{cfg.trace}.c{k}.r{row:06d}", arrival_s=a,
                               pieces=_pieces(table, row, salts[k], p, uniques[j]), prompt_tokens=p,
                               output_tokens=o, max_tokens=cap if cap is not None else o, output_segment=outputs[j]))
    return out
