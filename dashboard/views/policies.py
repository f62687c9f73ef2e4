"""Policy comparison: per policy, the mean of a metric across seeds with its 95% confidence interval."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import streamlit as st

from dashboard import figures, runs, tables, ui
from twin.policies import ROUTERS

st.title("Policy comparison")
st.caption("Each policy runs the same scenario with the same seeds (common random numbers); bars are means across "
           "seeds and error bars 95% Student-t intervals. Few seeds give wide intervals: read overlap as 'not shown "
           "to differ'.")

source = st.radio("Source", ["Run a small sweep", "Read a sweep folder"], horizontal=True, key="pc_source")
if source.startswith("Run"):
    name, path = ui.scenario_picker("pc_scenario", default="baseline-day")
    scale, duration_s, _ = ui.size_controls("pc", duration_s=20)
    keys = ROUTERS.keys()
    chosen = st.multiselect("Routers", keys, default=[k for k in ("round_robin", "least_outstanding_tokens",
                                                                    "prefix_affinity") if k in keys], key="pc_routers")
    n_seeds = st.slider("Seeds per router", 2, 10, 3, key="pc_seeds")
    root = st.text_input("Sweep folders under", "runs/sweeps", key="pc_root")
    size = runs.size_overrides(scale=scale, duration_s=duration_s)
    spec = json.dumps({"scenario": name, "overrides": size, "routers": chosen, "seeds": n_seeds}, sort_keys=True)
    sweep_name = f"dashboard-{name}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"
    st.caption(f"{len(chosen)} routers × {n_seeds} seeds = {len(chosen) * n_seeds} runs into "
               f"`{Path(root) / sweep_name}` (a `twin sweep` folder; runs already there are not run again)")
    if st.button("Run the sweep", type="primary", key="pc_run", disabled=not chosen):
        bar = st.progress(0.0, text="starting")
        folder = runs.policy_sweep(path, routers=chosen, seeds=range(1, n_seeds + 1), overrides=size, out=root,
                                   name=sweep_name, progress=lambda i, n, what: bar.progress(
                                       i / n, text=f"{i} of {n} runs finished ({what})"))
        st.session_state["pc_folder"] = str(folder)
else:
    default = ""
    sweeps = [d for d in Path("runs/sweeps").glob("*") if (d / "runs").is_dir()]
    if sweeps:
        default = str(max(sweeps, key=lambda d: (d / "runs").stat().st_mtime))
    typed = st.text_input("A `twin sweep` folder (holding runs/)", default, key="pc_folder_in")
    if typed and st.button("Read", key="pc_read"):
        st.session_state["pc_folder"] = typed

folder = st.session_state.get("pc_folder")
if not folder:
    st.info("Run a sweep or read a folder to compare policies.")
    st.stop()
try:
    rows = runs.sweep_rows(folder)
except (ImportError, FileNotFoundError, OSError, ValueError) as exc:
    st.error(f"cannot read {folder}: {exc}")
    st.stop()
if not rows:
    st.warning(f"{folder}: no completed runs found")
    st.stop()
ci = tables.ci_table(rows)
st.caption(f"{len(rows)} runs read from `{folder}` (through twin.results_db, as `twin results summary`)")
metrics = list(dict.fromkeys(ci["metric"]))
metric = st.selectbox("Metric", metrics, index=metrics.index("ttft_p99_s") if "ttft_p99_s" in metrics else 0,
                      key="pc_metric")
st.plotly_chart(figures.fig_policy_ci(ci, metric), key="pc_chart")
view = ci[ci["metric"] == metric].assign(interval=lambda d: [f"{m:.4g} ± {h:.2g}" for m, h in zip(d["mean"], d["ci95"])])
st.dataframe(view, hide_index=True)
with st.expander("Per-run values"):
    st.dataframe(rows, hide_index=True)
