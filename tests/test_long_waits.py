"""Think times kept out of SimPy's queue (``LongWaits``) wake their processes exactly where ``Timeout``s would:
at the same float times and at the same places in the event order, ties with other events included."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

import twin.models.client as client_mod
from twin.models.waits import LongWaits
from twin.runner import run_scenario
from twin.scenario import load_scenario
from runkit import assert_same_tables


class _PlainWaits:
    """The construction LongWaits replaces: a SimPy ``Timeout`` per wait."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env

    def wait(self, delay_s: float) -> simpy.Event:
        return self.env.timeout(delay_s)


@pytest.mark.parametrize("seed", range(10))
def test_long_waits_resume_where_timeouts_would(seed: int) -> None:
    """Processes alternate long waits and short timeouts on whole-number times, so many wake-ups tie with
    each other and with bystander events at one time; the log of who runs when, and the number of event ids
    taken, are the same as with plain Timeouts."""

    def run(kind: str) -> tuple[list[tuple[float, str]], int, int]:
        rng = np.random.default_rng(seed)
        env = simpy.Environment()
        waits = LongWaits(env) if kind == "long" else _PlainWaits(env)
        log: list[tuple[float, str]] = []
        most_queued = [0]

        def session(k: int):
            yield env.timeout(float(rng.integers(0, 4)))
            for turn in range(int(rng.integers(1, 6))):
                log.append((env.now, f"s{k} turn {turn}"))
                yield env.timeout(float(rng.integers(0, 3)))  # the turn itself
                env.timeout(float(rng.integers(0, 3))).callbacks.append(
                    lambda _e, k=k: log.append((env.now, f"bystander of s{k}")))
                yield waits.wait(float(rng.integers(0, 6)))
                most_queued[0] = max(most_queued[0], len(env._queue))
                log.append((env.now, f"s{k} woke"))

        for k in range(60):
            env.process(session(k))
        env.run()
        return log, next(env._eid), most_queued[0]

    long_log, long_ids, long_queued = run("long")
    plain_log, plain_ids, plain_queued = run("plain")
    assert long_log == plain_log
    assert long_ids == plain_ids
    assert long_queued < plain_queued  # the waits were out of SimPy's queue


def test_long_waits_refuse_a_negative_delay() -> None:
    with pytest.raises(ValueError):
        LongWaits(simpy.Environment()).wait(-1.0)


def _fleet():
    return load_scenario("scenarios/baseline-day.yaml", overrides=[
        "fleet.traffic.duration_s=30", "horizon_s=40", "fleet.traffic.think_time_s=3.0"])


def test_fleet_sessions_wake_in_the_same_order_as_with_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fleet with short think times (many sessions reach their later turns), the follow-up turns
    arrive at the same times in the same order of the event table as with a Timeout per think time, and
    every table is the same."""
    sides: list[LongWaits] = []

    class Counted(LongWaits):
        def __init__(self, env: simpy.Environment) -> None:
            super().__init__(env)
            sides.append(self)
            self.waits = 0

        def wait(self, delay_s: float):
            self.waits += 1
            return super().wait(delay_s)

    monkeypatch.setattr(client_mod, "LongWaits", Counted)
    side = run_scenario(_fleet())
    monkeypatch.setattr(client_mod, "LongWaits", _PlainWaits)
    plain = run_scenario(_fleet())
    assert side.ok and plain.ok
    assert len(sides) == 1 and sides[0].waits > 100  # the side queue did carry the think times

    def later_turns(res) -> list[tuple[float, int, str]]:
        ev = res.tables["events"].to_pydict()
        return [(t, s, r) for k, r, t, s in zip(ev["kind"], ev["request_id"], ev["t_s"], ev["seq"])
                if k == "request.arrived" and not r.endswith("-t0")]

    woke = later_turns(side)
    assert len(woke) > 100
    assert woke == later_turns(plain)
    assert_same_tables(side, plain)
