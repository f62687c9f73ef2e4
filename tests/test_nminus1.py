"""The N-1 check separates a share the surviving regions can carry from one they cannot."""

from __future__ import annotations

from twin.cli import main
from twin.nminus1 import check


def test_n_minus_1_holds_at_low_share_and_fails_at_full_share():
    rep = check("scenarios/n-minus-1.yaml", shares=[0.3, 1.0], region="us-east", fail_at_s=60.0,
                overrides=["fleet.traffic.duration_s=130", "fleet.failover.dns_failover_s=10"])
    low, full = rep["rows"]
    assert low["holds_n_minus_1"] and not full["holds_n_minus_1"]
    assert full["attainment_after"] < low["attainment_after"]
    assert rep["largest_share_n_minus_1_holds"] == 0.3


def test_n_minus_1_bad_shares_exit_2(capsys):
    assert main(["n-minus-1", "--shares", "a,b"]) == 2
