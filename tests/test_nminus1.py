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


def test_several_seeds_a_share_holds_only_on_every_seed_and_its_row_reads_the_worst(monkeypatch):
    import twin.nminus1 as n1

    after = {(0.6, 1): 0.99, (0.6, 2): 0.97, (0.7, 1): 0.77, (0.7, 2): 0.975}

    def one(path, *, share, seed, target, **kw):
        a = after[(share, seed)]
        return {"share": share, "seed": seed, "attainment_before": 0.99, "turns_before": 100, "attainment_after": a,
                "turns_after": 50, "ttft_p99_after_s": 2.0 - a, "holds_all_regions": True,
                "holds_n_minus_1": a >= target, "wall_s": 1.0}

    monkeypatch.setattr(n1, "_one", one)
    rep = n1.check("x.yaml", shares=[0.6, 0.7], region="us-east", fail_at_s=60.0, seeds=[1, 2])
    six, seven = rep["rows"]
    assert six["holds_n_minus_1"] and six["seeds_held"] == 2 and six["attainment_after"] == 0.97
    assert not seven["holds_n_minus_1"] and seven["seeds_held"] == 1
    assert seven["attainment_after"] == 0.77 and seven["ttft_p99_after_s"] == 2.0 - 0.77
    assert [s["seed"] for s in seven["seeds"]] == [1, 2] and seven["turns_after"] == 100
    assert rep["largest_share_n_minus_1_holds"] == 0.6 and rep["seeds"] == [1, 2]
    text = n1.format_check(rep)
    assert "holds on every seed: 0.60" in text and "1 of 2" in text and "0.770 0.975" in text


def test_several_seeds_run_each_seed(capsys):
    import json

    assert main(["n-minus-1", "--shares", "0.3", "--seeds", "1,2", "--json", "--set", "fleet.traffic.duration_s=130",
                 "--set", "fleet.failover.dns_failover_s=10"]) == 0
    rep = json.loads(capsys.readouterr().out)
    row = rep["rows"][0]
    assert [s["seed"] for s in row["seeds"]] == [1, 2]
    assert row["seeds"][0]["turns_after"] != row["seeds"][1]["turns_after"]  # two draws of the traffic
    assert row["turns_after"] == sum(s["turns_after"] for s in row["seeds"])
    assert main(["n-minus-1", "--seeds", "1,x"]) == 2
    assert main(["n-minus-1", "--seeds", ","]) == 2
