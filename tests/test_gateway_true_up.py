"""The gateway trues up every admitted attempt (docs/policies.md: the host calls ``on_completed`` once per admitted
request when it ends) under the id it was admitted with, in the unit admission charged: the message plus the
tokens streamed back. Before, the host passed the generation's id, so no charge was ever trued up."""

from __future__ import annotations

import collections
import copy

from tests.test_fleet import BASE
from twin.models.gateway import Gateway
from twin.policies.admission import TokenBucketAdmission
from twin.runner import run_scenario
from twin.scenario import parse_scenario


def test_every_admitted_attempt_is_trued_up_once(monkeypatch) -> None:
    admitted: list[str] = []
    completed: list[tuple[str, int]] = []
    orig_admit, orig_completed = Gateway.admit, Gateway.completed

    def admit(self, **kw):
        decision = yield from orig_admit(self, **kw)
        if decision.admitted:
            admitted.append(kw["request_id"])
        return decision

    def done(self, request_id: str, actual_tokens: int) -> None:
        completed.append((request_id, actual_tokens))
        orig_completed(self, request_id, actual_tokens)

    monkeypatch.setattr(Gateway, "admit", admit)
    monkeypatch.setattr(Gateway, "completed", done)
    raw = copy.deepcopy(BASE)
    raw["fleet"]["gateway"] = {"admission": {"kind": "composite", "policies": [
        {"kind": "token_bucket", "tokens_per_s": 300, "burst_tokens": 20000},
        {"kind": "tenant_quota", "tokens_per_minute": 10_000_000}]}}
    res = run_scenario(parse_scenario(raw))
    assert res.ok, res.manifest.get("traceback")
    assert len(admitted) > 20
    counts = collections.Counter(rid for rid, _ in completed)
    assert set(counts) == set(admitted), "an admitted attempt was never trued up, or an unknown id was"
    assert max(counts.values()) == 1
    bucket = next(c for c in res.world.gateway.policy.children if isinstance(c, TokenBucketAdmission))
    assert bucket._charged == {}, "the bucket still holds charges it never trued up"
    assert all(actual > 0 for _, actual in completed)
