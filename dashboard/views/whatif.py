"""What-if simulation: a scaled-down run of a scenario with changes, next to the same scenario unchanged."""

from __future__ import annotations

import streamlit as st

from dashboard import figures, runs, tables, ui
from twin import charts
from twin.policies import ROUTERS

st.title("What-if simulation")
st.caption("Runs the twin twice at a small fleet.scale: the scenario as it is (baseline) and with your changes "
           "(what-if). Both use the same seed, so they see the same arrivals where the changes allow.")

name, path, size, seed, duration_s, sized = ui.sized_scenario("wi", default="launch-day-10x", duration_s=30)
fleet = sized.fleet
regions = [r.name for r in fleet.topology.regions]

st.subheader("Changes")
c1, c2, c3 = st.columns(3)
with c1:
    mult = st.slider("Traffic multiplier (daily users ×)", 0.25, 5.0, 1.0, 0.25, key="wi_mult",
                     help="offered load × this; the fleet stays the same size")
    routers = ROUTERS.keys()
    router = st.selectbox("Router policy", [f"(scenario's: {fleet.policy.router.kind})", *routers], key="wi_router")
    router = None if router.startswith("(") else router
with c2:
    clear_surges = st.checkbox(f"Remove the scenario's surges ({len(fleet.traffic.surges)})", key="wi_clear_surges")
    add_surge = st.checkbox("Add a surge", key="wi_add_surge")
    surge = None
    if add_surge:
        s_start = st.slider("Surge starts at (s)", 0, int(duration_s), min(5, int(duration_s)), key="wi_surge_start")
        s_ramp = st.slider("Ramp (s)", 0, 60, 5, key="wi_surge_ramp")
        s_hold = st.slider("Hold (s)", 5, 300, 20, 5, key="wi_surge_hold")
        s_mult = st.slider("Surge multiplier", 1.5, 20.0, 5.0, 0.5, key="wi_surge_mult")
        surge = {"start_s": float(s_start), "ramp_s": float(s_ramp), "hold_s": float(s_hold), "multiplier": s_mult}
with c3:
    keep_faults = st.checkbox(f"Keep the scenario's faults ({len(fleet.faults)})", value=True, key="wi_keep_faults")
    lose = st.checkbox("Lose a region", key="wi_lose")
    region_loss = dns = None
    if lose:
        region = st.selectbox("Region", regions, key="wi_region")
        at_s = st.slider("Lost at (s)", 0, int(duration_s), int(duration_s) // 3, key="wi_loss_at")
        back = st.slider("Back at (s; 0 = not in this run)", 0, 600, 0, 5, key="wi_loss_back")
        dns = float(st.slider("DNS failover after (s)", 0, 120, int(fleet.failover.dns_failover_s), key="wi_dns"))
        region_loss = {"region": region, "at_s": float(at_s), "recover_at_s": float(back) if back > at_s else None}
rungs = runs.ladder_rungs()
ladder: dict[str, str] = {}
ladder_enabled = None
if rungs:
    has = getattr(fleet, "ladder", None) is not None
    st.markdown(f"**Degradation ladder** (`fleet.ladder`; this scenario: {'on' if has else 'none'}). "
                "Per rung: auto = its trigger decides, on/off = forced from t=0 (an on-call override).")
    choice = st.radio("Ladder", ["as the scenario has it", "on", "off"], horizontal=True, key="wi_ladder")
    ladder_enabled = {"on": True, "off": False}.get(choice)
    cols = st.columns(len(rungs))
    for col, rung in zip(cols, rungs):
        mode = col.selectbox(rung, runs.LADDER_MODES, key=f"wi_ladder_{rung}", disabled=ladder_enabled is False)
        if mode != "auto" and ladder_enabled is not False:
            ladder[rung] = mode
else:
    st.caption("Degradation-ladder flags appear here once the scenario schema has a `fleet.ladder` section.")

models = fleet.models
st.markdown(f"**Engine** (every served model: {', '.join(models)}; `fleet.models.<model>.engine`). "
            "\"scenario's\" leaves a knob as each model has it.")
SAME = "scenario's"
e1, e2, e3, e4 = st.columns(4)
seqs = e1.selectbox("max_num_seqs", [SAME, 64, 128, 256, 512, 1024], key="wi_max_num_seqs",
                    help="most requests a replica runs at once; "
                         + ", ".join(f"{m}: {c.engine.max_num_seqs}" for m, c in models.items()))
budget = e2.selectbox("max_num_batched_tokens", [SAME, 2048, 4096, 8192, 16384], key="wi_max_num_batched_tokens",
                      help="token budget of one step (prefill chunks and decodes); "
                           + ", ".join(f"{m}: {c.engine.max_num_batched_tokens}" for m, c in models.items()))
prefix = e3.selectbox("Prefix caching", [SAME, "on", "off"], key="wi_prefix_caching")
async_mode = e4.selectbox("Async scheduling", [SAME, "on", "off"], key="wi_async_scheduling",
                          help="vLLM forms step N+1 while step N runs, so an arrival waits one more step "
                               "(the scenario's: on with a GPU profile unless it says otherwise)")
engine = {"max_num_seqs": None if seqs == SAME else seqs,
          "max_num_batched_tokens": None if budget == SAME else budget,
          "enable_prefix_caching": {"on": True, "off": False}.get(prefix),
          "async_scheduling": {"on": True, "off": False}.get(async_mode)}

changes = runs.whatif_overrides(sized, traffic_multiplier=mult, router=router, clear_surges=clear_surges, surge=surge,
                                keep_faults=keep_faults, region_loss=region_loss, dns_failover_s=dns,
                                ladder_enabled=ladder_enabled, ladder=ladder, engine=engine)
with st.expander("Overrides (as `twin run --set`)"):
    st.code("\n".join(["# size (both runs)", *size, "# what-if only", *(changes or ["(none)"])]), language="text")

if st.button("Run baseline and what-if", type="primary", key="wi_run"):
    jobs = [("baseline", tuple(size)), ("what-if", tuple(size + changes))]
    with st.status("Running the twin…", expanded=True) as status:
        bar = st.progress(0.0, text="0 of 2 runs finished")
        done = []
        for i, (label, ov) in enumerate(jobs, 1):
            st.write(f"{label}: {name} with {len(ov)} overrides")
            done.append(ui.cached_run(str(path), ov, seed, label))
            bar.progress(i / len(jobs), text=f"{i} of {len(jobs)} runs finished")
        status.update(label="Both runs finished", state="complete", expanded=False)
    st.session_state["wi_result"] = {"scenario": name, "runs": done}
    st.caption("The bar counts finished runs (baseline, what-if); a single run reports no progress while it runs.")

result = st.session_state.get("wi_result")
if result is None:
    st.info("Set the changes and press **Run baseline and what-if**.")
    st.stop()
base, what = result["runs"]
for view in (base, what):
    if not view.ok:
        ui.show_failure(view)
        st.stop()
st.subheader(f"{result['scenario']}: what-if vs baseline")
if base.overrides == what.overrides:
    st.warning("No changes: the what-if is the baseline.")
slo = what.summary.get("slo", {})
comp = tables.summary_comparison(what.summary, base.summary)
left, right = st.columns([3, 2])
left.plotly_chart(figures.fig_summary_change(comp), key="wi_change")
right.dataframe(comp.drop(columns=["higher_is_better"]), hide_index=True)
st.plotly_chart(figures.fig_latency_vs_baseline(what.tables["requests"], base.tables["requests"], metric="ttft_s",
                                                slo_s=slo.get("ttft_s")), key="wi_ttft")
st.plotly_chart(figures.fig_latency_vs_baseline(what.tables["requests"], base.tables["requests"], metric="tpot_s",
                                                time_col="finish_s", slo_s=slo.get("itl_s")), key="wi_itl")
st.caption("ITL over time is shown by proxy: each completed request's TPOT (mean gap between its tokens) by finish "
           "time. The exact ITL percentiles over all gaps are in the table above.")
for title, fig_fn in (("Queue depth", lambda v: charts.fig_queue_depth(v.tables["levels"])),
                      ("KV-cache usage", lambda v: charts.fig_kv_usage(v.tables["levels"])),
                      ("Outcomes by tier", lambda v: charts.fig_outcomes(v.tables["requests"], by="tier")),
                      ("Cost", lambda v: charts.fig_cost(v.summary))):
    st.markdown(f"**{title}**")
    cb, cw = st.columns(2)
    cb.caption("baseline")
    cb.plotly_chart(fig_fn(base), key=f"wi_{title}_base")
    cw.caption("what-if")
    cw.plotly_chart(fig_fn(what), key=f"wi_{title}_what")
