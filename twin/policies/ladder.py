"""The overload degradation ladder, and the model fallback rule.

Under overload the fleet degrades in steps, cheapest and least visible first (the rungs of
:data:`RUNGS`): cap the output length, send the free tier to the smaller model, turn on speculative
decoding, queue with an honest ETA instead of rejecting, and finally shed load, lowest tier first.
A ladder policy from :data:`LADDERS` turns recent signals (:class:`LadderSignals`) into the set of
rungs that are on (:class:`LadderDecision`); the host (the twin's SimPy component, or a production
controller) measures the signals and applies the rungs. Pure Python: ``now_s`` is given and must not
go back, no I/O, no randomness. See ``docs/policies.md`` ("Degradation ladder").

:func:`fallback_model` is the companion rule for picking a substitute model (a rung that moves traffic
to another model, or a model that is down): it never breaks a capability or a residency constraint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from twin.policies.family import MonotoneClock, PolicyBase, PolicyFamily, PolicyParams
from twin.registry import Registry

RUNGS: tuple[str, ...] = ("cap_output", "free_tier_small_model", "speculative_decoding", "queue_eta", "shed")
"""The rungs, in the order the ladder climbs them (and the reverse of the order it descends)."""

Rung = Literal["cap_output", "free_tier_small_model", "speculative_decoding", "queue_eta", "shed"]
Metric = Literal["token_backlog", "queue_eta_s", "itl_p95_s", "ttft_p95_s"]
LadderTier = Literal["free", "paid", "enterprise"]


# ------------------------------------------------------------------------------------------ value types
@dataclass(frozen=True, slots=True)
class LadderSignals:
    """What the ladder reads at one evaluation.

    ``token_backlog``: queued prompt + expected output tokens. ``queue_eta_s``: the queue's honest ETA
    for a newly queued request (tokens ahead / drain rate; may be ``inf``). ``itl_p95_s`` and
    ``ttft_p95_s``: recent inter-token and time-to-first-token p95 (None: no completed requests in the
    window, so no evidence either way).

    There is deliberately no GPU-utilisation field: with continuous batching an engine keeps a step
    running whenever anything is in flight, so utilisation reads close to 100 % at almost any load and
    says nothing about whether users are waiting. Backlog, ETA and latency percentiles do.
    """

    now_s: float
    token_backlog: int
    queue_eta_s: float
    itl_p95_s: float | None = None
    ttft_p95_s: float | None = None

    def __post_init__(self) -> None:
        if self.token_backlog < 0 or not self.queue_eta_s >= 0.0:
            raise ValueError("token_backlog and queue_eta_s must be >= 0")
        for name in ("itl_p95_s", "ttft_p95_s"):
            v = getattr(self, name)
            if v is not None and not v >= 0.0:
                raise ValueError(f"{name} must be >= 0 or None, got {v}")

    def metric(self, name: str) -> float | None:
        """The value of a trigger metric (None when there is no data)."""
        v = getattr(self, name)
        return None if v is None else float(v)


@dataclass(frozen=True, slots=True)
class LadderDecision:
    """The ladder's state after one evaluation.

    ``on``: rungs that are on, in ladder order. ``changed``: ``(rung, now_on)`` for every rung that
    flipped at this evaluation, in ladder order. ``reasons``: ``(rung, why)`` for every rung that is on,
    flipped, or wanted to flip and was held back (min hold, ladder order). ``shed_tiers``: the tiers the
    host sheds (empty unless ``shed`` is on); read it through :meth:`LadderPolicy.shed_tier`.
    """

    on: tuple[str, ...]
    changed: tuple[tuple[str, bool], ...] = ()
    reasons: tuple[tuple[str, str], ...] = ()
    shed_tiers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [r for r in self.on if r not in RUNGS]
        if unknown:
            raise ValueError(f"unknown rungs {unknown} (known: {RUNGS})")
        if list(self.on) != [r for r in RUNGS if r in self.on]:
            raise ValueError(f"rungs must be listed once, in ladder order: {self.on}")
        if self.shed_tiers and "shed" not in self.on:
            raise ValueError("shed_tiers needs the shed rung on")

    def is_on(self, rung: str) -> bool:
        return rung in self.on

    def reason(self, rung: str) -> str | None:
        return dict(self.reasons).get(rung)


# ---------------------------------------------------------------------------------------------- params
class RungTrigger(BaseModel):
    """Switch on when ``metric > on_above``; switch off when ``metric < off_below`` (hysteresis:
    ``off_below <= on_above``); never flip sooner than ``min_hold_s`` after the rung's last flip."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    metric: Metric = "queue_eta_s"
    on_above: float = Field(ge=0.0)
    off_below: float = Field(ge=0.0)
    min_hold_s: float = Field(60.0, ge=0.0)

    @model_validator(mode="after")
    def _hysteresis(self) -> RungTrigger:
        if self.off_below > self.on_above:
            raise ValueError(f"off_below ({self.off_below}) must be <= on_above ({self.on_above})")
        return self


class LadderOverride(BaseModel):
    """On-call forcing a rung from ``at_s`` on: ``on``, ``off``, or ``auto`` (back to its trigger)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rung: Rung
    at_s: float = Field(ge=0.0)
    state: Literal["on", "off", "auto"]


class BaseLadderParams(PolicyParams):
    """Base of every ladder's params: what the rungs do once on. Frozen, and a typo is an error."""

    cap_output_tokens: int = Field(1024, ge=1, description="max output tokens while cap_output is on")
    spec_decode_speedup_low_batch: float = Field(2.0, ge=1.0, description="decode speedup at batch 1")
    spec_decode_speedup_high_batch: float = Field(1.1, ge=1.0, description="speedup at the knee and beyond")
    spec_decode_batch_knee: int = Field(64, ge=1, description="batch size from which the high-batch speedup holds")
    shed_tiers: list[LadderTier] = Field(default_factory=lambda: ["free", "paid"],
                                         description="tiers in shedding order, lowest first")

    @model_validator(mode="after")
    def _distinct_tiers(self) -> BaseLadderParams:
        if len(set(self.shed_tiers)) != len(self.shed_tiers):
            raise ValueError(f"shed_tiers must be distinct: {self.shed_tiers}")
        return self


def _default_triggers() -> dict[str, RungTrigger]:
    steps = {"cap_output": (5.0, 2.0), "free_tier_small_model": (10.0, 4.0), "speculative_decoding": (15.0, 6.0),
             "queue_eta": (20.0, 8.0), "shed": (30.0, 12.0)}
    return {r: RungTrigger(metric="queue_eta_s", on_above=a, off_below=b) for r, (a, b) in steps.items()}


# ---------------------------------------------------------------------------------------------- policy
class LadderPolicy(MonotoneClock, PolicyBase[BaseLadderParams]):
    """Base of every ladder: ``evaluate`` plus the helpers the host calls to apply the rungs."""

    Params: ClassVar[type[BaseLadderParams]]

    def evaluate(self, signals: LadderSignals) -> LadderDecision:
        raise NotImplementedError

    @property
    def cap_output_tokens(self) -> int:
        return self.params.cap_output_tokens

    def spec_decode_speedup(self, batch_size: int) -> float:
        """Decode speedup from speculative decoding at a batch size.

        The design note gives 1.5-2.5x at low batch and less at high batch (a drafted token costs
        verifier compute that a full batch no longer has spare). Modelled as linear from the low-batch
        speedup at batch 1 to the high-batch speedup at ``spec_decode_batch_knee``, flat beyond.
        """
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        p = self.params
        lo, hi, knee = p.spec_decode_speedup_low_batch, p.spec_decode_speedup_high_batch, p.spec_decode_batch_knee
        if batch_size >= knee:
            return hi
        if batch_size <= 1:
            return lo
        return lo + (hi - lo) * (batch_size - 1) / (knee - 1)

    def shed_tier(self, tier: str, decision: LadderDecision) -> bool:
        """Whether the host sheds new requests of ``tier`` under ``decision``."""
        return tier in decision.shed_tiers


LADDERS: Registry[type[LadderPolicy]] = Registry("degradation ladder")


# ---------------------------------------------------------------------------------------------- static
class StaticLadderParams(BaseLadderParams):
    kind: Literal["static"] = "static"
    on: list[Rung] = Field(default_factory=list, description="rungs always on (for what-ifs)")


@LADDERS.register("static")
class StaticLadder(LadderPolicy):
    """A fixed set of rungs, always on (what-if runs: "what if spec decoding were always on?").
    With ``shed`` on, every tier in ``shed_tiers`` is shed. Overrides and triggers do not apply."""

    Params = StaticLadderParams
    params: StaticLadderParams

    def __init__(self, params: BaseLadderParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        on = tuple(r for r in RUNGS if r in self.params.on)
        tiers = tuple(self.params.shed_tiers) if "shed" in on else ()
        self._decision = LadderDecision(on=on, reasons=tuple((r, "static") for r in on), shed_tiers=tiers)
        self._first = True

    def evaluate(self, signals: LadderSignals) -> LadderDecision:
        self._tick(signals.now_s)
        if self._first:  # the rungs "flip on" at the first evaluation, like a threshold ladder's would
            self._first = False
            return LadderDecision(self._decision.on, tuple((r, True) for r in self._decision.on),
                                  self._decision.reasons, self._decision.shed_tiers)
        return self._decision


# ------------------------------------------------------------------------------------------- threshold
class LadderParams(BaseLadderParams):
    kind: Literal["threshold_ladder"] = "threshold_ladder"
    triggers: dict[Rung, RungTrigger] = Field(default_factory=_default_triggers,
                                              description="one trigger per rung; every rung needs one")
    order_strict: bool = Field(True, description="climb in ladder order, descend last-on-first-off")
    overrides: list[LadderOverride] = Field(default_factory=list, description="on-call forcing, by time")

    @model_validator(mode="after")
    def _every_rung(self) -> LadderParams:
        missing = [r for r in RUNGS if r not in self.triggers]
        if missing:
            raise ValueError(f"triggers needs every rung; missing {missing}")
        return self


@LADDERS.register("threshold_ladder")
class ThresholdLadder(LadderPolicy):
    """Each rung has a trigger with hysteresis and a minimum hold; the ladder climbs in order.

    At each evaluation, per rung:

    * **Override.** The latest override for the rung with ``at_s <= now_s`` wins (equal ``at_s``: the
      one listed last). ``on``/``off`` force the rung at once (no hold, no order). ``auto`` (or no
      override yet) hands it to its trigger; the trigger then decides at once, with no hold left over
      from the forced period.
    * **Trigger.** An off rung wants on when ``metric > on_above``; an on rung wants off when ``metric <
      off_below``; in between (the hysteresis band) it keeps its state, so a metric hovering at one
      threshold cannot flap it. A metric with no data (None) is no evidence: the rung keeps its state.
    * **Hold.** A rung under its trigger does not flip sooner than ``min_hold_s`` after its last
      trigger flip.
    * **Order** (``order_strict``). Climb: a rung switches on only if every earlier rung under its
      trigger is on (this evaluation's switches included, so a sudden spike can climb several rungs
      at once, in order). Descend: last-on-first-off, a rung switches off only once every later rung
      under its trigger is off (again counting this evaluation's switches, processed from the top).
      Forced rungs stand outside the order: they neither block nor enable the others, so on-call can
      disable a misbehaving rung without stopping the ladder below shedding.

    ``shed_tiers``: with ``shed`` on, the first listed tier is shed; the tier at index ``k >= 1`` is shed
    too while the shed trigger's metric exceeds ``(k + 1) * on_above`` (so with the default ``["free",
    "paid"]``, paid traffic is shed only past twice the shed threshold). Enterprise is never shed
    unless listed.
    """

    Params = LadderParams
    params: LadderParams

    def __init__(self, params: BaseLadderParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._on: dict[str, bool] = dict.fromkeys(RUNGS, False)
        self._since_s: dict[str, float] = dict.fromkeys(RUNGS, -math.inf)  # last trigger flip
        indexed = sorted(enumerate(self.params.overrides), key=lambda io: (io[1].at_s, io[0]))
        self._overrides: dict[str, list[LadderOverride]] = {r: [o for _, o in indexed if o.rung == r] for r in RUNGS}

    def forced(self, rung: str, now_s: float) -> bool | None:
        """The state on-call forces ``rung`` into at ``now_s`` (None: under its trigger)."""
        state = "auto"
        for o in self._overrides[rung]:
            if o.at_s > now_s:
                break
            state = o.state
        return None if state == "auto" else state == "on"

    def evaluate(self, signals: LadderSignals) -> LadderDecision:
        self._tick(signals.now_s)
        now, p = signals.now_s, self.params
        before = dict(self._on)
        forced = {r: self.forced(r, now) for r in RUNGS}
        reasons: dict[str, str] = {}
        want: dict[str, bool] = {}
        for r in RUNGS:
            f = forced[r]
            if f is not None:
                self._since_s[r] = -math.inf  # "auto" later starts from a clean hold
                self._on[r] = f
                reasons[r] = f"override: {'on' if f else 'off'}"
                continue
            t = p.triggers[r]  # type: ignore[index]
            v = signals.metric(t.metric)
            if v is None:
                want[r] = self._on[r]
            elif self._on[r]:
                want[r] = not v < t.off_below
                if not want[r]:
                    reasons[r] = f"auto: {t.metric} {v:.1f} < {t.off_below:.1f}"
            else:
                want[r] = v > t.on_above
                if want[r]:
                    reasons[r] = f"auto: {t.metric} {v:.1f} > {t.on_above:.1f}"
        auto = [r for r in RUNGS if forced[r] is None]
        for r in reversed(auto):  # descend first, from the top: last on, first off
            if self._on[r] and not want[r]:
                self._flip(r, False, now, reasons, auto)
        for r in auto:  # then climb, from the bottom
            if not self._on[r] and want[r]:
                self._flip(r, True, now, reasons, auto)
        for r in auto:
            if self._on[r] and r not in reasons:
                t = p.triggers[r]  # type: ignore[index]
                v = signals.metric(t.metric)
                reasons[r] = f"auto: stays on, {t.metric} {'no data' if v is None else f'{v:.1f}'} (off below {t.off_below:.1f})"
        on = tuple(r for r in RUNGS if self._on[r])
        changed = tuple((r, self._on[r]) for r in RUNGS if self._on[r] != before[r])
        return LadderDecision(on=on, changed=changed, reasons=tuple((r, reasons[r]) for r in RUNGS if r in reasons),
                              shed_tiers=self._shed_tiers(signals) if self._on["shed"] else ())

    def _flip(self, r: str, to_on: bool, now: float, reasons: dict[str, str], auto: list[str]) -> None:
        t = self.params.triggers[r]  # type: ignore[index]
        if now - self._since_s[r] < t.min_hold_s:
            reasons[r] = (f"held: {'on' if self._on[r] else 'off'} until "
                          f"{self._since_s[r] + t.min_hold_s:.1f} s (min_hold_s {t.min_hold_s:g}); wanted {reasons.get(r)}")
            return
        if self.params.order_strict:
            i = auto.index(r)
            blockers = [x for x in auto[:i] if not self._on[x]] if to_on else [x for x in auto[i + 1:] if self._on[x]]
            if blockers:
                reasons[r] = (f"blocked: {'waits for' if to_on else 'stays while'} {blockers[0]} "
                              f"{'on' if to_on else 'is on'}; wanted {reasons.get(r)}")
                return
        self._on[r] = to_on
        self._since_s[r] = now

    def _shed_tiers(self, signals: LadderSignals) -> tuple[str, ...]:
        tiers = self.params.shed_tiers
        if not tiers:
            return ()
        t = self.params.triggers["shed"]
        v = signals.metric(t.metric)
        extra = [tier for k, tier in enumerate(tiers) if k >= 1 and v is not None and v > (k + 1) * t.on_above]
        return (tiers[0], *extra)


# ---------------------------------------------------------------------------------------------- config
LADDER_FAMILY: PolicyFamily[BaseLadderParams, LadderPolicy] = PolicyFamily(LADDERS, BaseLadderParams,
                                                                          title="LadderConfig")

LadderConfig = LADDER_FAMILY.config_type
"""Embed as a field type in the scenario schema: ``ladder: LadderConfig``."""

LADDER_CONFIG = LADDER_FAMILY.adapter
parse_ladder_config = LADDER_FAMILY.parse
"""Validate a ``{kind: <key>, ...params}`` mapping into its frozen params model."""
build_ladder = LADDER_FAMILY.build
"""A fresh ladder from its config (``seed`` is passed on; no built-in ladder is random)."""


# ---------------------------------------------------------------------------------------- model fallback
@dataclass(frozen=True, slots=True)
class ModelNeeds:
    """What a request needs of whatever model serves it."""

    context_tokens: int
    needs_tools: bool


@dataclass(frozen=True, slots=True)
class ModelOption:
    """A model the request could go to. ``preference``: lower is preferred."""

    name: str
    max_context_tokens: int
    supports_tools: bool
    regions: tuple[str, ...]
    preference: int


def model_fits(needs: ModelNeeds, option: ModelOption, *, tenant_regions: tuple[str, ...] | None) -> bool:
    """Whether ``option`` has every capability ``needs`` asks for and a region inside the tenant's
    residency (``tenant_regions`` None: no residency constraint)."""
    if option.max_context_tokens < needs.context_tokens or (needs.needs_tools and not option.supports_tools):
        return False
    return tenant_regions is None or any(r in tenant_regions for r in option.regions)


def fallback_model(request_needs: ModelNeeds, candidates: Sequence[ModelOption], *,
                   tenant_regions: tuple[str, ...] | None) -> str | None:
    """The model to fall back to: among candidates that fit (:func:`model_fits`), the lowest
    ``preference``, ties broken by name. None when nothing fits: the request must wait or fail rather
    than go to a model that lacks a capability or would serve it outside the tenant's regions."""
    fits = [c for c in candidates if model_fits(request_needs, c, tenant_regions=tenant_regions)]
    if not fits:
        return None
    return min(fits, key=lambda c: (c.preference, c.name)).name
