"""Drill replay: a region-loss drill (twin.drill) as a chart with its events marked, and its phase table."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import streamlit as st

from dashboard import figures, runs, tables, ui
from twin.drill import drill_report

st.title("Drill replay")
st.caption("A region loses its GPUs; live streams drop and resume elsewhere, DNS moves the region's users after "
           "the failover delay, the region comes back after warm-up. Same report as `twin drill region-loss`.")

source = st.radio("Source", ["Run a drill now", "Load a folder written by `twin drill --out`"], horizontal=True,
                  key="dr_source")
if source.startswith("Run"):
    name, path, size, seed, duration_s, sized = ui.sized_scenario("dr", default="region-loss-drill", duration_s=120)
    regions = [r.name for r in sized.fleet.topology.regions]
    c1, c2, c3, c4, c5 = st.columns(5)
    region = c1.selectbox("Region lost", regions, key="dr_region")
    at_s = c2.slider("Lost at (s)", 0, int(duration_s), int(duration_s) // 4, 5, key="dr_at")
    back = c3.slider("Back at (s; 0 = not in this run)", 0, 600, int(duration_s) * 3 // 4, 5, key="dr_back")
    dns = c4.slider("DNS failover after (s)", 0, 120, 15, 5, key="dr_dns")
    warmup = c5.slider("Warm-up (s)", 0, 120, 15, 5, key="dr_warmup")
    loss = {"region": region, "at_s": float(at_s), "recover_at_s": float(back) if back > at_s else None}
    ov = size + runs.whatif_overrides(sized, keep_faults=False, region_loss=loss, dns_failover_s=float(dns)) + [
        f"fleet.failover.warmup_s={warmup:g}"]
    if st.button("Run the drill", type="primary", key="dr_run"):
        with st.spinner("Running the drill…"):
            view = ui.cached_run(str(path), tuple(ov), seed, "drill")
        if not view.ok:
            ui.show_failure(view)
            st.stop()
        rep = drill_report(view.tables["events"], view.tables["requests"], region=region, at_s=float(at_s),
                           end_s=view.summary["sim_time_s"])
        st.session_state["dr_result"] = {"report": rep, "requests": view.tables["requests"],
                                         "slo": view.summary.get("slo", {}), "what": f"{name}, {len(ov)} overrides"}
else:
    folder = st.text_input("Drill folder (holding drill.json and requests.parquet)", key="dr_folder")
    if folder and st.button("Load", key="dr_load"):
        d = Path(folder)
        try:
            rep = json.loads((d / "drill.json").read_text(encoding="utf-8"))
            requests = pq.read_table(d / "requests.parquet")
            summary = json.loads((d / "summary.json").read_text(encoding="utf-8")) if (d / "summary.json").exists() \
                else {}
        except (OSError, ValueError) as exc:
            st.error(f"cannot read {d}: {exc}")
            st.stop()
        st.session_state["dr_result"] = {"report": rep, "requests": requests, "slo": summary.get("slo", {}),
                                         "what": str(d)}

result = st.session_state.get("dr_result")
if result is None:
    st.info("Run a drill (or load one) to see its timeline.")
    st.stop()
rep = result["report"]
st.subheader(f"{rep['region']} lost at t={rep['at_s']:.0f} s ({result['what']})")
m = st.columns(3)
m[0].metric("Live streams dropped", rep["streams_dropped"])
m[1].metric("Turns retried", rep["turns_retried"])
m[2].metric("Turns resumed from the last persisted token", rep["turns_resumed"])
timeline = tables.timeline_table(rep)
metric = st.radio("Latency shown", ["ttft_s", "tpot_s"], horizontal=True, key="dr_metric",
                  format_func=lambda x: {"ttft_s": "TTFT", "tpot_s": "TPOT (inter-token proxy)"}[x])
st.plotly_chart(figures.fig_drill_timeline(result["requests"], timeline, metric=metric,
                                           slo_s=result["slo"].get("ttft_s" if metric == "ttft_s" else "itl_s")),
                key="dr_chart")
st.markdown("**Phases** (turns by arrival phase; latency over completed turns)")
st.dataframe(tables.phases_table(rep), hide_index=True)
with st.expander(f"Timeline ({len(timeline)} events)"):
    st.dataframe(timeline, hide_index=True)
