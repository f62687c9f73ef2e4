"""A run's cost does not depend on the runs before it in the process: ``run_scenario`` starts from an empty
prompt-chain memo (``twin.models.tokens``), so a run keeps only its own prompts' chains."""

from __future__ import annotations

from benchmarks.single_replica import scenario
from twin.models import tokens
from twin.runner import run_scenario
from twin.scenario import parse_scenario


def _run(seed: int) -> set:
    sc = scenario(n=60, profile="llama3-70b-fp8-tp4-h100", arrival={"kind": "poisson", "rate_per_s": 5.0})
    sc = parse_scenario({**sc.model_dump(mode="json", exclude_none=True), "seed": seed})
    assert run_scenario(sc).ok
    return set(tokens._HEAD_SEEN) | set(tokens._HEAD_MEMO)


def test_a_run_starts_from_an_empty_chain_memo() -> None:
    first = _run(1)
    assert first, "the benchmark's prompts start with a segment: the memo saw them"
    second = _run(2)
    assert second and not first & second, "keys of the earlier run survived into the next"
    assert _run(1) == first  # and a rerun sees exactly its own keys again
