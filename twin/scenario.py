"""The scenario file: YAML validated once into frozen pydantic models (``extra="forbid"``).

A bad file (YAML syntax, typo, wrong type, negative rate, unknown kind or profile) raises
``ScenarioError`` with one message naming the field path; the CLI prints it and exits 2.
Defaults live here only. ``--set a.b.c=value`` overrides are applied to the raw mapping before
validation, so they are validated like the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from twin.engine_settings import EngineSettings
from twin.fleet_config import FleetSection


class ScenarioError(ValueError):
    """A scenario that cannot be run, with a message fit for a user."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


PosInt = Annotated[int, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


# ---- length distributions -----------------------------------------------------------------------
class ConstantLength(_Model):
    kind: Literal["constant"] = "constant"
    value: PosInt


class UniformLength(_Model):
    kind: Literal["uniform"]
    low: PosInt
    high: PosInt

    @model_validator(mode="after")
    def _order(self) -> UniformLength:
        if self.high < self.low:
            raise ValueError("high must be >= low")
        return self


class LognormalLength(_Model):
    kind: Literal["lognormal"]
    mean: PosFloat
    sigma: NonNegFloat = 1.0
    min: PosInt = 1
    max: PosInt = 1_000_000


class ExponentialLength(_Model):
    """Geometric in tokens (a discrete exponential) with the given mean, at least ``min``."""

    kind: Literal["exponential"]
    mean: PosFloat
    min: PosInt = 1
    max: PosInt = 1_000_000


LengthDist = Annotated[ConstantLength | UniformLength | LognormalLength | ExponentialLength,
                       Field(discriminator="kind")]


# ---- arrivals -----------------------------------------------------------------------------------
class PoissonArrivals(_Model):
    kind: Literal["poisson"] = "poisson"
    rate_per_s: PosFloat


class GammaArrivals(_Model):
    """Gamma inter-arrivals (``vllm bench serve --burstiness``): cv^2 = 1/burstiness."""

    kind: Literal["gamma"]
    rate_per_s: PosFloat
    burstiness: PosFloat = 1.0


class OfflineArrivals(_Model):
    """Every request queued before the first step (vLLM's offline ``LLM.generate``)."""

    kind: Literal["offline"]


Arrivals = Annotated[PoissonArrivals | GammaArrivals | OfflineArrivals, Field(discriminator="kind")]


class SharedPrefixConfig(_Model):
    """A share of requests start with one of ``groups`` shared system prompts (chosen uniformly)."""

    groups: PosInt = 1
    tokens: PosInt = 1024
    fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0


class SyntheticWorkload(_Model):
    kind: Literal["synthetic"] = "synthetic"
    # Bounded so a typo (4e9) is a clear error, not a 31 GiB allocation: 1M requests draw in ~15 s and
    # ~0.8 GB; a single replica simulates them in ~7 CPU-minutes. Longer studies belong to a fleet or a trace.
    num_requests: Annotated[int, Field(gt=0, le=1_000_000)]
    arrival: Arrivals
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    max_tokens: PosInt | None = None  # cap on output; default: the drawn output length (ignore_eos)
    shared_prefix: SharedPrefixConfig | None = None


from twin.models.traces import TraceWorkload  # noqa: E402  (pure pydantic; no cycle)

Workload = Annotated[SyntheticWorkload | TraceWorkload, Field(discriminator="kind")]


# ---- the replica ----------------------------------------------------------------------------------
class ProfileStepTime(_Model):
    kind: Literal["profile"] = "profile"
    profile: str = "llama3-70b-fp8-tp4-h100"


class FixedStepTimeConfig(_Model):
    """A closed-form step time (theory checks, demos); needs an explicit ``num_gpu_blocks``."""

    kind: Literal["fixed"]
    overhead_s: NonNegFloat = 0.0
    step_s: NonNegFloat = 0.0
    decode_token_s: NonNegFloat = 0.0
    prefill_token_s: NonNegFloat = 0.0
    context_token_s: NonNegFloat = 0.0


StepTime = Annotated[ProfileStepTime | FixedStepTimeConfig, Field(discriminator="kind")]


class ReplicaConfig(_Model):
    step_time: StepTime = ProfileStepTime()
    engine: EngineSettings = EngineSettings()
    max_decode_run_steps: PosInt = 512  # decode steps advanced in one event when nothing can change

    @model_validator(mode="after")
    def _blocks_known(self) -> ReplicaConfig:
        if self.step_time.kind == "fixed" and self.engine.num_gpu_blocks is None:
            raise ValueError("engine.num_gpu_blocks is required with a fixed step time (no memory model)")
        return self


class SloConfig(_Model):
    ttft_s: PosFloat = 0.8
    itl_s: PosFloat = 0.05


class OutputConfig(_Model):
    levels_interval_s: NonNegFloat = 0.0
    record_iterations: bool = False
    record_token_times: bool = False


class Scenario(_Model):
    """One simulated world: a single replica fed by ``workload``, or a whole ``fleet``."""

    name: str
    description: str = ""
    seed: Annotated[int, Field(ge=0)] = 0
    horizon_s: PosFloat | None = None  # stop the clock here; None: run until every request ends
    workload: Workload | None = None
    replica: ReplicaConfig = ReplicaConfig()
    fleet: FleetSection | None = None
    slo: SloConfig = SloConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _one_world(self) -> Scenario:
        if (self.workload is None) == (self.fleet is None):
            raise ValueError("give exactly one of 'workload' (a single replica) or 'fleet'")
        return self


# ---- loading ----------------------------------------------------------------------------------------
def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in ("constant", "uniform", "lognormal", "exponential", "poisson", "gamma", "offline", "synthetic",
                   "profile", "fixed", "trace", "population") and parts:
            continue  # discriminated-union tags add no information to the path
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or "(top level)"


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors()[:5]:
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (typo?)"
        lines.append(f"{source}: {_loc(tuple(err['loc']))}: {msg}")
    more = len(exc.errors()) - 5
    if more > 0:
        lines.append(f"{source}: ... and {more} more errors")
    return "\n".join(lines)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a copy of ``raw``."""
    import copy

    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ScenarioError(f"--set {item!r}: expected key=value")
        key, _, text = item.partition("=")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ScenarioError(f"--set {key}: value is not valid YAML ({exc.__class__.__name__})") from None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            nxt = node.get(p) if isinstance(node, dict) else None
            if nxt is None:
                nxt = {}
                node[p] = nxt
            if not isinstance(nxt, dict):
                raise ScenarioError(f"--set {key}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def parse_scenario(raw: Any, *, source: str = "scenario", overrides: list[str] | None = None) -> Scenario:
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
    if overrides:
        raw = apply_overrides(raw, overrides)
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(format_validation_error(exc, source)) from None
    check_references(scenario, source)
    return scenario


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}: cannot read ({exc.__class__.__name__}: {exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ScenarioError(f"{p}: not valid YAML{where}") from None
    return parse_scenario(raw, source=str(p), overrides=overrides)


def check_references(scenario: Scenario, source: str) -> None:
    """Names that point outside the file (profiles) must exist."""
    st = scenario.replica.step_time
    if st.kind == "profile":
        from twin.engine_profiles import load_profile

        try:
            load_profile(st.profile)
        except Exception as exc:  # noqa: BLE001 - any failure to load is a bad reference
            raise ScenarioError(f"{source}: replica.step_time.profile: {exc}") from None
