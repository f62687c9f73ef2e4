"""The replica's decode-run wait (one timeout per run, moved to a wake event when an arrival or abort cuts the
run) keeps every event in the place the former wait gave it, ties included.

The former wait went through ``first_of(timeout, wake)``: one more event per run, scheduled when the first
of the two was processed, so the process resumed behind whatever else was queued for that instant. Here
step times and arrival, cancellation and bystander times all lie on a 1/16-s grid, so runs end, get cut and
finish at the same instants as other processes act, some of which go on acting at the same instant (a
zero-delay cascade); the log of everything that happens (recorded events,
bystanders, finished callbacks, in order) must be the same with the former wait as with the current one,
and differ without the same-instant hop (so the schedules do exercise ties).
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import numpy as np
import pytest
import simpy

from twin.models.engine import Engine, EngineConfig
from twin.models.recorder import Recorder
from twin.models.replica import Replica
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq
from twin.models.waits import first_of


class FirstOfReplica(Replica):
    """The decode run as it was (commit e22a1ae): all its step ends worked out up front, a wake event per run,
    ``first_of(timeout, wake)``, a poke succeeding the wake."""

    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _decode_run(self, step, k: int):
        env = self.env
        t0 = env.now
        sh = step.shape
        model = self.step_model
        if self.speed_factor == 1.0 and self.decode_speedup is None and hasattr(model, "decode_run_list"):
            durs = model.decode_run_list(sh.decode_requests, sh.decode_context_tokens, k)
        else:
            durs = (model.decode_run_s(sh.decode_requests, sh.decode_context_tokens, k) * self.speed_factor).tolist()
        ends = [t0 + s for s in accumulate(durs)]
        end = ends[-1]
        self._wake = env.event()
        yield first_of(env, env.timeout(end - t0), self._wake)
        m = k
        if env.now < end:
            j = bisect_right(ends, env.now)
            m = min(j + 1, k)
            if ends[m - 1] > env.now:
                yield env.timeout(ends[m - 1] - env.now)
        ends_l = ends[:m] if m < k else ends
        self._step_index += m
        finished = self.engine.complete_decode_run(step, m, ends_l)
        self._note_complete(step, finished)


class NoHopReplica(Replica):
    """The current wait without the same-instant hop (must differ somewhere, or the ties are not exercised)."""

    def _wait_run(self, ends):
        env = self.env
        k, t0 = len(ends), env.now
        timeout = env.timeout(ends[-1] - t0)
        self._run_wait, self._run_end_t = timeout, t0 + (ends[-1] - t0)
        yield timeout
        self._run_wait, self._run_end_t = None, float("inf")
        if not self._cut:
            return k
        self._cut = False
        if env.now >= ends[-1]:
            return k
        m = min(bisect_right(ends, env.now) + 1, k)
        if ends[m - 1] > env.now:
            yield env.timeout(ends[m - 1] - env.now)
        return m


class GridSteps:
    """Step times on a 1/16-s grid (sums exact in floating point)."""

    overhead_s = 0.0

    def step_time_s(self, shape) -> float:
        return 0.25 if shape.prefill_requests else 0.125

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        return np.full(num_steps, 0.125)


class GridListSteps(GridSteps):
    """With ``decode_run_list`` (the replica's other way to the step times)."""

    def decode_run_list(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> list[float]:
        return [0.125] * num_steps


class LogRecorder(Recorder):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def event(self, t_s, kind, scope, request_id=None, value=None, reason=None) -> None:
        self.log.append((t_s, kind, request_id, value, reason))
        super().event(t_s, kind, scope, request_id, value, reason)


def _run(cls: type[Replica], seed: int, steps=GridSteps) -> list:
    rng = np.random.default_rng(seed)
    log: list = []
    env = simpy.Environment()
    engine = Engine(EngineConfig(num_gpu_blocks=600, block_size=16, max_num_batched_tokens=512, max_num_seqs=16,
                                 max_model_len=2048))
    replica = cls(env, scope="r", engine=engine, step_model=steps(), recorder=LogRecorder(log),
                  max_decode_run_steps=int(rng.choice([8, 64])),
                  on_finished=lambda r: log.append((env.now, "done", r.request_id)))
    n = 60
    arrivals = np.sort(rng.integers(0, 480, n)) / 16
    prompts, outputs = rng.integers(8, 300, n), rng.integers(1, 40, n)
    live: list[EngineRequest] = []

    def source():
        for i in range(n):
            if arrivals[i] > env.now:
                yield env.timeout(arrivals[i] - env.now)
            seq = TokenSeq([("seg", (i, int(prompts[i])))], block_size=16, output_segment=10_000 + i)
            r = EngineRequest(request_id=str(i), arrival_s=env.now, seq=seq, max_tokens=int(outputs[i]))
            live.append(r)
            replica.submit(r)

    def bystander(name: str, times: np.ndarray, cancel: bool):
        for t in np.sort(times) / 16:
            if t > env.now:
                yield env.timeout(t - env.now)
            log.append((env.now, name))
            if cancel and live:
                replica.cancel(live[int(rng.integers(len(live)))])
            yield env.timeout(0)  # a same-instant cascade: where the replica resumes among these is observable
            log.append((env.now, name + " again"))

    replica.start()
    env.process(source())
    env.process(bystander("tick", rng.integers(0, 600, 80), False))
    env.process(bystander("cancel", rng.integers(0, 600, 10), True))
    env.run(until=60.0)
    return log


@pytest.mark.parametrize("steps", [GridSteps, GridListSteps])
@pytest.mark.parametrize("seed", range(8))
def test_run_wait_keeps_the_event_order(seed: int, steps) -> None:
    assert _run(Replica, seed, steps) == _run(FirstOfReplica, seed, steps)


def test_the_schedules_exercise_same_instant_ties() -> None:
    assert any(_run(NoHopReplica, seed) != _run(FirstOfReplica, seed) for seed in range(8))
