"""Streamlit pieces the pages share: cached runs and the scenario/size controls (layout, no model logic)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import runs

SCALES = [0.001, 0.002, 0.005, 0.01, 0.02]


@st.cache_data(max_entries=16, show_spinner=False)
def scenarios() -> dict[str, str]:
    """name -> path (as text) of the fleet scenarios shipped in scenarios/."""
    return {name: str(path) for name, path in runs.fleet_scenarios().items()}


@st.cache_data(max_entries=16, show_spinner=False)
def cached_run(path: str, overrides: tuple[str, ...], seed: int, label: str) -> runs.RunView:
    """``runs.run``, remembered per (scenario, overrides, seed): rerunning a page does not rerun the twin."""
    return runs.run(path, list(overrides), seed=seed, label=label)


def scenario_picker(key: str, *, default: str) -> tuple[str, Path]:
    """A select box of the fleet scenarios; returns (name, path)."""
    found = scenarios()
    names = list(found)
    name = st.selectbox("Scenario", names, index=names.index(default) if default in names else 0, key=key)
    return name, Path(found[name])


def size_controls(key: str, *, scale: float = runs.DEFAULT_SCALE, duration_s: float = runs.DEFAULT_DURATION_S,
                  max_duration_s: int = 300) -> tuple[float, float, int]:
    """Run size (fleet.scale, session window) and seed controls; returns (scale, duration_s, seed)."""
    c1, c2, c3 = st.columns(3)
    sc = c1.select_slider("fleet.scale (nodes and users)", options=SCALES, value=scale, key=f"{key}_scale",
                          help="share of the full fleet and its users simulated; small = fast")
    dur = c2.slider("Session window (simulated s)", 5, max_duration_s, int(duration_s), 5, key=f"{key}_duration",
                    help="fleet.traffic.duration_s: sessions start in this window; the run drains after it")
    seed = c3.number_input("Seed", 0, 10_000, 1, key=f"{key}_seed")
    return float(sc), float(dur), int(seed)


def sized_scenario(key: str, *, default: str, duration_s: float):
    """Scenario picker + size controls, loaded at that size; stops the page with the error if it is invalid.

    Returns (name, path, size_overrides, seed, duration_s, scenario).
    """
    from twin.scenario import ScenarioError, load_scenario

    name, path = scenario_picker(f"{key}_scenario", default=default)
    scale, dur, seed = size_controls(key, duration_s=duration_s)
    size = runs.size_overrides(scale=scale, duration_s=dur)
    try:
        sized = load_scenario(path, overrides=size)
    except ScenarioError as exc:
        st.error(str(exc))
        st.stop()
    return name, path, size, seed, dur, sized


def show_failure(view: runs.RunView) -> None:
    st.error(f"{view.label}: the run failed: {view.manifest.get('exception')}")
