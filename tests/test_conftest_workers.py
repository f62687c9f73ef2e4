"""The test run's worker count (tests/conftest.py): the default run spreads over the cores, a run of the real-engine,
browser or timing tests stays in one process."""
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import pytest_xdist_auto_num_workers, selects_serial_markers


@pytest.mark.parametrize("expr", ["vllm", "e2e", "benchmark", "vllm and not slow", "slow or e2e", "(vllm)",
                                  "not slow and  vllm"])
def test_expressions_selecting_engine_browser_or_timing_tests_run_in_one_process(expr):
    assert selects_serial_markers(expr)
    assert pytest_xdist_auto_num_workers(types.SimpleNamespace(option=types.SimpleNamespace(markexpr=expr))) == 0


@pytest.mark.parametrize("expr", ["", "slow", "not slow and not e2e and not benchmark and not vllm", "not vllm",
                                  "not  e2e"])
def test_other_expressions_leave_the_count_to_xdist(expr):
    assert not selects_serial_markers(expr)
    assert pytest_xdist_auto_num_workers(types.SimpleNamespace(option=types.SimpleNamespace(markexpr=expr))) is None


def test_a_run_that_selects_no_tests_still_fails():
    """pytest's "no tests ran" (exit 5) must not pass with the workers either."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "no_test_has_this_name",
                           "tests/test_conftest_workers.py"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 5, done.stdout + done.stderr
