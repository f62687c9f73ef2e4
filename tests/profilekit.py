"""Comparing engine profiles in tests (not a test module)."""

from __future__ import annotations

import math


def assert_step_time_close(a: dict, b: dict, label: object = None) -> None:
    """Two dumped ``step_time`` sections are the same fit: every regime's coefficients and the overhead within a
    relative 1e-9. A least squares' last digits follow the host's BLAS kernels (an AMD EPYC host gave the H200
    derivation's coefficients a few ULP from the shipped file's), so derived profiles are compared this way, not
    bit for bit."""
    for regime in ("decode", "prefill"):
        for key, val in a[regime].items():
            assert math.isclose(val, b[regime][key], rel_tol=1e-9, abs_tol=1e-15), (label, regime, key)
    assert math.isclose(a["overhead_s"], b["overhead_s"], rel_tol=1e-9), (label, "overhead_s")
