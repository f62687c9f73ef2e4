"""The compact step-time model the simulator calls once per engine step (hot path).

Two regimes, as a serving engineer reads a vLLM step:

* decode-only: ``overhead + base + per_request * decode_requests + per_context_token * decode_context_tokens``
  (weight streaming is the base, per-request cost covers token-proportional GEMM/elementwise work,
  the context term is the KV read of decode attention);
* prefill-carrying: ``overhead + base' + per_token' * total_tokens + per_pair' * prefill_attention_pairs
  + per_decode_context_token' * decode_context_tokens``, floored at the decode-only time of the same
  decodes, so adding a prefill chunk to a batch never makes the step faster.

All coefficients are plain floats copied once in ``__init__``; a call is a handful of multiply-adds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twin.engine_profiles.step import StepShape


class LinearStepTimeModel:
    """Implements ``twin.engine_profiles.step.StepTimeModel``."""

    __slots__ = ("_d0", "_d_req", "_d_ctx", "_p0", "_p_tok", "_p_pair", "_p_ctx", "overhead_s")

    def __init__(
        self,
        *,
        overhead_s: float,
        decode_base_s: float,
        decode_per_request_s: float,
        decode_per_context_token_s: float,
        prefill_base_s: float,
        prefill_per_token_s: float,
        prefill_per_attention_pair_s: float,
        prefill_per_decode_context_token_s: float,
    ) -> None:
        self.overhead_s = float(overhead_s)  # time outside model execution, included in every step
        self._d0 = float(overhead_s) + float(decode_base_s)
        self._d_req = float(decode_per_request_s)
        self._d_ctx = float(decode_per_context_token_s)
        self._p0 = float(overhead_s) + float(prefill_base_s)
        self._p_tok = float(prefill_per_token_s)
        self._p_pair = float(prefill_per_attention_pair_s)
        self._p_ctx = float(prefill_per_decode_context_token_s)

    @classmethod
    def from_coefficients(cls, coefficients: Any) -> LinearStepTimeModel:
        """From a ``StepTimeCoefficients`` (duck-typed to keep this module free of pydantic)."""
        d, p = coefficients.decode, coefficients.prefill
        return cls(
            overhead_s=coefficients.overhead_s,
            decode_base_s=d.base_s,
            decode_per_request_s=d.per_request_s,
            decode_per_context_token_s=d.per_context_token_s,
            prefill_base_s=p.base_s,
            prefill_per_token_s=p.per_token_s,
            prefill_per_attention_pair_s=p.per_attention_pair_s,
            prefill_per_decode_context_token_s=p.per_decode_context_token_s,
        )

    def step_time_s(self, shape: StepShape) -> float:
        n = shape.decode_requests
        decode_s = self._d0 + self._d_req * n + self._d_ctx * shape.decode_context_tokens
        if shape.prefill_requests == 0:
            return decode_s
        mixed_s = (
            self._p0
            + self._p_tok * (n + shape.prefill_tokens)
            + self._p_pair * shape.prefill_attention_pairs
            + self._p_ctx * shape.decode_context_tokens
        )
        return mixed_s if mixed_s > decode_s else decode_s

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        n = decode_requests
        context = (decode_context_tokens + n * np.arange(num_steps, dtype=np.int64)).astype(np.float64)
        return (self._d0 + self._d_req * n) + self._d_ctx * context

    def decode_run_list(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> list[float]:
        """``decode_run_s`` as a list, the same floats (each step's context as a float, then the same multiply
        and add): the replica's decode runs are mostly a few steps long, where numpy's per-call overhead is
        most of the cost."""
        if num_steps > 32:
            return self.decode_run_s(decode_requests, decode_context_tokens, num_steps).tolist()
        n = decode_requests
        a, c = self._d0 + self._d_req * n, self._d_ctx
        return [a + c * float(x) for x in range(decode_context_tokens, decode_context_tokens + n * num_steps, n)] \
            if n else [a + c * float(decode_context_tokens)] * num_steps

    def __repr__(self) -> str:
        return (
            f"LinearStepTimeModel(decode={self._d0:.4g}+{self._d_req:.3g}*n+{self._d_ctx:.3g}*ctx, "
            f"prefill={self._p0:.4g}+{self._p_tok:.3g}*tok+{self._p_pair:.3g}*pairs+{self._p_ctx:.3g}*ctx)"
        )
