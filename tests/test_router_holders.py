"""The llm-d scorer's kept-list filter (``scorer_terms.kept_live``) decides as the full scan.

``kept_live`` finds the candidates that may still win from the prefix index's holders of one block, a
second seed (the first candidate in bound order holding a widely held block) and a walk over runs of equal
queue and kv terms. Its shortcuts pay in a fleet-like shape that the general epoch test reaches only now and
then: many replicas, most of them tied (idle: shortest queue, empty KV), long shared system prompts held by
many replicas, sessions whose history sits on one or a few. This test drives that shape, with the threshold of
"widely held" (``FEW_HOLDERS``) and the index's holder marks drawn too so that every branch runs, and requires
the decision of a router given ``CandidateList``s to equal the full scan's (every candidate scored) each time.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.policies import ReplicaSnapshot, RequestFacts, build_router
from twin.policies import scorer_terms
from twin.policies.prng import SplitMix64
from twin.policies.types import CandidateList

from prefixkit import chained


def snapshot(i: int, rng: SplitMix64, now: float) -> ReplicaSnapshot:
    idle = rng.random() < 0.6
    return ReplicaSnapshot(replica_id=f"r{i:02d}", region=("us", "us", "eu")[i % 3], model="m", pool="default",
                           healthy=True, num_running=0 if idle else 1,
                           num_waiting=0 if idle else (0, 1, 2, 5)[rng.randrange(4)],
                           kv_usage=0.0 if idle else (0.0, 0.25, 0.5, 0.75)[rng.randrange(4)],
                           outstanding_tokens=0, max_model_len=8192, scraped_at_s=now)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(9, 60), few=st.sampled_from([0, 1, 3, 8]),
       weights=st.sampled_from([(3.0, 2.0, 2.0), (1.0, 2.0, 2.0), (3.0, 1.0, 0.0), (0.5, 1.0, 1.0)]),
       capacity=st.sampled_from([12, 1000]), ttl=st.sampled_from([None, 1.0]), stride=st.sampled_from([1, 2, 8]),
       dense=st.sampled_from([0, 3, 64]))
def test_the_kept_filter_decides_as_the_full_scan(seed: int, size: int, few: int, weights: tuple[float, float, float],
                                                  capacity: int, ttl: float | None, stride: int, dense: int) -> None:
    pw, qw, kw = weights
    scorer = {"kind": "llm_d_scorer", "prefix_weight": pw, "queue_weight": qw, "kv_usage_weight": kw,
              "index_capacity_blocks": capacity, "index_ttl_s": ttl}
    listed, full = build_router(scorer, seed=1), build_router(scorer, seed=1)
    listed.omit_scores()
    # holders kept for the blocks below dense and every stride-th block: a superset for the others
    listed.index.holder_stride, listed.index.holder_dense = stride, dense
    rng = SplitMix64(seed)
    systems = [[rng.randrange(10**6) for _ in range(4 + rng.randrange(9))] for _ in range(3)]
    sessions: list[list[int]] = []
    epoch, removed = 0, ()
    fleet: list[ReplicaSnapshot] = []
    was = scorer_terms.FEW_HOLDERS
    scorer_terms.FEW_HOLDERS = few
    try:
        for n in range(250):
            now = n * 0.02
            if n % 40 == 0:  # a scrape: new signals, every replica listed again
                fleet = [snapshot(i, rng, now) for i in range(size)]
                epoch, removed = epoch + 1, ()
            elif rng.random() < 0.1 and len(fleet) - len(removed) > 1:  # one runs out of room: same epoch
                left = [r for r in fleet if r.replica_id not in removed]
                removed = (*removed, left[rng.randrange(len(left))].replica_id)
            if not sessions or rng.random() < 0.35:  # a new session: a system prompt and a first message
                sessions.append(list(systems[rng.randrange(3)]))
                s = len(sessions) - 1
            else:
                s = rng.randrange(len(sessions))
            sessions[s].extend(rng.randrange(10**6) for _ in range(1 + rng.randrange(3)))
            prompt = chained(sessions[s])
            request = RequestFacts(request_id=f"q{n}", tenant="t", tier="paid", session_id=f"s{s}",
                                   prompt_tokens=16 * len(prompt) + 5, expected_output_tokens=50, block_hashes=prompt,
                                   model="m", region=("us", None)[rng.randrange(2)], allowed_regions=None,
                                   needs_long_context=False)
            shown = CandidateList(r for r in fleet if r.replica_id not in removed)
            shown.epoch, shown.removed = epoch, removed
            a = listed.route(request, shown, now)
            b = full.route(request, list(shown), now)
            assert a.replica_id == b.replica_id
            # now and then the request lands elsewhere (a retry, say), so a session's history sits on
            # several replicas, each holding a different length of it
            to = a.replica_id if rng.random() < 0.7 else shown[rng.randrange(len(shown))].replica_id
            for r in (listed, full):
                r.on_routed(request, to, now)
    finally:
        scorer_terms.FEW_HOLDERS = was


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(1, 80))
def test_kept_order_and_ranks_follow_drops(seed: int, size: int) -> None:
    """As candidates are dropped, the kept bound order and the ranks ``drop`` bisects by stay as a fresh
    derivation gives them, and ``_first_holder`` finds the first holder in that order: with a holder list
    kept under one stamp while candidates are dropped and holders leave it, and with a fresh list each time."""
    rng = SplitMix64(seed)
    listed = [snapshot(i, rng, 0.0) for i in range(size)]
    terms = scorer_terms.ScorerTerms(3.0, 2.0, 2.0, listed, listed=True)
    ids = [r.replica_id for r in listed]
    # holders: some listed replicas and some that are not candidates at all; kept under one stamp while
    # they only leave (``left``), as ApproxPrefixIndex.holders_stamp promises
    kept = {rid for rid in ids if rng.random() < 0.3} | {f"x{j}" for j in range(rng.randrange(5))}
    left: set[str] = set()
    while True:
        fresh = scorer_terms.ScorerTerms(3.0, 2.0, 2.0, listed, listed=True)
        assert [terms.ids[i] for i in terms.order] == [fresh.ids[i] for i in fresh.order]
        if terms.runs is not None:  # drops leave each run in bound order: together they are the order
            assert [i for run in terms.runs for i in run] == terms.order
        assert [terms.rank[i] for i in terms.order] == sorted(terms.rank[i] for i in terms.order)
        ids = [r.replica_id for r in listed]
        held = {rid for rid in ids if rng.random() < 0.2} | {f"x{j}" for j in range(rng.randrange(5))}
        first = terms.pos[ids[rng.randrange(len(ids))]]  # type: ignore[index]
        want = next((j for j in terms.order if j != first and terms.ids[j] in held), -1)  # type: ignore[union-attr]
        assert scorer_terms._first_holder(terms, held, first) == want
        left |= {rid for rid in kept if rng.random() < 0.1}
        want = next((j for j in terms.order  # type: ignore[union-attr]
                     if j != first and terms.ids[j] in kept and terms.ids[j] not in left), -1)
        assert scorer_terms._first_holder(terms, kept, first, stamp=7, holds=lambda rid: rid not in left) == want
        if len(listed) == 1:
            break
        if rng.random() < 0.5:
            scorer_terms.runs(terms)
        gone = listed.pop(rng.randrange(len(listed)))
        if not terms.drop(gone.replica_id):
            terms = scorer_terms.ScorerTerms(3.0, 2.0, 2.0, listed, listed=True)


def test_the_walk_resumes_at_the_first_holders_own_run() -> None:
    """Worked by hand (``pw, qw, kw = 3, 2, 2``; a prompt of 10 blocks): r0 is idle and holds nothing (bound
    6.5); r1 and r2 share queue and kv terms (bound 5) and hold 6 and 7 blocks; r3, the session's replica and
    the first seed, holds all 10 (total 4.0). Block 1 is held by three, so the first holder, r1, is the second
    seed (3.8, no better). The walk tests r0 at t(1) = 3.8 < 4.0 and jumps to r1's run, where r2 (4.1) is
    kept: resuming after that run instead would lose the winner."""
    rows = [("r0", 0, 0.25, 0), ("r1", 1, 0.5, 6), ("r2", 1, 0.5, 7), ("r3", 2, 0.5, 10)]
    listed = [ReplicaSnapshot(replica_id=rid, region="us", model="m", pool="default", healthy=True, num_running=1,
                              num_waiting=w, kv_usage=u, outstanding_tokens=0, max_model_len=8192, scraped_at_s=0.0)
              for rid, w, u, _ in rows]
    hashes = chained(list(range(10)))
    index = build_router({"kind": "llm_d_scorer"}, seed=1).index
    for rid, _, _, held in rows:
        if held:
            index.record(rid, hashes[:held], 0.0)
    terms = scorer_terms.ScorerTerms(3.0, 2.0, 2.0, listed, listed=True)
    assert terms.bounds == [6.5, 5.0, 5.0, 4.0]
    match = index.matcher(hashes, 0.0)
    was = scorer_terms.FEW_HOLDERS
    scorer_terms.FEW_HOLDERS = 2
    try:
        for _ in range(2):  # the second time through the holder list kept under its stamp
            live, best_total, best_id = scorer_terms.kept_live(terms, index, hashes, match, first=3, m_first=10,
                                                               pw=3.0)
            assert (live, best_total, best_id) == ([2], 4.0, "r3")
    finally:
        scorer_terms.FEW_HOLDERS = was
