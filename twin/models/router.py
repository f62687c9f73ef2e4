"""The router component: hosts a policy from ``twin.policies`` and feeds it what a real router sees.

Per-replica signals (running, waiting, KV usage) are scraped every ``scrape_interval_s`` into frozen
``ReplicaSnapshot``s, so they are as stale as a Prometheus scrape; the router's own outstanding-token
ledger is fresh (a real router counts what it sent). Snapshots are rebuilt per scrape, and only the
routed replica's snapshot is replaced when its ledger changes, so a routing decision costs no more than
the policy itself.
"""

from __future__ import annotations

import dataclasses
import itertools
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import simpy

from twin.models.recorder import Recorder
from twin.models.replica import Replica
from twin.policies import ReplicaSnapshot, RequestFacts, RoutingDecision, build_router


def _room_key(model: str, allowed_regions: Sequence[str] | None, pool: str | None, max_waiting: int) -> tuple:
    """The key of a room list (``Router._room``, ``_epoch``); a region's part adds the region."""
    return (model, None if allowed_regions is None else tuple(allowed_regions), pool, max_waiting)


def _longest(snaps: list[ReplicaSnapshot], idx: list[int]) -> tuple[int, int]:
    """The largest ``max_model_len`` among ``idx`` (-1 if none) and how many have it."""
    lengths = [snaps[i].max_model_len for i in idx]
    top = max(lengths, default=-1)
    return top, lengths.count(top)


class RoomList(Sequence):
    """A room list as the policy is handed it: a ``CandidateList`` (``epoch``, ``removed``) whose snapshots
    are looked up when the policy first reads it, not when the host hands it over.

    The llm-d scorer reads the list only when its epoch or the request's class is new to it (it keeps
    what it derived from it, see ``CandidateList``), so building the list per decision was the one pass
    over a whole region left per decision (~2% of the run at 1,080 replicas, growing with the fleet).
    The host hands it over at once and changes nothing before the policy returns, so it lists what a
    list built at hand-over would; the first read fixes it (a later read sees the same list).
    """

    __slots__ = ("epoch", "removed", "_snaps", "_idx", "_list")

    def __init__(self, snaps: list[ReplicaSnapshot], idx: list[int], epoch: int, removed: tuple) -> None:
        self.epoch, self.removed = epoch, removed
        self._snaps, self._idx = snaps, idx
        self._list: list[ReplicaSnapshot] | None = None

    def _items(self) -> list[ReplicaSnapshot]:
        out = self._list
        if out is None:
            out = self._list = list(map(self._snaps.__getitem__, self._idx))
        return out

    def __len__(self) -> int:
        return len(self._idx) if self._list is None else len(self._list)

    def __getitem__(self, i):
        return self._items()[i]

    def __iter__(self):
        return iter(self._items())


class ReplicaHandle:
    """What the fleet knows about one replica besides the engine: placement and model."""

    __slots__ = ("replica", "region", "node", "model", "pool", "max_model_len", "outstanding_tokens",
                 "pending_since_scrape", "index", "draining", "started_s", "removed_s")

    def __init__(self, replica: Replica, *, region: str, node: str, model: str, pool: str, max_model_len: int,
                 index: int) -> None:
        self.replica = replica
        self.region = region
        self.node = node
        self.model = model
        self.pool = pool
        self.max_model_len = max_model_len
        self.outstanding_tokens = 0
        self.pending_since_scrape = 0
        self.index = index
        self.draining = False  # taken out of rotation by the autoscaler
        self.started_s = 0.0  # when it started costing GPU-hours
        self.removed_s: float | None = None

    @property
    def scope(self) -> str:
        return self.replica.scope


class Router:
    def __init__(self, env: simpy.Environment, *, replicas: list[ReplicaHandle], policy_config, seed: int,
                 scrape_interval_s: float, recorder: Recorder) -> None:
        self.env = env
        self.handles = replicas
        self.by_id = {h.scope: h for h in replicas}
        self.policy = build_router(policy_config, seed=seed)
        # the twin records where a request went, never the per-candidate scores, so the policy may
        # choose without scoring every candidate (same choice; see BaseRouter.omit_scores)
        self.policy.omit_scores()
        self.scrape_interval_s = scrape_interval_s
        self.rec = recorder
        self.snapshots: list[ReplicaSnapshot] = []
        # model -> indices of its replicas in replica_id order: the order policies sort candidates into, so
        # their sort finds the list already sorted
        self._by_model: dict[str, list[int]] = {}
        for i, h in sorted(enumerate(replicas), key=lambda ih: ih[1].scope):
            self._by_model.setdefault(h.model, []).append(i)
        # replica index -> its position in its model's _by_model list: every room list is in that order
        self._rank: list[int] = []
        self._number(range(len(replicas)))
        # (model, allowed regions, pool) -> indices of the healthy replicas there, in replica_id order.
        # Health, region and pool change only at a scrape, a passive health mark or a new replica, which
        # clear it.
        self._placed: dict[tuple, list[int]] = {}
        # (model, allowed regions, pool, max_waiting) -> the indices of _placed that have room. Room is lost
        # only when a request is sent (``sent`` takes a replica that reaches a limit in use out of the lists
        # with that limit) and comes back only at a scrape, so a dispatch reads the list instead of testing
        # every replica. The same key plus a region -> [that region's part of it, its largest max_model_len, how
        # many there have that length].
        self._room: dict[tuple, Any] = {}
        # room key -> [the epoch of its list, the replica ids it lost since] (CandidateList.epoch, .removed):
        # a fresh epoch whenever the list is built. Scraped fields change only where the lists are cleared, so
        # an epoch promises the same replicas with the same scraped fields, less those removed.
        self._epoch: dict[tuple, list] = {}
        self._epochs = itertools.count(1)
        self._regional = getattr(self.policy, "chooses_from_candidates", False)
        self._room_limits: set[int] = set()
        self.decisions = 0
        self._went_down: list[ReplicaSnapshot] = []  # gone down since the last decision (see route)
        self.scrape()

    def start(self) -> None:
        self.env.process(self._scraper())

    def _scraper(self):
        while True:
            yield self.env.timeout(self.scrape_interval_s)
            self.scrape()

    def scrape(self) -> None:
        now = self.env.now
        before = self.snapshots
        snaps = []
        for h in self.handles:
            eng = h.replica.engine
            snaps.append(ReplicaSnapshot(
                replica_id=h.scope, region=h.region, model=h.model, pool=h.pool,
                healthy=h.replica.healthy and not h.draining,
                num_running=len(eng.running), num_waiting=len(eng.waiting), kv_usage=min(max(eng.kv.usage(), 0.0), 1.0),
                outstanding_tokens=h.outstanding_tokens, max_model_len=h.max_model_len, scraped_at_s=now))
            h.pending_since_scrape = 0
        for old, new in zip(before, snaps):
            if old.healthy and not new.healthy:
                self._went_down.append(new)
        self.snapshots = snaps
        self._placed.clear()
        self._room.clear()
        self._epoch.clear()

    def candidates(self, model: str, allowed_regions: Sequence[str] | None, max_waiting: int,
                   pool: str | None = None) -> list[ReplicaSnapshot]:
        """Snapshots of replicas of ``model`` (inside ``allowed_regions``, in ``pool`` if given) that have
        room for one more. Room: scraped waiting + requests routed there since the scrape < ``max_waiting``
        (0 = no limit).
        """
        # the current snapshots (the ledger refreshes them) of the replicas with room, read when the policy reads
        key = _room_key(model, allowed_regions, pool, max_waiting)
        return RoomList(self.snapshots, self._with_room(key), *self._epoch[key])

    def candidates_for(self, facts: RequestFacts, allowed_regions: Sequence[str] | None, max_waiting: int,
                       pool: str | None = None) -> list[ReplicaSnapshot]:
        """``candidates`` for one request; for a policy that chooses among ``candidate_replicas`` alone
        (``chooses_from_candidates``) and a request steered to a region that needs no long context, only
        the replicas with room in that region when one of them is eligible. The policy's candidates are the
        same either way (it keeps the steered region's eligible replicas when there are any), and it reads
        about a third of the list in a three-region fleet (all of them healthy: ``_placed`` holds no other).
        """
        key = _room_key(facts.model, allowed_regions, pool, max_waiting)
        room = self._with_room(key)
        region = facts.region
        if self._regional and region is not None and not facts.needs_long_context:
            local_key = (*key, region)
            local = self._room.get(local_key)
            if local is None:
                snaps = self.snapshots
                idx = [i for i in room if snaps[i].region == region]
                local = self._room[local_key] = [idx, *_longest(snaps, idx)]
                self._epoch[local_key] = [next(self._epochs), ()]
            if local[1] >= facts.total_tokens:  # some replica there is eligible (healthy, model, residency: placed)
                key = local_key
                room = local[0]
        return RoomList(self.snapshots, room, *self._epoch[key])

    def _with_room(self, key: tuple) -> list[int]:
        """The indices of the replicas with room under ``key`` (``_room_key``), kept until they change."""
        snaps = self.snapshots
        room = self._room.get(key)
        if room is None:
            model, allowed_regions, pool, max_waiting = key
            placed_key = key[:3]
            placed = self._placed.get(placed_key)
            if placed is None:
                placed = self._placed[placed_key] = [
                    i for i in self._by_model.get(model, ())
                    if snaps[i].healthy and (pool is None or snaps[i].pool == pool)
                    and (allowed_regions is None or snaps[i].region in allowed_regions)]
            if max_waiting:
                handles = self.handles
                room = [i for i in placed if snaps[i].num_waiting + handles[i].pending_since_scrape < max_waiting]
                self._room_limits.add(max_waiting)
            else:
                room = placed
            self._room[key] = room
            self._epoch[key] = [next(self._epochs), ()]
        return room

    def _number(self, indices) -> None:
        """Set ``_rank`` for the models of ``indices`` (handles added since are numbered too)."""
        rank = self._rank
        rank.extend([0] * (len(self.handles) - len(rank)))
        for model in sorted({self.handles[i].model for i in indices}):
            for pos, i in enumerate(self._by_model[model]):
                rank[i] = pos

    def route(self, facts: RequestFacts, candidates: list[ReplicaSnapshot]) -> RoutingDecision:
        self.decisions += 1
        if self._went_down:
            # The policy's contract is to be shown every replica, unhealthy ones included, and it forgets
            # what it knew of a replica it sees down (the prefix routers' index: a crashed or drained engine's
            # cache is gone). This host hands over only replicas that could be chosen, so it adds each replica
            # that went down since the last decision, once: ineligible, it changes no candidate list.
            candidates = [*candidates, *self._went_down]
            self._went_down = []
        return self.policy.route(facts, candidates, self.env.now)

    def sent(self, facts: RequestFacts, replica_id: str) -> None:
        h = self.by_id[replica_id]
        h.outstanding_tokens += facts.total_tokens
        h.pending_since_scrape += 1
        limit = self.snapshots[h.index].num_waiting + h.pending_since_scrape
        if limit in self._room_limits:
            self._lose_room(h.index, limit)  # it just reached a limit in use: it has no room there any more
        self._refresh(h)
        self.policy.on_routed(facts, replica_id, self.env.now)

    def _lose_room(self, i: int, limit: int) -> None:
        """Replica ``i`` has no room left under ``max_waiting == limit``: take it out of those room lists
        (their region parts included) and add it to each such list's ``removed``. This leaves each list as
        a rebuild would (rebuilding them all cost a pass over the fleet every ~8 decisions at scale 1.0), and
        a router keeping per-list work updates it instead of starting again. The lists are in replica_id
        order, which ``_rank`` numbers, so ``i`` is found by bisection; a region part counts the replicas
        of its largest length, so losing one of them recounts only when it was the last (both were passes
        over the list per loss, ~1% of the run at 1,080 replicas)."""
        scope = self.handles[i].scope
        rank = self._rank
        r = rank[i]
        by_rank = rank.__getitem__
        for key, room in self._room.items():
            if key[3] != limit:
                continue
            local = len(key) == 5
            idx = room[0] if local else room
            at = bisect_left(idx, r, key=by_rank)
            if at == len(idx) or idx[at] != i:
                continue
            del idx[at]
            if local and self.snapshots[i].max_model_len == room[1]:  # it may have been the only one that long
                room[2] -= 1
                if not room[2]:
                    room[1:] = _longest(self.snapshots, idx)
            epoch = self._epoch[key]
            epoch[1] = (*epoch[1], scope)

    def done(self, facts: RequestFacts, replica_id: str) -> None:
        h = self.by_id[replica_id]
        h.outstanding_tokens = max(h.outstanding_tokens - facts.total_tokens, 0)
        self._refresh(h)
        self.policy.on_completed(facts.request_id, replica_id, self.env.now)

    def _refresh(self, h: ReplicaHandle) -> None:
        i = h.index
        s = self.snapshots[i]
        # dataclasses.replace, spelled out: it runs twice per request and replace() is ~3x slower
        self.snapshots[i] = ReplicaSnapshot(
            replica_id=s.replica_id, region=s.region, model=s.model, pool=s.pool, healthy=s.healthy,
            num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.kv_usage,
            outstanding_tokens=h.outstanding_tokens, max_model_len=s.max_model_len, scraped_at_s=s.scraped_at_s)

    def mark_unhealthy(self, replica_id: str) -> None:
        """Passive health check: a connection failure marks the replica down before the next scrape."""
        h = self.by_id[replica_id]
        was = self.snapshots[h.index]
        self.snapshots[h.index] = dataclasses.replace(was, healthy=False)
        if was.healthy:
            self._went_down.append(self.snapshots[h.index])
        self._placed.clear()
        self._room.clear()
        self._epoch.clear()

    def add_replica(self, h: ReplicaHandle) -> None:
        """New capacity joins; it is visible to the policy from the next scrape."""
        self.by_id[h.scope] = h
        by_model = self._by_model.setdefault(h.model, [])
        by_model.append(h.index)
        by_model.sort(key=lambda i: self.handles[i].scope)
        self._number(by_model)
        eng = h.replica.engine
        self.snapshots.append(ReplicaSnapshot(
            replica_id=h.scope, region=h.region, model=h.model, pool=h.pool, healthy=h.replica.healthy,
            num_running=len(eng.running), num_waiting=len(eng.waiting), kv_usage=0.0, outstanding_tokens=0,
            max_model_len=h.max_model_len, scraped_at_s=self.env.now))
        self._placed.clear()
        self._room.clear()
        self._epoch.clear()
