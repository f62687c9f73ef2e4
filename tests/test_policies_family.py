"""PolicyFamily, PolicyBase and MonotoneClock on a toy family of their own (the six real families are
covered by their own tests, which ran unchanged when they moved onto this helper)."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
from pydantic import BaseModel, Field, ValidationError

from twin.policies.family import MonotoneClock, PolicyBase, PolicyFamily, PolicyParams
from twin.registry import Registry


class ToyParams(PolicyParams):
    """Base of the toy family's params."""


class ToyPolicy(MonotoneClock, PolicyBase[ToyParams]):
    Params: ClassVar[type[ToyParams]]

    def step(self, now_s: float) -> float:
        self._tick(now_s)
        return now_s


TOYS: Registry[type[ToyPolicy]] = Registry("example policy")


class SteadyParams(ToyParams):
    kind: Literal["steady"] = "steady"
    rate_per_s: float = Field(1.0, gt=0.0)


@TOYS.register("steady")
class SteadyToy(ToyPolicy):
    Params = SteadyParams


class BurstyParams(ToyParams):
    kind: Literal["bursty"] = "bursty"
    inner: ToyConfig = Field(default_factory=SteadyParams)


@TOYS.register("bursty")
class BurstyToy(ToyPolicy):
    Params = BurstyParams


TOY_FAMILY: PolicyFamily[ToyParams, ToyPolicy] = PolicyFamily(TOYS, ToyParams, title="ToyConfig",
                                                              rebuild=[BurstyParams])
ToyConfig = TOY_FAMILY.config_type


class OtherParams(PolicyParams):
    kind: Literal["steady"] = "steady"


def test_unknown_kind_says_did_you_mean_and_lists_the_known_kinds() -> None:
    with pytest.raises(ValidationError, match=r"unknown example policy 'stedy'; did you mean 'steady'\? "
                                              r"\(known: bursty, steady\)"):
        TOY_FAMILY.parse({"kind": "stedy"})


def test_missing_kind_names_the_family_with_its_article_and_the_known_kinds() -> None:
    with pytest.raises(ValidationError, match=r"an example policy needs a 'kind' \(known: bursty, steady\)"):
        TOY_FAMILY.parse({"rate_per_s": 2.0})


def test_a_field_typo_fails_with_its_path() -> None:
    with pytest.raises(ValidationError, match="rate_per_sec"):
        TOY_FAMILY.parse({"kind": "steady", "rate_per_sec": 2.0})


def test_parse_validates_a_mapping_and_passes_a_params_model_of_the_family_through() -> None:
    parsed = TOY_FAMILY.parse({"kind": "steady", "rate_per_s": 2.0})
    assert parsed == SteadyParams(rate_per_s=2.0)
    params = SteadyParams(rate_per_s=3.0)
    assert TOY_FAMILY.parse(params) is params


def test_a_params_model_of_another_family_is_revalidated_not_passed_through() -> None:
    with pytest.raises(ValidationError):
        TOY_FAMILY.parse(OtherParams())  # type: ignore[arg-type]


def test_config_type_refers_to_itself_through_rebuild() -> None:
    parsed = TOY_FAMILY.parse({"kind": "bursty", "inner": {"kind": "bursty", "inner": {"kind": "steady"}}})
    assert isinstance(parsed, BurstyParams) and isinstance(parsed.inner, BurstyParams)
    assert parsed.inner.inner == SteadyParams()
    with pytest.raises(ValidationError, match="did you mean 'steady'"):
        TOY_FAMILY.parse({"kind": "bursty", "inner": {"kind": "stedy"}})


def test_the_config_type_embeds_as_a_field() -> None:
    class Scenario(BaseModel):
        toy: ToyConfig  # type: ignore[valid-type]

    assert Scenario.model_validate({"toy": {"kind": "bursty"}}).toy == BurstyParams()
    with pytest.raises(ValidationError, match=r"toy\n.*needs a 'kind'"):
        Scenario.model_validate({"toy": {}})


def test_errors_are_titled_for_a_union_and_a_family_of_one_still_builds() -> None:
    with pytest.raises(ValidationError, match="1 validation error for ToyConfig"):
        TOY_FAMILY.parse({"kind": "steady", "rate_per_s": -1.0})
    solo: Registry[type[ToyPolicy]] = Registry("solo policy")
    solo.register("steady")(type("SoloToy", (ToyPolicy,), {"Params": SteadyParams}))
    family = PolicyFamily(solo, ToyParams, title="SoloConfig")  # no union: a title would be refused
    assert family.parse({"kind": "steady"}) == SteadyParams()
    with pytest.raises(ValidationError, match="greater than 0"):
        family.parse({"kind": "steady", "rate_per_s": -1.0})


def test_build_picks_the_class_registered_under_the_kind_and_passes_the_seed() -> None:
    steady = TOY_FAMILY.build({"kind": "steady"}, seed=7)
    bursty = TOY_FAMILY.build(BurstyParams(), seed=8)
    assert type(steady) is SteadyToy and steady.params == SteadyParams() and steady.seed == 7
    assert type(bursty) is BurstyToy and bursty.seed == 8


def test_a_policy_given_another_kinds_params_raises_type_error() -> None:
    with pytest.raises(TypeError, match="SteadyToy needs SteadyParams, got BurstyParams"):
        SteadyToy(BurstyParams(), seed=0)  # type: ignore[arg-type]


def test_clock_may_stand_still_but_not_go_back() -> None:
    toy = TOY_FAMILY.build({"kind": "steady"}, seed=0)
    assert toy.step(1.0) == 1.0 and toy.step(1.0) == 1.0
    with pytest.raises(ValueError, match="SteadyToy: time went back from 1.0 to 0.5"):
        toy.step(0.5)
    other = TOY_FAMILY.build({"kind": "steady"}, seed=0)
    assert other.step(0.0) == 0.0  # each instance has its own clock
