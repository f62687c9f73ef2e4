"""Shared measurement helpers: wall time, peak RSS, and the one-JSON-line-per-case output."""

from __future__ import annotations

import json
import platform
import resource
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_last_cpu_s = 0.0


def interpreter() -> str:
    """The Python running the benchmark, as a row records it: version, whether the interpreter's code is in a
    shared ``libpython`` (pyenv's default build) or in the executable (Debian's ``/usr/bin/python3``), and
    whether configure had ``--enable-optimizations`` (PGO). The same code ran ~10-17 % slower on this machine's
    shared, unoptimised pyenv build than on Debian's static one (docs/performance-rounds.md, round 22), so figures
    from different interpreters are not compared as if they were one."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            shared = "libpython" in f.read()
    except OSError:
        shared = bool(sysconfig.get_config_var("Py_ENABLE_SHARED"))
    pgo = "--enable-optimizations" in (sysconfig.get_config_var("CONFIG_ARGS") or "")
    return (f"{platform.python_implementation()} {platform.python_version()}, "
            f"{'shared libpython' if shared else 'static'}{', --enable-optimizations' if pgo else ''}")


def measure(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn``; returns its result and wall seconds (its CPU seconds go to the next ``emit``). An earlier
    case's finished world is collected first, outside the clocks (``release_finished_worlds``)."""
    global _last_cpu_s
    from twin.runner import release_finished_worlds

    release_finished_worlds(collect=True)
    c0 = time.process_time()
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    _last_cpu_s = time.process_time() - c0
    return out, wall


def emit(case: str, *, sim_requests: int, sim_s: float, events: int | None, wall_s: float,
         extra: dict | None = None, show: bool = True) -> dict:
    """One JSON line per case. ``cpu_s`` is this process's CPU time for the case: on a machine shared with
    other work it is the steadier number (wall time includes waiting for a core). ``peak_rss_mb`` is the
    process's peak so far, so in a multi-case run it is the largest case's up to that line. ``show=False``
    returns the row without printing it (a caller that picks one of several repeats prints it with ``show_row``)."""
    row = {
        "case": case,
        "sim_requests": sim_requests,
        "sim_requests_per_wall_s": sim_requests / wall_s,
        "sim_s_per_wall_s": sim_s / wall_s,
        "events_per_wall_s": None if events is None else events / wall_s,  # None: not counted (sweeps)
        "wall_s": wall_s,
        "cpu_s": _last_cpu_s,
        "sim_requests_per_cpu_s": sim_requests / _last_cpu_s if _last_cpu_s > 0 else None,
        "sim_s_per_cpu_s": sim_s / _last_cpu_s if _last_cpu_s > 0 else None,
        "peak_rss_mb": peak_rss_mb(),
        # CPU per simulated request (a fleet's request is a user's turn): the per-unit cost whose growth
        # with fleet size the "within 1.2x of linear" criterion is about
        "cpu_ms_per_sim_request": 1000.0 * _last_cpu_s / sim_requests if sim_requests else None,
        "python": interpreter(),
    }
    if extra:
        row.update(extra)
    if show:
        show_row(row)
    return row


def show_row(row: dict) -> None:
    """Print a case's row as its one JSON line."""
    print(json.dumps(row), flush=True)


def growth_vs_linear(rows: list[dict], *, size: str = "sim_requests") -> list[str]:
    """Each case against the first: how much larger (``size``), how much more CPU, and their ratio
    (CPU-per-unit growth; 1.00 is linear, the issue asks for at most 1.2)."""
    base, lines = rows[0], []
    for r in rows[1:]:
        grow = r[size] / base[size]
        cpu = r["cpu_s"] / base["cpu_s"]
        lines.append(f"{r['case']}: {grow:.2f}x the {size} of {base['case']}, CPU {cpu:.2f}x "
                     f"(linear would be {grow:.2f}x; CPU per unit {cpu / grow:.2f}x linear)")
    return lines


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
