"""A closed-form step-time model for theory checks and small demos (not a hardware profile).

step = overhead + decode_step_s (if any decode) + prefill_token_s * prefill tokens
       + decode_token_s * decode requests + context_token_s * decode context tokens
"""

from __future__ import annotations

import numpy as np

from twin.engine_profiles.step import StepShape


class FixedStepTime:
    def __init__(self, *, overhead_s: float = 0.0, step_s: float = 0.0, decode_token_s: float = 0.0,
                 prefill_token_s: float = 0.0, context_token_s: float = 0.0) -> None:
        self.overhead_s = overhead_s
        self.step_s = step_s
        self.decode_token_s = decode_token_s
        self.prefill_token_s = prefill_token_s
        self.context_token_s = context_token_s

    def step_time_s(self, shape: StepShape) -> float:
        return (self.overhead_s + self.step_s + self.prefill_token_s * shape.prefill_tokens
                + self.decode_token_s * shape.decode_requests + self.context_token_s * shape.decode_context_tokens)

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        ctx = decode_context_tokens + decode_requests * np.arange(num_steps, dtype=np.float64)
        base = self.overhead_s + self.step_s + self.decode_token_s * decode_requests
        return base + self.context_token_s * ctx
