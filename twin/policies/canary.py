"""Release canary: send a small, growing share of traffic to a new version and decide, by stated
statistical tests, whether to hold, increase the share, promote or roll back.

The host (the twin's SimPy router, or a production one) routes ``canary_share`` of new requests to the
canary, reports every finished request with :meth:`BaseCanary.observe` and asks :meth:`evaluate`
(``now_s`` given, never going back). Pure Python: the normal tail comes from ``math.erfc``; no scipy,
no I/O, no randomness. See ``docs/policies.md`` ("Release canary") for the tests and the guarantees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from twin.policies.family import MonotoneClock, PolicyBase, PolicyFamily, PolicyParams
from twin.registry import Registry

VERSIONS: tuple[str, ...] = ("stable", "canary")
ACTIONS: tuple[str, ...] = ("hold", "increase", "promote", "rollback")
VERDICTS: tuple[str, ...] = ("worse", "ok", "inconclusive", "insufficient")


@dataclass(frozen=True, slots=True)
class CanaryObservation:
    """One finished request. ``quality`` is a per-request score in [0, 1]; ``ttft_s``/``itl_s`` are its
    time to first token and mean inter-token latency (None when it produced no tokens, e.g. an error)."""

    version: str
    task_class: str
    quality: float
    ttft_s: float | None
    itl_s: float | None
    error: bool

    def __post_init__(self) -> None:
        if self.version not in VERSIONS:
            raise ValueError(f"version must be one of {VERSIONS}, got {self.version!r}")
        if not 0.0 <= self.quality <= 1.0:
            raise ValueError(f"quality must be in [0, 1], got {self.quality}")
        for name in ("ttft_s", "itl_s"):
            v = getattr(self, name)
            if v is not None and not v > 0.0:
                raise ValueError(f"{name} must be > 0 or None, got {v}")


@dataclass(frozen=True, slots=True)
class CanaryDecision:
    """``action``: hold, increase, promote or rollback. ``canary_share``: the share of new requests to
    route to the canary from now on (1.0 after promote: the canary is the release; 0.0 after rollback).
    ``per_metric``: ``(metric, p_value, verdict)`` per test at the latest look, verdict one of
    :data:`VERDICTS`; ``p_value`` is that of the test behind the verdict (harm test for worse and
    inconclusive, non-inferiority test for ok, 1.0 when insufficient)."""

    action: str
    canary_share: float
    reason: str
    per_metric: tuple[tuple[str, float, str], ...] = ()

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
        if not 0.0 <= self.canary_share <= 1.0:
            raise ValueError(f"canary_share must be in [0, 1], got {self.canary_share}")


# ----------------------------------------------------------------------------------------- statistics
def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z (``math.erfc`` keeps small tails accurate)."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


@dataclass(slots=True)
class _Moments:
    """Running count, mean and sum of squared deviations (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def var(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0


def margin_test(diff: float, se: float, margin: float, level: float) -> tuple[str, float]:
    """Two one-sided tests of ``diff`` (canary minus stable, positive = canary worse) against ``margin``.

    Harm: H0 ``diff <= margin`` vs ``diff > margin``, p = P(Z > (diff - margin) / se): "worse" when p <
    ``level``. Non-inferiority: H0 ``diff >= margin`` vs ``diff < margin``, p = P(Z > (margin - diff) /
    se): "ok" when p < ``level``. Otherwise "inconclusive" (with the harm p). ``se == 0`` makes the
    sign of ``diff - margin`` decisive.
    """
    gap = diff - margin
    if se <= 0.0:
        if gap > 0.0:
            return "worse", 0.0
        return ("ok", 0.0) if gap < 0.0 else ("inconclusive", 1.0)
    p_harm, p_ok = normal_sf(gap / se), normal_sf(-gap / se)
    if p_harm < level:
        return "worse", p_harm
    if p_ok < level:
        return "ok", p_ok
    return "inconclusive", p_harm


# ---------------------------------------------------------------------------------------------- params
class CanaryParams(PolicyParams):
    """Base of every canary's params: frozen, and a typo is an error."""


class SequentialCanaryParams(CanaryParams):
    kind: Literal["sequential_canary"] = "sequential_canary"
    start_share: float = Field(0.05, gt=0.0, le=1.0)
    step_share: float = Field(0.1, gt=0.0, le=1.0)
    max_share: float = Field(0.5, gt=0.0, le=1.0, description="the most traffic the canary gets before promotion")
    min_samples_per_arm: int = Field(200, ge=30, description="per arm per test (per class for quality), "
                                     "and new canary samples per stage")
    alpha: float = Field(0.01, gt=0.0, lt=0.5, description="family-wise error over the whole rollout")
    quality_margin: float = Field(0.02, ge=0.0, description="non-inferiority margin on mean quality")
    latency_margin_ratio: float = Field(1.1, ge=1.0, description="on the ratio of geometric-mean times")
    error_margin: float = Field(0.005, ge=0.0, description="on the error-rate difference")
    task_classes: list[str] = Field(default_factory=lambda: ["chat"], min_length=1)
    eval_interval_s: float = Field(60.0, gt=0.0, description="at most one look per interval")

    @model_validator(mode="after")
    def _shares(self) -> SequentialCanaryParams:
        if self.start_share > self.max_share:
            raise ValueError(f"start_share ({self.start_share}) > max_share ({self.max_share})")
        if len(set(self.task_classes)) != len(self.task_classes):
            raise ValueError(f"task_classes must be distinct: {self.task_classes}")
        return self


class BaseCanary(MonotoneClock, PolicyBase[CanaryParams]):
    """Shared skeleton: params type check and the monotone clock guard."""

    Params: ClassVar[type[CanaryParams]]

    def observe(self, obs: CanaryObservation) -> None:
        raise NotImplementedError

    def evaluate(self, now_s: float) -> CanaryDecision:
        raise NotImplementedError


CANARIES: Registry[type[BaseCanary]] = Registry("release canary")


@dataclass(slots=True)
class _Arm:
    quality: dict[str, _Moments]
    log_ttft: _Moments
    log_itl: _Moments
    n: int = 0
    errors: int = 0


@CANARIES.register("sequential_canary")
class SequentialCanary(BaseCanary):
    """Staged rollout with repeated looks, each a family of one-sided tests (see ``docs/policies.md``).

    Tests, on all observations since the start (``d`` = canary minus stable, positive = canary worse):

    * quality, one per task class: ``d = mean_stable - mean_canary`` over non-error requests, Welch's
      standard error ``sqrt(var_s / n_s + var_c / n_c)``, margin ``quality_margin``;
    * ``ttft`` and ``itl``: ``d = mean(log canary) - mean(log stable)`` (log of the ratio of geometric
      means, which is the ratio of medians for log-normal times), Welch's standard error on the logs,
      margin ``log(latency_margin_ratio)``;
    * ``error``: ``d = p_c - p_s`` with Agresti-Caffo's adjusted proportions (one error and one success
      added per arm, so zero-error arms still have a spread), margin ``error_margin``.

    Each is :func:`margin_test` (harm and non-inferiority), referred to the normal: every test needs
    ``min_samples_per_arm`` (>= 30) in each arm, where Welch's t and z agree closely. Level per test at
    look ``j`` (j = 1, 2, ...): ``alpha / (K * j * (j + 1))``, ``K`` = number of tests (Bonferroni over
    metrics x classes; an alpha-spending series over looks that sums to ``alpha``), so an unchanged
    version is rolled back with probability at most about ``alpha`` over the whole rollout.

    At a look: any "worse" -> rollback (share 0). Else, when every test is "ok", at least
    ``eval_interval_s`` and ``min_samples_per_arm`` new canary observations since the last share change:
    increase by ``step_share`` (capped at ``max_share``), or, already at ``max_share``, promote (share
    1). Otherwise hold. The share never exceeds ``max_share`` before promotion. Promote and rollback
    are final: later evaluations repeat them.
    """

    Params = SequentialCanaryParams
    params: SequentialCanaryParams

    def __init__(self, params: CanaryParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._arms = {v: _Arm({c: _Moments() for c in self.params.task_classes}, _Moments(), _Moments())
                      for v in VERSIONS}
        self._share = self.params.start_share
        self._looks = 0
        self._last_look_s = -math.inf
        self._stage_start_s: float | None = None  # first evaluation time at the current share
        self._stage_canary_n0 = 0
        self._final: CanaryDecision | None = None
        self._last = CanaryDecision("hold", self._share, "no look yet")

    @property
    def canary_share(self) -> float:
        return self._share

    @property
    def looks(self) -> int:
        return self._looks

    def tests(self) -> tuple[str, ...]:
        return (*(f"quality[{c}]" for c in self.params.task_classes), "ttft", "itl", "error")

    def observe(self, obs: CanaryObservation) -> None:
        arm = self._arms[obs.version]
        arm.n += 1
        if obs.error:
            arm.errors += 1
            return
        q = arm.quality.get(obs.task_class)
        if q is not None:
            q.add(obs.quality)
        if obs.ttft_s is not None:
            arm.log_ttft.add(math.log(obs.ttft_s))
        if obs.itl_s is not None:
            arm.log_itl.add(math.log(obs.itl_s))

    def _run_tests(self, level: float) -> tuple[tuple[str, float, str], ...]:
        p, s, c = self.params, self._arms["stable"], self._arms["canary"]
        need = p.min_samples_per_arm
        out: list[tuple[str, float, str]] = []

        def welch(name: str, ms: _Moments, mc: _Moments, diff: float, margin: float) -> None:
            if min(ms.n, mc.n) < need:
                out.append((name, 1.0, "insufficient"))
                return
            verdict, pv = margin_test(diff, math.sqrt(ms.var / ms.n + mc.var / mc.n), margin, level)
            out.append((name, pv, verdict))

        for cls in p.task_classes:
            qs, qc = s.quality[cls], c.quality[cls]
            welch(f"quality[{cls}]", qs, qc, qs.mean - qc.mean, p.quality_margin)
        log_margin = math.log(p.latency_margin_ratio)
        welch("ttft", s.log_ttft, c.log_ttft, c.log_ttft.mean - s.log_ttft.mean, log_margin)
        welch("itl", s.log_itl, c.log_itl, c.log_itl.mean - s.log_itl.mean, log_margin)
        if min(s.n, c.n) < need:
            out.append(("error", 1.0, "insufficient"))
        else:
            ps, pc = (s.errors + 1) / (s.n + 2), (c.errors + 1) / (c.n + 2)
            se = math.sqrt(ps * (1 - ps) / (s.n + 2) + pc * (1 - pc) / (c.n + 2))
            verdict, pv = margin_test(pc - ps, se, p.error_margin, level)
            out.append(("error", pv, verdict))
        return tuple(out)

    def evaluate(self, now_s: float) -> CanaryDecision:
        self._tick(now_s)
        if self._final is not None:
            return self._final
        p = self.params
        if self._stage_start_s is None:
            self._stage_start_s = now_s
        if now_s - self._last_look_s < p.eval_interval_s:
            return CanaryDecision("hold", self._share, f"next look at {self._last_look_s + p.eval_interval_s:.1f} s",
                                  self._last.per_metric)
        if min(self._arms["stable"].n, self._arms["canary"].n) < p.min_samples_per_arm:
            return CanaryDecision("hold", self._share, "waiting for min_samples_per_arm in each arm",
                                  self._last.per_metric)
        self._looks += 1
        self._last_look_s = now_s
        j, k = self._looks, len(self.tests())
        level = p.alpha / (k * j * (j + 1))
        per_metric = self._run_tests(level)
        worse = [m for m, _, v in per_metric if v == "worse"]
        if worse:
            self._share = 0.0
            self._final = CanaryDecision("rollback", 0.0, f"look {j}: worse on {', '.join(worse)} "
                                                          f"(level {level:.2g})", per_metric)
            return self._final
        not_ok = [m for m, _, v in per_metric if v != "ok"]
        new_n = self._arms["canary"].n - self._stage_canary_n0
        stage_age = now_s - self._stage_start_s
        if not_ok:
            why = f"look {j}: not yet shown non-inferior on {', '.join(not_ok)}"
        elif new_n < p.min_samples_per_arm:
            why = f"look {j}: {new_n} new canary samples at share {self._share:g}, need {p.min_samples_per_arm}"
        elif stage_age < p.eval_interval_s:
            why = f"look {j}: share {self._share:g} held {stage_age:.1f} s of {p.eval_interval_s:g}"
        elif self._share >= p.max_share:
            self._share = 1.0
            self._final = CanaryDecision("promote", 1.0, f"look {j}: every test ok at max_share", per_metric)
            return self._final
        else:
            self._share = min(p.max_share, self._share + p.step_share)
            self._stage_start_s, self._stage_canary_n0 = now_s, self._arms["canary"].n
            self._last = CanaryDecision("increase", self._share, f"look {j}: every test ok", per_metric)
            return self._last
        self._last = CanaryDecision("hold", self._share, why, per_metric)
        return self._last


# ---------------------------------------------------------------------------------------------- config
CANARY_FAMILY: PolicyFamily[CanaryParams, BaseCanary] = PolicyFamily(CANARIES, CanaryParams, title="CanaryConfig")

CanaryConfig = CANARY_FAMILY.config_type
"""Embed as a field type in the scenario schema: ``canary: CanaryConfig`` (one kind so far, so the
adapter keeps the model's own title)."""

CANARY_CONFIG = CANARY_FAMILY.adapter
parse_canary_config = CANARY_FAMILY.parse
"""Validate a ``{kind: <key>, ...params}`` mapping into its frozen params model."""
build_canary = CANARY_FAMILY.build
"""A fresh canary from its config (``seed`` is passed on; the built-in canary is not random)."""
