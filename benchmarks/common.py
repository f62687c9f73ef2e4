"""Shared measurement helpers: wall time, peak RSS, and the one-JSON-line-per-case output."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from typing import Any


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_last_cpu_s = 0.0


def measure(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn``; returns its result and wall seconds (its CPU seconds go to the next ``emit``)."""
    global _last_cpu_s
    c0 = time.process_time()
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    _last_cpu_s = time.process_time() - c0
    return out, wall


def emit(case: str, *, sim_requests: int, sim_s: float, events: int, wall_s: float, extra: dict | None = None) -> dict:
    """One JSON line per case. ``cpu_s`` is this process's CPU time for the case: on a machine shared with
    other work it is the steadier number (wall time includes waiting for a core)."""
    row = {
        "case": case,
        "sim_requests": sim_requests,
        "sim_requests_per_wall_s": sim_requests / wall_s,
        "sim_s_per_wall_s": sim_s / wall_s,
        "events_per_wall_s": events / wall_s,
        "wall_s": wall_s,
        "cpu_s": _last_cpu_s,
        "sim_requests_per_cpu_s": sim_requests / _last_cpu_s if _last_cpu_s > 0 else None,
        "sim_s_per_cpu_s": sim_s / _last_cpu_s if _last_cpu_s > 0 else None,
        "peak_rss_mb": peak_rss_mb(),
    }
    if extra:
        row.update(extra)
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict], cols: list[str]) -> str:
    head = "".join(f"{c:>24}" for c in cols)
    lines = [head]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:>24.2f}" if isinstance(v, float) else f"{v!s:>24}")
        lines.append("".join(cells))
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
