"""The gateway: authentication cost, then the admission policy (token buckets, tenant quotas, retry budget)."""

from __future__ import annotations

import simpy

from twin.fleet_config import GatewayConfig
from twin.models.recorder import Recorder
from twin.policies.admission import AdmissionRequest, build_admission


class Gateway:
    def __init__(self, env: simpy.Environment, *, cfg: GatewayConfig, seed: int, recorder: Recorder) -> None:
        self.env = env
        self.cfg = cfg
        self.policy = build_admission(cfg.admission, seed=seed)
        self.rec = recorder

    def admit(self, *, request_id: str, user_id: str, tenant: str, tier: str, prompt_tokens: int,
              expected_output_tokens: int, attempt: int):
        """Generator: authenticate, then ask the admission policy. Returns its decision."""
        if self.cfg.auth_latency_s:
            yield self.env.timeout(self.cfg.auth_latency_s)
        return self.policy.admit(AdmissionRequest(
            request_id=request_id, user_id=user_id, tenant=tenant, tier=tier, prompt_tokens=prompt_tokens,
            expected_output_tokens=expected_output_tokens, is_retry=attempt > 0, attempt=attempt + 1), self.env.now)

    def completed(self, request_id: str, actual_tokens: int) -> None:
        self.policy.on_completed(request_id, actual_tokens, self.env.now)
