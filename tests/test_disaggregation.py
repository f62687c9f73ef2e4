"""Split prefill/decode pools: decode never shares a step with a long prefill, so streams do not stall."""

from __future__ import annotations

from twin.runner import run_scenario
from twin.scenario import load_scenario

from test_fleet import check_invariants

SHORT = ["fleet.traffic.duration_s=80"]
COLOCATED = "fleet.topology.regions=[{name: us-east, pools: [{model: large, nodes: 4}]}]"


def test_disaggregated_pools_remove_mid_stream_stalls_that_colocated_replicas_show():
    split = run_scenario(load_scenario("scenarios/disaggregated-vs-colocated.yaml", overrides=SHORT))
    colo = run_scenario(load_scenario("scenarios/disaggregated-vs-colocated.yaml", overrides=[*SHORT, COLOCATED]))
    check_invariants(split)
    check_invariants(colo)
    assert colo.summary["itl_s"]["p99"] > 2 * split.summary["itl_s"]["p99"]
    ev = split.tables["events"].to_pydict()
    transfers = [v for k, v in zip(ev["kind"], ev["value"]) if k == "request.kv_transferred"]
    assert transfers and all(v > 0.002 for v in transfers)  # overhead + prompt KV bytes / bandwidth
    # prefill generations ran on the prefill pool and decodes on the decode pool
    gen = [(r, s) for k, r, s in zip(ev["kind"], ev["request_id"], ev["scope"]) if k == "generation.queued"]
    assert all("-prefill-" in s for r, s in gen if r.endswith("p"))
    assert all("-decode-" in s for r, s in gen if r.endswith("d"))
