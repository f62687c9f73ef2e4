"""Test-run configuration shared by every test module.

The default run spreads its tests over the machine's cores (pytest-xdist's ``-n auto``, set in pyproject.toml's
``addopts``): on a 2-core VM the suite took 8 min 8 s so against 14 min 37 s in one process. A run that selects tests
which start a real vLLM engine, drive a browser or time the code (markers ``vllm``, ``e2e``, ``benchmark``) stays in
one process instead: those tests want the cores to themselves, and two of them side by side would slow each other and
skew what they measure. ``-n N`` on the command line still sets the number of workers outright.
"""
from __future__ import annotations

import re

import pytest

# a marker named in the run's -m expression other than after "not"
_SERIAL_MARKERS = re.compile(r"(?<!not )\b(vllm|e2e|benchmark)\b")


def selects_serial_markers(markexpr: str) -> bool:
    """Whether a ``-m`` expression selects tests marked ``vllm``, ``e2e`` or ``benchmark`` (the default expression,
    ``not slow and not e2e and not benchmark and not vllm``, does not)."""
    return bool(_SERIAL_MARKERS.search(" ".join(markexpr.split())))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: no workers (one process) when the run selects the real-engine, browser or timing tests; otherwise
    xdist's own count of the machine's cores."""
    if selects_serial_markers(config.option.markexpr or ""):
        return 0
    return None
