"""Shared prefixes in decode steps (docs/calibration-sessions.md, "Shared prefixes in decode steps").

In the recorded CPU server runs a decode step whose requests read the same cached prefix ran faster than its context
says. ``DecodeCoefficients.shared_context_fraction`` times a context token another decode item of the step reads too
(beyond the block's first reader) at that fraction of an unshared one; replays count those tokens, the fleet never
does. The fraction is fitted (``twin calibrate --server-shared-context``) on server runs that share prefixes, kept
out of the other terms' fit: here the diagnostic pair committed in tests/fixtures/calibration/
cpu-small-llama-diag-prefix-mix (SOURCES.md there), a prefix mix and the same requests with every prefix its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from calibkit import check_refit, check_table, held_out_table, latency_passed, sweep_runs
from twin.calibration.calibrate import CalibrationError, FitOptions, calibrate
from twin.calibration.recorded import load_recorded_run
from twin.calibration.server import decode_shared_tokens, fit_shared_fraction, reconstruct
from twin.engine_profiles import load_profile
from twin.engine_profiles.profile import SharedContextStepTime, step_time_model_of
from twin.engine_profiles.step import StepShape
from twin.models.engine import Engine, EngineConfig
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq
from twin.replay import shared_context_tokens

FIXTURES = Path(__file__).parent / "fixtures" / "calibration"
DIAG = FIXTURES / "cpu-small-llama-diag-prefix-mix"
SHARED = sorted(DIAG.glob("diag-prefix-mix-shared-*"))
UNIQUE = sorted(DIAG.glob("diag-prefix-mix-unique-*"))
# the first look: the held-out server prefix mix itself (its spec renamed), and the same with unique prefixes
FIRST_SHARED = sorted((DIAG / "first-look").glob("heldout-mix-shared-*"))
FIRST_UNIQUE = sorted((DIAG / "first-look").glob("heldout-mix-unique-*"))
CONTEXT = FIXTURES / "cpu-small-llama-context"


def _with_fraction(spec, fraction: float):  # noqa: ANN001, ANN202 (a ProfileSpec in and out)
    """``spec`` with its server section's decode ``shared_context_fraction`` set to ``fraction``."""
    st = spec.server.step_time
    st = st.model_copy(update={"decode": st.decode.model_copy(update={"shared_context_fraction": fraction})})
    return spec.model_copy(update={"server": spec.server.model_copy(update={"step_time": st})})


def _server_terms():
    return load_profile(str(CONTEXT / "cpu-small-llama.yaml")).spec.server.step_time


def test_a_shared_token_costs_its_fraction_of_a_context_token_in_every_regime() -> None:
    base = step_time_model_of(_server_terms())
    m = SharedContextStepTime(base, 0.25)
    assert m.step_time_s(StepShape(8, 4000, decode_shared_tokens=2048)) == base.step_time_s(StepShape(8, 4000 - 1536))
    mixed = StepShape(8, 4000, 1, 300, 45_150, 2048)
    assert m.step_time_s(mixed) == base.step_time_s(StepShape(8, 2464, 1, 300, 45_150))
    assert m.step_time_s(StepShape(8, 4000)) == base.step_time_s(StepShape(8, 4000))
    assert m.step_time_s(StepShape(8, 4000, decode_shared_tokens=2048)) < base.step_time_s(StepShape(8, 4000))


def test_the_fraction_is_in_the_profile_file_only_when_fitted(tmp_path) -> None:
    spec = load_profile(str(CONTEXT / "cpu-small-llama.yaml")).spec
    assert "shared_context_fraction" not in yaml.safe_dump(spec.model_dump(mode="json"))
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_with_fraction(spec, 0.4).model_dump(mode="json")))
    again = load_profile(str(path)).spec.server.step_time
    assert again.decode.shared_context_fraction == 0.4
    assert isinstance(step_time_model_of(again), SharedContextStepTime)
    assert not isinstance(step_time_model_of(spec.server.step_time), SharedContextStepTime)


@pytest.mark.parametrize("group", [True, False])
def test_a_twin_step_counts_the_blocks_a_second_reader_hit(group: bool) -> None:
    """Two requests with the same two-block prefix, the second admitted after the first cached it: once both
    decode, every step reads those two blocks twice."""
    bs = 4
    e = Engine(EngineConfig(num_gpu_blocks=64, block_size=bs, max_num_batched_tokens=64, max_num_seqs=8,
                            max_model_len=256, enable_prefix_caching=True))
    e.use_group = group

    def request(rid: int) -> EngineRequest:
        seq = TokenSeq([("seg", (7, 2 * bs)), ("seg", (100 + rid, 3))], block_size=bs, output_segment=200 + rid)
        return EngineRequest(request_id=str(rid), arrival_s=0.0, seq=seq, max_tokens=40)

    e.add(request(1))
    counts = []
    t = 0.0
    for i in range(30):
        if i == 3:
            e.add(request(2))
        step = e.schedule(t)
        counts.append(shared_context_tokens(step, bs))
        t += 0.01
        e.complete(step, t)
    assert e.prefix_cache_hits > 0
    assert counts[:3] == [0, 0, 0]  # one request alone
    assert counts[-10:] == [2 * bs] * 10  # both decoding: the prefix's two blocks, read twice


def test_the_recordings_count_shared_context_where_prefixes_repeat_and_only_there() -> None:
    for run in [*SHARED, *FIRST_SHARED]:
        rec = load_recorded_run(run)
        steps = reconstruct(rec)
        counts = decode_shared_tokens(rec, steps)
        assert (counts % rec.run.block_size == 0).all()
        assert all(c == 0 for c, sh in zip(counts, steps.shapes, strict=True) if sh.prefill_requests)
        decode_only = [c for c, sh in zip(counts, steps.shapes, strict=True) if not sh.prefill_requests]
        assert sum(1 for c in decode_only if c) > 0.4 * len(decode_only), run.name
    for run in [*UNIQUE, *FIRST_UNIQUE]:  # the same requests with every prefix its own
        rec = load_recorded_run(run)
        assert not decode_shared_tokens(rec, reconstruct(rec)).any()


def _decode_ratios(run: Path, model) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    rec = load_recorded_run(run)
    steps = reconstruct(rec)
    shared = decode_shared_tokens(rec, steps)
    ratio, share = [], []
    for sh, el, c in zip(steps.shapes, steps.elapsed_s, shared, strict=True):
        if not sh.prefill_requests and sh.decode_requests and el > 0:
            ratio.append(el / (model.step_time_s(sh) - model.overhead_s))
            share.append(c / sh.decode_context_tokens)
    return np.asarray(ratio), np.asarray(share)


def test_decode_steps_that_read_a_shared_prefix_ran_faster_than_their_context_says() -> None:
    """The measurement behind the term, against the server terms of a session fitted without it: within a run,
    decode steps with more than a third of their context shared ran at least 12 % (of the model's time) below the
    run's steps with none, and the more shared the faster, in eight of the nine shared runs. The ninth
    (diag-prefix-mix-shared-3) shows neither: a stretch of its unshared steps ran at 1.4-1.7x the model."""
    model = step_time_model_of(_server_terms())
    for run in [*SHARED, *FIRST_SHARED]:
        ratio, share = _decode_ratios(run, model)
        gap = np.median(ratio[share == 0]) - np.median(ratio[share > 1 / 3])
        corr = np.corrcoef(ratio, share)[0, 1]
        if run.name == "diag-prefix-mix-shared-3":
            assert gap < 0 and corr > 0
        else:
            assert gap > 0.12 and corr < -0.25, run.name


def test_the_fit_recovers_a_fraction_from_steps_timed_with_it() -> None:
    base = step_time_model_of(_server_terms())
    shapes, shared = [], []
    for run in SHARED:
        rec = load_recorded_run(run)
        steps = reconstruct(rec)
        shapes += steps.shapes
        shared.append(decode_shared_tokens(rec, steps))
    counts = np.concatenate(shared)
    truth = SharedContextStepTime(base, 0.3)
    elapsed = np.asarray([truth.step_time_s(StepShape(sh.decode_requests, sh.decode_context_tokens, sh.prefill_requests,
                                                      sh.prefill_tokens, sh.prefill_attention_pairs, int(c)))
                          - truth.overhead_s for sh, c in zip(shapes, counts, strict=True)])
    runs = np.concatenate([np.full(len(c), j) for j, c in enumerate(shared)])
    f, n, k = fit_shared_fraction(base, shapes, elapsed, counts, runs)
    assert f == 0.3 and k == len(SHARED)
    assert n == int(sum(1 for sh, c in zip(shapes, counts, strict=True) if c and not sh.prefill_requests))
    # a run on a host 30 % slower throughout says the same: each run is measured against its own unshared steps
    slow = np.where(runs == 0, 1.3, 1.0)
    assert fit_shared_fraction(base, shapes, elapsed * slow, counts, runs)[0] == 0.3


OPTIONS = FitOptions(server_offline_attention=True, decode_floor=True)


def test_calibrate_fits_the_fraction_on_the_shared_runs_and_the_rest_without_them() -> None:
    """A session's sweep with the shared runs added: the other terms are the sweep's own fit, coefficient for
    coefficient, and the fraction is what the shared runs say against them."""
    options = FitOptions(server_offline_attention=True, decode_floor=True, server_shared_context=True)
    spec = calibrate([*sweep_runs(CONTEXT), *SHARED], name="cpu-small-llama", command="test", options=options).spec
    assert spec.server.step_time.decode.shared_context_fraction == 0.0  # (at the bound: a shared block read once)
    check_refit(load_profile(str(CONTEXT / "cpu-small-llama.yaml")).spec, _with_fraction(spec, 1.0))
    assert "shared_context_fraction" in spec.server.provenance.notes
    assert all(str(r) in spec.server.provenance.sources for r in SHARED)
    # without a run that shares prefixes the fraction stays 1 (a cross-validation fold may leave it out), and says so
    alone = calibrate(sweep_runs(CONTEXT), name="x", command="test", options=options).spec
    assert alone.server.step_time.decode.shared_context_fraction == 1.0
    assert "not fitted" in alone.server.provenance.notes
    offline = [r for r in sweep_runs(CONTEXT) if "server" not in r.name]
    with pytest.raises(CalibrationError, match="server_shared_context fits the other server terms"):
        calibrate([*offline, *SHARED], name="x", command="test", options=options)


FRESH_PREFIX = FIXTURES / "cpu-small-llama-freshclone-prefix"  # the one command with the prefix run, after the choice


def test_the_session_after_the_choice_rejected_the_fraction(tmp_path) -> None:
    """The one command from a fresh clone with sweep-server-prefix in its sweep (tests/fixtures/calibration/
    cpu-small-llama-freshclone-prefix, SOURCES.md there): its profile is the fit of its sweep with the command's
    options of that commit; the fraction came out 0.05, and its held-out table is 146 of 160 items (64 of 72 latency
    items), every failure on the prefix mix with the twin fast. The same profile with the fraction at 1, which is
    what the one command fits from these recordings now: 160 of 160."""
    committed = load_profile(str(FRESH_PREFIX / "cpu-small-llama.yaml")).spec
    assert committed.provenance.command.endswith("--server-offline-attention --decode-floor --server-shared-context")
    options = FitOptions(server_offline_attention=True, decode_floor=True, server_shared_context=True)
    refit = calibrate(sweep_runs(FRESH_PREFIX), name="cpu-small-llama", command="test", options=options).spec
    check_refit(committed, refit)
    assert committed.server.step_time.decode.shared_context_fraction == 0.05
    table = json.loads((FRESH_PREFIX / "fidelity-held-out.json").read_text())
    report = held_out_table(FRESH_PREFIX, str(FRESH_PREFIX / "cpu-small-llama.yaml"))
    check_table(report, table)
    assert (table["summary"]["passed"], latency_passed(report)) == (146, 64)
    assert all("heldout-server-prefix-mix" in r["run"] for r in report["runs"]
               for i in r["items"].values() if i.get("pass") is False)
    without = _with_fraction(committed, 1.0)
    # which is what the one command as it now is fits from these recordings (the prefix run left out)
    now = calibrate([r for r in sweep_runs(FRESH_PREFIX) if r.name != "sweep-server-prefix"], name="cpu-small-llama",
                    command="test", options=FitOptions(server_offline_attention=True, decode_floor=True)).spec
    check_refit(without, now)
    path = tmp_path / "without.yaml"
    path.write_text(yaml.safe_dump(without.model_dump(mode="json")))
    report = held_out_table(FRESH_PREFIX, str(path))
    assert (report["summary"]["passed"], latency_passed(report)) == (160, 72)




def test_the_committed_runs_are_the_registered_workloads() -> None:
    """`twin record --workload NAME --model cpu-small-llama` records these requests again."""
    from twin.calibration.workload_sets import DIAGNOSTIC
    from twin.calibration.workloads import describe

    runs = [*SHARED, *UNIQUE, FRESH_PREFIX / "calibration" / "sweep-server-prefix"]
    for run in runs:
        spec = json.loads((run / "run.json").read_text())["workload"]["spec"]
        name = spec["name"]
        assert name in DIAGNOSTIC
        assert spec == describe(DIAGNOSTIC[name].model_copy(update={"model": "cpu-small-llama"}))["spec"], run
