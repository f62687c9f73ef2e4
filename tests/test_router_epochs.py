"""A host list with an epoch (``CandidateList``) changes no decision, and the twin's host keeps its promise.

``LlmDScorerRouter`` keeps the candidates and scraped-signal terms it derived from a list for as long as
the host hands over lists with that epoch (dropping the replicas the list names removed), and then reads
only the candidates that can still win. The first test drives three scorers side by side through random
fleets, scrapes, health changes, lists that lose replicas between scrapes (as room runs out: same epoch,
longer ``removed``) and ledger refreshes (new snapshot objects, same epoch): one given the
``CandidateList``, one the same replicas as a plain list (scores omitted: the pruned path), one listing
every score (the full scan). Decisions must match, and the first two must leave the prefix index holding
the same entries once those past their TTL are expired (expiry is lazy, at a match, record or eviction of
that replica, and the kept list matches fewer replicas, so entries past their TTL may linger in one index
and not the other; a lingering entry only sends a candidate to an exact match, which expires it first).
The second checks a drop against terms derived from the shorter list.

The third drives the twin's ``Router`` host (room lists that lose a replica in place, their epochs) and
checks each list against the room rule computed from scratch, and that an epoch seen twice lists the same
replicas with the same scraped fields, less those named removed since.
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.models.router import ReplicaHandle, Router
from twin.policies import ReplicaSnapshot, RequestFacts, build_router
from twin.policies.prng import SplitMix64
from twin.policies.scorer_terms import ScorerTerms, runs
from twin.policies.types import CandidateList

from prefixkit import chained

REGIONS = ("us", "eu", "ap")
WEIGHTS = st.sampled_from([0.0, 1.0, 2.0, 3.0])


def replica(rng: SplitMix64, i: int, now: float) -> ReplicaSnapshot:
    return ReplicaSnapshot(replica_id=f"r{i:02d}", region=REGIONS[rng.randrange(3)],
                           model=("m", "m", "n")[rng.randrange(3)],
                           pool=("default", "default", "long_context")[rng.randrange(3)], healthy=rng.random() < 0.95,
                           num_running=1, num_waiting=rng.randrange(4), kv_usage=rng.randrange(4) / 4,
                           outstanding_tokens=0, max_model_len=(1000, 4096, 8192)[rng.randrange(3)], scraped_at_s=now)


def with_tokens(r: ReplicaSnapshot, tokens: int) -> ReplicaSnapshot:
    return ReplicaSnapshot(replica_id=r.replica_id, region=r.region, model=r.model, pool=r.pool, healthy=r.healthy,
                           num_running=r.num_running, num_waiting=r.num_waiting, kv_usage=r.kv_usage,
                           outstanding_tokens=tokens, max_model_len=r.max_model_len, scraped_at_s=r.scraped_at_s)


def unexpired(index, now: float) -> dict[str, list[tuple[int, float]]]:
    """Each replica's LRU entries, in LRU order, less those past the TTL at ``now``."""
    ttl = index.ttl_s
    kept = {rid: [(h, t) for h, t in index.lru_items(rid) if ttl is None or now - t <= ttl] for rid in index.replicas()}
    return {rid: entries for rid, entries in kept.items() if entries}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(1, 60), prefix_w=WEIGHTS, queue_w=WEIGHTS, kv_w=WEIGHTS,
       ttl=st.sampled_from([None, 0.5, 3.0]), capacity=st.sampled_from([8, 1000]), wrapped=st.booleans())
def test_a_kept_list_decides_as_a_plain_list(seed: int, size: int, prefix_w: float, queue_w: float, kv_w: float,
                                             ttl: float | None, capacity: int, wrapped: bool) -> None:
    scorer = {"kind": "llm_d_scorer", "prefix_weight": prefix_w, "queue_weight": queue_w, "kv_usage_weight": kv_w,
              "index_ttl_s": ttl, "index_capacity_blocks": capacity}
    params = {"kind": "long_context_pool", "inner": scorer} if wrapped else scorer
    listed, plain, full = (build_router(params, seed=3) for _ in range(3))
    listed.omit_scores()
    plain.omit_scores()
    rng = SplitMix64(seed)
    epoch, removed = 0, ()
    fleet = [replica(rng, i, 0.0) for i in range(size)]
    shown = list(fleet)
    systems = [[rng.randrange(50) for _ in range(1 + rng.randrange(8))] for _ in range(3)]
    sessions = [list(systems[s % 3]) for s in range(12)]
    for n in range(150):
        now = n * 0.05
        u = rng.random()
        if u < 0.08:  # a scrape: new signals and health everywhere, every replica listed again
            fleet = [replica(rng, i, now) for i in range(size)]
            shown, epoch, removed = list(fleet), epoch + 1, ()
        elif u < 0.3 and len(shown) > 1:  # replicas run out of room: the list loses them, the epoch stays
            for _ in range(1 + (rng.random() < 0.3)):
                if len(shown) > 1:
                    removed = (*removed, shown.pop(rng.randrange(len(shown))).replica_id)
        elif u < 0.5:  # the ledger refreshes one snapshot: a new object, same scraped fields, same epoch
            j = rng.randrange(len(shown))
            shown[j] = with_tokens(shown[j], 16 * rng.randrange(50))
        s = rng.randrange(len(sessions))
        if rng.random() < 0.9:
            sessions[s].extend(rng.randrange(10**6) for _ in range(1 + rng.randrange(3)))
        prompt = chained(sessions[s]) if rng.random() < 0.85 else ()
        request = RequestFacts(
            request_id=f"q{n}", tenant="t", tier="paid", session_id=f"s{s}" if rng.random() < 0.8 else None,
            prompt_tokens=16 * len(prompt) + 5, expected_output_tokens=(50, 1500, 5000)[rng.randrange(3)],
            block_hashes=prompt, model=("m", "m", "n")[rng.randrange(3)], region=(None, *REGIONS)[rng.randrange(4)],
            allowed_regions=(None, None, ("us", "eu"))[rng.randrange(3)], needs_long_context=rng.random() < 0.2)
        given_list = CandidateList(shown)
        given_list.epoch, given_list.removed = epoch, removed
        a = listed.route(request, given_list, now)
        b = plain.route(request, list(shown), now)
        c = full.route(request, list(shown), now)
        assert (a.replica_id, a.reason) == (b.replica_id, b.reason) == (c.replica_id, c.reason)
        assert a.scores == ()
        inner_a, inner_b = (r.inner if wrapped else r for r in (listed, plain))
        assert unexpired(inner_a.index, now) == unexpired(inner_b.index, now)
        if a.replica_id is not None:
            for r in (listed, plain, full):
                r.on_routed(request, a.replica_id, now)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(1, 14), weights=st.tuples(WEIGHTS, WEIGHTS, WEIGHTS))
def test_dropped_terms_are_the_terms_of_the_list_less_the_dropped(seed: int, size: int,
                                                                  weights: tuple[float, float, float]) -> None:
    """``ScorerTerms.drop`` leaves, at the remaining candidates' positions, what deriving the terms from the
    shorter list gives (or says the terms must be derived again)."""
    rng = SplitMix64(seed)
    listed = [replica(rng, i, 0.0) for i in range(size)]
    terms = ScorerTerms(*weights, listed, listed=True)
    while len(listed) > 1:
        gone = listed.pop(rng.randrange(len(listed)))
        fresh = ScorerTerms(*weights, listed, listed=True)
        kept = gone.replica_id if rng.random() < 0.5 else listed[0].replica_id
        terms.idle_best = terms.pos[kept]  # type: ignore[index]
        if rng.random() < 0.7:
            runs(terms)  # built, so the drop updates them
        if not terms.drop(gone.replica_id):
            terms = fresh
            continue
        assert terms.idle_best is None or terms.ids[terms.idle_best] in fresh.ids  # a kept winner is still listed
        where = [terms.pos[r.replica_id] for r in listed]  # type: ignore[index]
        assert [terms.ids[i] for i in where] == fresh.ids
        for name in ("queue", "kv", "bounds"):
            assert [getattr(terms, name)[i] for i in where] == getattr(fresh, name)
        assert [terms.ids[i] for i in terms.order] == [fresh.ids[i] for i in fresh.order]  # type: ignore[union-attr]
        assert (terms.max_bound, terms.size) == (fresh.max_bound, fresh.size)
        # the runs, one left empty by a drop aside, still cut the order into stretches of equal terms
        cut = runs(terms)
        assert [i for run in cut for i in run] == terms.order
        assert all(len({(terms.queue[i], terms.kv[i]) for i in run}) == 1 for run in cut if run)


# ------------------------------------------------------------------------------------------ the twin's host
class FakeEngine:
    def __init__(self) -> None:
        self.running: list = []
        self.waiting: list = []
        self.used = 0.0
        self.kv = SimpleNamespace(usage=lambda: self.used)


def handle(i: int, rng: SplitMix64) -> ReplicaHandle:
    rep = SimpleNamespace(scope=f"fleet.{REGIONS[i % 3]}.r{i:03d}", healthy=True, engine=FakeEngine())
    return ReplicaHandle(rep, region=REGIONS[i % 3], node="n", model=("m", "n")[i % 5 == 4],
                         pool=("default", "long_context")[i % 7 == 6], max_model_len=(4096, 8192)[rng.randrange(2)],
                         index=i)


def room_rule(router: Router, model: str, regions, max_waiting: int, pool, region) -> list[str]:
    """The candidates a room list must hold, from scratch: healthy replicas of the model (in the pool and
    regions) with scraped waiting + sent since the scrape below the limit, in replica_id order."""
    out = []
    for h, s in zip(router.handles, router.snapshots, strict=True):
        if (s.healthy and s.model == model and (pool is None or s.pool == pool)
                and (regions is None or s.region in regions)
                and (not max_waiting or s.num_waiting + h.pending_since_scrape < max_waiting)
                and (region is None or s.region == region)):
            out.append(s.replica_id)
    return sorted(out)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(1, 40))
def test_room_lists_shrink_as_a_rebuild_would_and_keep_their_epoch_promise(seed: int, size: int) -> None:
    rng = SplitMix64(seed)
    env = SimpleNamespace(now=0.0)
    handles = [handle(i, rng) for i in range(size)]
    router = Router(env, replicas=handles, policy_config={"kind": "llm_d_scorer"}, seed=1,  # type: ignore[arg-type]
                    scrape_interval_s=1.0, recorder=None)  # type: ignore[arg-type]
    promised: dict[int, tuple[tuple[str, ...], list]] = {}
    for n in range(300):
        u = rng.random()
        if u < 0.05:  # a scrape with new queues, KV and health
            for h in handles:
                h.replica.engine.waiting = [None] * rng.randrange(5)
                h.replica.engine.used = rng.randrange(5) / 4
                h.replica.healthy = rng.random() < 0.9
            router.scrape()
        elif u < 0.08:
            router.mark_unhealthy(handles[rng.randrange(size)].scope)
        elif u < 0.1:
            h = handle(len(handles), rng)
            handles.append(h)
            router.add_replica(h)
        model, pool = ("m", "n")[rng.randrange(2)], (None, "default")[rng.randrange(2)]
        regions = (None, ("us", "eu"))[rng.randrange(2)]
        max_waiting = (0, 2, 3, 8)[rng.randrange(4)]
        facts = RequestFacts(request_id=f"q{n}", tenant="t", tier="paid", session_id=None, prompt_tokens=100,
                             expected_output_tokens=(50, 5000)[rng.randrange(2)], block_hashes=(), model=model,
                             region=REGIONS[rng.randrange(3)], allowed_regions=regions, needs_long_context=False)
        got = router.candidates_for(facts, regions, max_waiting, pool)
        ids = [s.replica_id for s in got]
        local = room_rule(router, model, regions, max_waiting, pool, facts.region)
        long_enough = [s for s in router.snapshots if s.replica_id in local and s.max_model_len >= facts.total_tokens]
        assert ids == (local if long_enough else room_rule(router, model, regions, max_waiting, pool, None))
        fields = [(s.replica_id, s.healthy, s.num_waiting, s.kv_usage, s.region, s.model, s.pool,
                   s.max_model_len, s.scraped_at_s) for s in got]
        # an epoch seen before: the list it was then, less the replicas removed since
        was_removed, was_fields = promised.setdefault(got.epoch, (got.removed, fields))
        assert got.removed[:len(was_removed)] == was_removed
        since = set(got.removed[len(was_removed):])
        assert fields == [f for f in was_fields if f[0] not in since]
        # a region part's longest max_model_len and its count, kept as replicas leave, are a recount's
        for key, room in router._room.items():
            if len(key) == 5:
                lengths = [router.snapshots[i].max_model_len for i in room[0]]
                assert room[1:] == [max(lengths, default=-1), lengths.count(max(lengths, default=-1))]
        if got and rng.random() < 0.7:
            target = got[rng.randrange(len(got))].replica_id
            router.sent(facts, target)
