"""The dashboard in a real browser: ``twin dashboard`` on a free loopback port, driven by Playwright in the
system Chromium (Debian's ``chromium`` package; never ``playwright install``).

Run: ``.venv/bin/python -m pytest -m e2e tests/test_dashboard_e2e.py -s``. The screenshot goes to
``$TWIN_DASHBOARD_SCREENSHOT`` if set, else into the test's tmp_path; the test prints where.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from twin.capacity import PRESETS, compute_capacity

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dashboard.tables import planner_inputs  # noqa: E402  (the dashboard package lives at the repo root)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
START_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"twin dashboard exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(f"{url}_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"twin dashboard not healthy after {START_TIMEOUT_S} s:\n{log.read_text(errors='replace')}")


@pytest.fixture
def dashboard_url(tmp_path):
    port = _free_port()
    log = tmp_path / "dashboard.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "twin", "dashboard", "--port", str(port)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_healthy(url, proc, log)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the session this test started: twin + its streamlit child
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _gpus(page) -> str:
    metric = page.locator('[data-testid="stMetric"]').filter(has_text="GPUs (with reserve)")
    return metric.locator('[data-testid="stMetricValue"]').inner_text()


def _fleet_bars(page) -> list[float]:
    """The x values of the first plotly chart on the page (the fleet-size bars), as plotly drew them
    (``_fullData``: the typed arrays decoded)."""
    return page.evaluate("() => Array.from(document.querySelector('.js-plotly-plot')._fullData[0].x)")


def test_capacity_slider_rerenders_the_charts(dashboard_url, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (Debian's package)")
    shot = Path(os.environ.get("TWIN_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard-capacity.png")
    # what the capacity model says for 50M daily users (seed-10m, exact arithmetic: the page's default)
    expected = compute_capacity(planner_inputs(PRESETS["seed-10m"], daily_users=50_000_000, round_peak_rps_to=None,
                                               round_peak_output_tokens_per_s_to=None,
                                               round_generation_duration_s_to=None))
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1600, "height": 1300})
        try:
            page = ctx.new_page()
            page.goto(dashboard_url, wait_until="domcontentloaded")
            page.get_by_text("Capacity planner").first.wait_for(timeout=60_000)
            page.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
            sync_api.expect(page.locator('[data-testid="stMetric"]').filter(has_text="GPUs (with reserve)")
                            ).to_be_visible(timeout=30_000)
            gpus_before, bars_before = _gpus(page), _fleet_bars(page)
            assert gpus_before == "2,128"  # seed-10m without the note's rounding (docs/capacity.md)

            users = page.locator('[data-testid="stSidebar"]').get_by_role("slider").first  # "Daily users"
            users.focus()
            page.keyboard.press("ArrowRight")  # 10M -> 20M daily users
            page.keyboard.press("ArrowRight")  # -> 50M
            sync_api.expect(users).to_have_attribute("aria-valuetext", "50M", timeout=30_000)
            # each key press reruns the app; wait for the figures of 50M users, not those of the first press
            gpus_metric = page.locator('[data-testid="stMetric"]').filter(has_text="GPUs (with reserve)")
            sync_api.expect(gpus_metric.locator('[data-testid="stMetricValue"]')).to_have_text(
                f"{expected.gpus_with_reserve:,}", timeout=30_000)
            page.wait_for_function(
                "want => { const x = document.querySelector('.js-plotly-plot')._fullData[0].x;"
                " return x[x.length - 1] === want; }", arg=expected.replicas_with_reserve, timeout=30_000)
            gpus_after, bars_after = _gpus(page), _fleet_bars(page)
            page.wait_for_timeout(1000)  # let plotly finish drawing before the screenshot
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            ctx.close()
    print(f"\ndashboard screenshot: {shot}")
    print(f"GPUs (with reserve): {gpus_before} -> {gpus_after}; fleet bars {bars_before} -> {bars_after}")
    assert int(gpus_after.replace(",", "")) > 4 * int(gpus_before.replace(",", ""))  # 5x the users
    assert bars_after == [expected.replicas_at_saturation, expected.replicas, expected.replicas_by_concurrency,
                          expected.replicas_with_prefill, expected.replicas_with_reserve]
    assert bars_after[-1] > 4 * bars_before[-1]
