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


def measure(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def emit(case: str, *, sim_requests: int, sim_s: float, events: int, wall_s: float, extra: dict | None = None) -> dict:
    row = {
        "case": case,
        "sim_requests": sim_requests,
        "sim_requests_per_wall_s": sim_requests / wall_s,
        "sim_s_per_wall_s": sim_s / wall_s,
        "events_per_wall_s": events / wall_s,
        "wall_s": wall_s,
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
