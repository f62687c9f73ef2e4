"""Every dashboard page driven headless with Streamlit's AppTest (no browser; tiny simulations)."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("streamlit")
pio = pytest.importorskip("plotly.io")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamlit.testing.v1 import AppTest  # noqa: E402

from dashboard import runs, tables  # noqa: E402
from twin.capacity import PRESETS, compute_capacity  # noqa: E402
from twin.cli import main  # noqa: E402
from twin.scenario import load_scenario  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
TIMEOUT_S = 120  # the simulations are tiny, but the test machine may be shared


def _app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception, at.exception
    return at


def _decode(node):
    """plotly's JSON with typed arrays ({"dtype", "bdata": base64}) decoded back to plain lists."""
    if isinstance(node, dict):
        if set(node) >= {"dtype", "bdata"}:
            flat = np.frombuffer(base64.b64decode(node["bdata"]), dtype=np.dtype(node["dtype"]))
            shape = [int(n) for n in str(node.get("shape", len(flat))).split(",")]
            return flat.reshape(shape).tolist()
        return {k: _decode(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_decode(v) for v in node]
    return node


def _figures(at: AppTest) -> list:
    """The page's plotly figures, as the browser would receive them."""
    return [pio.from_json(json.dumps(_decode(json.loads(el.proto.spec)))) for el in at.get("plotly_chart")]


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _ok(at: AppTest) -> None:
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]


def _small(at: AppTest, prefix: str, *, duration_s: int) -> None:
    at.select_slider(key=f"{prefix}_scale").set_value(0.001)
    at.slider(key=f"{prefix}_duration").set_value(duration_s)
    at.run()
    _ok(at)


def test_capacity_page_recomputes_on_every_change():
    at = _app()
    _ok(at)
    exact = compute_capacity(tables.planner_inputs(PRESETS["seed-10m"], round_peak_rps_to=None,
                                                   round_peak_output_tokens_per_s_to=None,
                                                   round_generation_duration_s_to=None))
    m = _metrics(at)
    assert m["GPUs (with reserve)"] == f"{exact.gpus_with_reserve:,}" == "2,128"
    assert m["Binding constraint"] == "latency"
    before = _figures(at)
    assert len(before) == 3
    assert list(before[0].data[0].x)[-1] == exact.replicas_with_reserve

    at.select_slider(key="cap_seed-10m_users").set_value(20_000_000).run()
    _ok(at)
    doubled = _metrics(at)
    assert int(doubled["GPUs (with reserve)"].replace(",", "")) > 2 * 2128 - 8
    assert list(_figures(at)[0].data[0].x)[-1] > list(before[0].data[0].x)[-1]

    at.checkbox(key="cap_seed-10m_round").check().run()  # the note's rounding, at the note's 10M users
    at.select_slider(key="cap_seed-10m_users").set_value(10_000_000).run()
    assert _metrics(at)["GPUs (with reserve)"] == "2,144"  # the 10M note's "≈ 2,150 H100s" (docs/capacity.md)

    at.selectbox(key="cap_seed-10m_profile").set_value("llama3-8b-fp8-tp1-h100").run()
    _ok(at)
    assert _metrics(at)["GPUs (with reserve)"] != "2,144"

    at.selectbox(key="cap_preset").set_value("seed-1m").run()
    _ok(at)
    assert _metrics(at)["GPUs (with reserve)"] == "—"
    assert any("Pick an engine profile" in i.value for i in at.info)


def test_whatif_page_runs_baseline_and_changed_scenario():
    at = _app()
    at.switch_page("views/whatif.py").run()
    _ok(at)
    assert any("Set the changes" in i.value for i in at.info)
    at.selectbox(key="wi_scenario").set_value("baseline-day")
    _small(at, "wi", duration_s=10)
    at.slider(key="wi_mult").set_value(3.0)
    at.selectbox(key="wi_router").set_value("round_robin")
    at.checkbox(key="wi_lose").check()
    at.run()
    _ok(at)
    code = at.code[0].value
    assert "fleet.traffic.daily_users=" in code and "fleet.policy.router={kind: round_robin}" in code
    assert "kind: region_loss" in code
    at.selectbox(key="wi_ladder_speculative_decoding").set_value("on").run()  # baseline-day has no ladder: one is added
    assert "fleet.ladder={policy: {kind: threshold_ladder" in at.code[0].value
    assert "{rung: speculative_decoding, at_s: 0.0, state: 'on'}" in at.code[0].value
    at.radio(key="wi_ladder").set_value("off").run()
    assert "fleet.ladder" not in at.code[0].value  # no ladder to remove
    at.radio(key="wi_ladder").set_value("as the scenario has it").run()
    at.selectbox(key="wi_ladder_speculative_decoding").set_value("auto").run()
    at.checkbox(key="wi_lose").uncheck().run()  # the drill page covers region losses; here the arrivals count
    assert "kind: region_loss" not in at.code[0].value
    at.selectbox(key="wi_max_num_seqs").set_value(64)
    at.selectbox(key="wi_async_scheduling").set_value("off").run()
    models = load_scenario(runs.SCENARIO_DIR / "baseline-day.yaml").fleet.models
    for m in models:  # every served model gets the engine knobs
        assert f"fleet.models.{m}.engine.max_num_seqs=64" in at.code[0].value
        assert f"fleet.models.{m}.engine.async_scheduling=false" in at.code[0].value
    at.button(key="wi_run").click().run()
    _ok(at)
    comparison = at.dataframe[0].value.set_index("metric")
    arrived = comparison.loc["arrived"]
    assert arrived["what_if"] > 2 * arrived["baseline"]  # 3x the users, same fleet
    figs = _figures(at)
    assert len(figs) == 11  # change bars, TTFT, ITL proxy, then queue/KV/outcomes/cost for both runs
    assert {t.name for t in figs[1].data} == {"what-if p50", "what-if p99", "baseline p50", "baseline p99"}
    (bar,) = at.get("progress")  # counts finished runs
    assert bar.proto.value == 100 and bar.proto.text == "2 of 2 runs finished"


def test_drill_page_marks_the_region_loss():
    at = _app()
    at.switch_page("views/drill.py").run()
    _ok(at)
    _small(at, "dr", duration_s=40)
    at.slider(key="dr_at").set_value(10)
    at.slider(key="dr_back").set_value(30)
    at.selectbox(key="dr_region").set_value("us-east")
    at.run()
    at.button(key="dr_run").click().run()
    _ok(at)
    assert int(_metrics(at)["Live streams dropped"]) >= 0
    (fig,) = _figures(at)
    marks = {a.text: s.x0 for s, a in zip(fig.layout.shapes, fig.layout.annotations)}
    assert marks["region.lost"] == 10.0
    assert "dns.failed_over" in marks and marks["dns.failed_over"] >= 10.0
    phases = at.dataframe[0].value
    assert list(phases["phase"])[0] == "before" and phases["turns"].sum() > 0


def test_policy_page_runs_a_local_sweep_and_reads_it_back(tmp_path):
    at = _app()
    at.switch_page("views/policies.py").run()
    _ok(at)
    _small(at, "pc", duration_s=5)
    at.multiselect(key="pc_routers").set_value(["round_robin", "least_outstanding_tokens"])
    at.slider(key="pc_seeds").set_value(2)
    at.text_input(key="pc_root").set_value(str(tmp_path))
    at.run()
    at.button(key="pc_run").click().run()
    _ok(at)
    assert len(list(tmp_path.glob("dashboard-baseline-day-*/runs/*/summary.json"))) == 4  # a twin sweep folder
    (fig,) = _figures(at)
    assert sorted(fig.data[0].x) == ["least_outstanding_tokens", "round_robin"]
    assert len(fig.data[0].error_y.array) == 2
    table = at.dataframe[0].value
    assert set(table["n"]) == {2} and set(table["metric"]) == {"ttft_p99_s"}

    folder = next(tmp_path.glob("dashboard-baseline-day-*"))
    at.radio(key="pc_source").set_value("Read a sweep folder").run()
    at.text_input(key="pc_folder_in").set_value(str(folder)).run()
    at.button(key="pc_read").click().run()
    _ok(at)
    assert set(at.selectbox(key="pc_metric").options) >= {"ttft_p99_s", "goodput_rps", "slo_attainment",
                                                           "load_spread_cv"}
    at.selectbox(key="pc_metric").set_value("goodput_rps").run()
    _ok(at)
    assert _figures(at)[0].layout.title.text.startswith("goodput_rps")


def test_dashboard_command_serves_the_app_on_loopback(capsys):
    assert main(["dashboard", "--print-command", "--port", "8765"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4] == APP
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1" and cmd[cmd.index("--server.port") + 1] == "8765"
    assert cmd[cmd.index("--server.headless") + 1] == "true"


def test_drill_page_loads_a_twin_drill_folder(tmp_path, capsys):
    out = tmp_path / "drill"
    assert main(["drill", "region-loss", "--region", "eu-west", "--at", "8", "--out", str(out),
                 "--set", "fleet.scale=0.001", "--set", "fleet.traffic.duration_s=20"]) == 0
    capsys.readouterr()
    at = _app()
    at.switch_page("views/drill.py").run()
    at.radio(key="dr_source").set_value("Load a folder written by `twin drill --out`").run()
    at.text_input(key="dr_folder").set_value(str(out)).run()
    at.button(key="dr_load").click().run()
    _ok(at)
    assert "eu-west lost at t=8 s" in at.subheader[0].value
    (fig,) = _figures(at)
    marks = {a.text: s.x0 for s, a in zip(fig.layout.shapes, fig.layout.annotations)}
    assert marks["region.lost"] == 8.0
    at.text_input(key="dr_folder").set_value(str(tmp_path / "missing")).run()
    at.button(key="dr_load").click().run()
    assert any("cannot read" in e.value for e in at.error)
