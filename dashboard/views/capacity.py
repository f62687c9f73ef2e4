"""Capacity planner: the capacity model (twin.capacity) under sliders; every change recomputes at once."""

from __future__ import annotations

import streamlit as st
from pydantic import ValidationError

from dashboard import figures, tables
from twin.capacity import PRESETS, compute_capacity, load_named_profile
from twin.engine_profiles import list_profiles

USERS = [100_000, 200_000, 500_000, 1_000_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000, 100_000_000]
OWN = "(the preset's own numbers)"


def _human(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}"


def _fmt(x, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


st.title("Capacity planner")
st.caption("The founding notes' back-of-envelope arithmetic (docs/capacity.md): no simulation, recomputed on "
           "every change.")

with st.sidebar:
    preset = st.selectbox("Preset", list(PRESETS), index=list(PRESETS).index("seed-10m"), key="cap_preset")
    base = PRESETS[preset]
    k = f"cap_{preset}_"
    st.subheader("Workload")
    users = st.select_slider("Daily users", options=USERS, value=min(USERS, key=lambda u: abs(u - base.daily_users)),
                             format_func=_human, key=k + "users")
    turns = st.slider("Turns per user per day", 1.0, 50.0, float(base.turns_per_user_per_day), 1.0, key=k + "turns")
    peak = st.slider("Peak factor (peak / daily mean)", 1.0, 10.0, float(base.peak_factor), 0.5, key=k + "peak")
    prompt = st.slider("Prompt tokens per turn", 100, 8000, int(base.prompt_tokens_per_turn), 100, key=k + "prompt")
    output = st.slider("Output tokens per turn", 50, 2000, int(base.output_tokens_per_turn), 50, key=k + "output")
    hit = st.slider("Prefix-cache hit rate", 0.0, 0.95, float(base.prefix_cache_hit_fraction), 0.05, key=k + "hit")
    st.subheader("Model and GPU")
    profile = st.selectbox("Engine profile (model + GPU)", [OWN, *list_profiles()], key=k + "profile")
    mem_util = st.slider("GPU memory the engine may use", 0.5, 1.0, float(base.gpu_memory_utilisation_fraction), 0.01,
                         key=k + "memutil")
    cap = None
    if base.max_streams_per_replica_at_target is not None:
        cap = st.slider("Streams per replica at the speed target (latency cap)", 10, 1000,
                        int(base.max_streams_per_replica_at_target), 10, key=k + "cap")
    st.subheader("Planning and price")
    util = st.slider("Planning utilisation", 0.3, 1.0, float(base.planning_utilisation_fraction), 0.05, key=k + "util")
    reserve = st.slider("Failover reserve", 0.0, 1.0, float(base.failover_reserve_fraction), 0.05, key=k + "reserve")
    price = st.slider("Price per GPU-hour ($)", 0.5, 10.0, float(base.usd_per_gpu_hour or 2.5), 0.1, key=k + "price")
    note_rounding = st.checkbox("Round intermediates as the note does", value=False, key=k + "round",
                                help="the 10M note rounds peak req/s, output tok/s and stream lifetime; off = exact")

changes = {"daily_users": users, "turns_per_user_per_day": turns, "peak_factor": peak, "prompt_tokens_per_turn": prompt,
           "output_tokens_per_turn": output, "prefix_cache_hit_fraction": hit, "gpu_memory_utilisation_fraction": mem_util,
           "planning_utilisation_fraction": util, "failover_reserve_fraction": reserve, "usd_per_gpu_hour": price}
if cap is not None:
    changes["max_streams_per_replica_at_target"] = cap
if not note_rounding:
    changes.update(round_peak_rps_to=None, round_peak_output_tokens_per_s_to=None, round_generation_duration_s_to=None)
try:
    inputs = tables.planner_inputs(base, profile=None if profile == OWN else profile, **changes)
    prof = load_named_profile(inputs.profile) if inputs.profile else None
    result = compute_capacity(inputs, profile=prof)
except (ValidationError, ValueError) as exc:
    st.error(f"These inputs do not make an estimate: {exc}")
    st.stop()

row1 = st.columns(4)
row1[0].metric("Peak requests/s", _fmt(result.peak_rps))
row1[1].metric("Peak output tokens/s", _human(result.peak_output_tokens_per_s))
row1[2].metric("Live streams at peak", _fmt(result.active_streams))
row1[3].metric("Binding constraint", result.binding_constraint or "—")
row2 = st.columns(4)
row2[0].metric("GPUs (with reserve)", _fmt(result.gpus_with_reserve))
row2[1].metric("Nodes", _fmt(result.nodes))
row2[2].metric("$ per month", _fmt(result.usd_per_month, "${:,.0f}"))
row2[3].metric("$ per M output tokens", _fmt(result.usd_per_m_output_tokens, "${:,.3f}"))
if result.replicas is None:
    st.info("These inputs give no per-replica decode capacity, so no fleet size: pick an engine profile or a preset "
            "with a latency cap.")
elif result.gpus_with_reserve is None:
    st.info("No GPU count, nodes or cost: these inputs state no GPUs per replica. Pick an engine profile.")

left, right = st.columns(2)
left.plotly_chart(figures.fig_fleet_size(tables.fleet_size_table(result)), key="cap_fleet")
right.plotly_chart(figures.fig_streams_per_replica(tables.streams_table(result)), key="cap_streams")
st.plotly_chart(figures.fig_prefix_hit(tables.prefix_hit_table(inputs, profile=prof), current_hit=hit), key="cap_hit")
with st.expander("Every figure of the estimate"):
    st.dataframe([{"field": f, "value": "—" if v is None else str(v)} for f, v in result.model_dump().items()],
                 hide_index=True)
with st.expander("Inputs"):
    st.json(inputs.model_dump(exclude_none=True))
