"""Per-tenant API keys (``KEYS.yaml``) and token-per-minute quotas.

```yaml
keys:
  sk-acme-1: {tenant: acme, tokens_per_minute: 60000}
  sk-acme-2: {tenant: acme}            # same tenant, same quota (stated once is enough)
  sk-beta:   {tenant: beta, tier: free}
```

A quota is per tenant (all its keys share one bucket). Each request is charged
``prompt_tokens + max_tokens`` when it is admitted (the router cannot know the output length in
advance); the bucket holds one minute of tokens and refills continuously.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class TenantKey(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: Annotated[str, Field(min_length=1)]
    tokens_per_minute: Annotated[int, Field(gt=0)] | None = None
    tier: Literal["free", "paid", "enterprise"] = "paid"


class KeysFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: dict[Annotated[str, Field(min_length=8)], TenantKey]

    @model_validator(mode="after")
    def _one_quota_per_tenant(self) -> KeysFile:
        quota: dict[str, int] = {}
        for k in self.keys.values():
            if k.tokens_per_minute is None:
                continue
            if quota.setdefault(k.tenant, k.tokens_per_minute) != k.tokens_per_minute:
                raise ValueError(f"tenant {k.tenant!r} has keys with different tokens_per_minute")
        return self

    def tenant_quota(self, tenant: str) -> int | None:
        return next((k.tokens_per_minute for k in self.keys.values()
                     if k.tenant == tenant and k.tokens_per_minute is not None), None)


def load_keys(path: str | Path) -> KeysFile:
    with open(path) as f:
        return KeysFile.model_validate(yaml.safe_load(f))


class TokenBucket:
    """``capacity`` tokens, refilled at ``capacity / 60`` per second (times are passed in)."""

    __slots__ = ("capacity", "rate_per_s", "level", "last_s")

    def __init__(self, tokens_per_minute: int, now_s: float) -> None:
        self.capacity = float(tokens_per_minute)
        self.rate_per_s = tokens_per_minute / 60.0
        self.level = self.capacity
        self.last_s = now_s

    def take(self, cost: int, now_s: float) -> float:
        """Charge ``cost`` and return 0, or charge nothing and return the seconds to wait before retrying."""
        self.level = min(self.capacity, self.level + (now_s - self.last_s) * self.rate_per_s)
        self.last_s = now_s
        if cost <= self.level:
            self.level -= cost
            return 0.0
        if cost > self.capacity:
            return 60.0  # can never fit one minute's quota: the client must send less
        return max(1.0, math.ceil((cost - self.level) / self.rate_per_s))

    def refund(self, cost: int) -> None:
        """Give back a charge for a request that was refused after all (no replica could take it)."""
        self.level = min(self.capacity, self.level + cost)
