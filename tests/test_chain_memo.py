"""A run's cost does not depend on the runs before it in the process: ``run_scenario`` starts from an empty
prompt-chain memo (``twin.models.tokens``), so a run keeps only its own prompts' chains."""

from __future__ import annotations

from benchmarks.single_replica import scenario
from twin.models import tokens
from twin.runner import run_scenario
from twin.scenario import parse_scenario


def _run(seed: int) -> set:
    sc = scenario(n=60, profile="llama3-70b-fp8-tp4-h100", arrival={"kind": "poisson", "rate_per_s": 5.0})
    data = sc.model_dump(mode="json", exclude_none=True)
    # Shared system prompts, so prompts hit and their chains are hashed (and memoised); a pool with
    # nothing hashed skips hashing a prompt that cannot hit (BlockPool.find_hit).
    data["workload"]["shared_prefix"] = {"groups": 4, "tokens": 512, "fraction": 0.8}
    sc = parse_scenario({**data, "seed": seed})
    assert run_scenario(sc).ok
    return set(tokens._HEAD_SEEN) | set(tokens._HEAD_MEMO)


def test_a_run_starts_from_an_empty_chain_memo() -> None:
    first = _run(1)
    assert first, "the prompts start with a segment and hit: the memo saw them"
    second = _run(2)
    assert second - first, "another seed's prompts bring keys of their own (system prompts may be the same)"
    # A rerun of the first seed after the second sees exactly its own keys again: none of the second run's
    # own keys survived into it.
    assert _run(1) == first
