"""``llm_d_scorer``'s tie rule. By default ties go to the smallest ``replica_id``; with ``tie_break: random``
the pick is a seeded uniform draw among the tied best, as llm-d's max-score picker shuffles before its stable
sort. Either way only a best-scoring candidate is chosen, and the same seed gives the same picks."""

from __future__ import annotations

from collections import Counter

from twin.policies import ReplicaSnapshot, RequestFacts, build_router


def _snap(i: int, *, kv: float = 0.0) -> ReplicaSnapshot:
    return ReplicaSnapshot(replica_id=f"r{i:02d}", region="a", model="m", pool="default", healthy=True,
                           num_running=0, num_waiting=0, kv_usage=kv, outstanding_tokens=0, max_model_len=4096,
                           scraped_at_s=0.0)


def _req(n: int) -> RequestFacts:
    return RequestFacts(request_id=f"q{n}", tenant="t", tier="paid", session_id=None, prompt_tokens=37,
                        expected_output_tokens=10, block_hashes=(1000 + n, 2000 + n), model="m", region="a",
                        allowed_regions=None, needs_long_context=False)


def _picks(tie_break: str, seed: int, *, omit: bool, n: int = 400) -> list[str]:
    router = build_router({"kind": "llm_d_scorer", "tie_break": tie_break}, seed=seed)
    if omit:
        router.omit_scores()
    # r00 is busier (lower KV score) and never ties; r01..r08 are idle and tie on every fresh prompt.
    replicas = [_snap(0, kv=0.5), *(_snap(i) for i in range(1, 9))]
    return [router.route(_req(k), replicas, 0.0).replica_id for k in range(n)]


def test_default_ties_go_to_the_smallest_replica_id() -> None:
    assert set(_picks("replica_id", 1, omit=False)) == {"r01"}
    assert set(_picks("replica_id", 1, omit=True)) == {"r01"}


def test_random_ties_spread_over_the_tied_best_only_and_repeat_with_the_seed() -> None:
    for omit in (False, True):
        picks = _picks("random", 7, omit=omit)
        counts = Counter(picks)
        assert set(counts) == {f"r{i:02d}" for i in range(1, 9)}  # never r00, every tied replica
        assert max(counts.values()) < 2 * min(counts.values())  # roughly uniform over 400 draws
        assert picks == _picks("random", 7, omit=omit)
        assert picks != _picks("random", 8, omit=omit)
