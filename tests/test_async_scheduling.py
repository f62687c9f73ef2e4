"""Async scheduling (vLLM's GPU default, ../shared/reference/vllm-engine-semantics.md §2.12): the engine forms step
N+1 while step N runs, so a request that arrives during step N is first scheduled in step N+2 (N+1 when scheduling
is synchronous, as on vLLM's CPU backend). An unset setting resolves as vLLM resolves it; recorded runs say which one
they ran with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from enginekit import make_engine, req
from twin.calibration.recorded import load_recorded_run
from twin.models.workload import RequestSpec
from twin.replay import replay_scenario
from twin.runner import SingleReplicaRun, run_scenario
from twin.scenario import parse_scenario

STEP_S = 0.01  # every step takes this long, whatever it holds: a late admission shows as whole steps
ONE_REQUEST = {"kind": "synthetic", "num_requests": 1, "arrival": {"kind": "offline"},  # (the tests send their own)
               "prompt_tokens": {"kind": "constant", "value": 1}, "output_tokens": {"kind": "constant", "value": 1}}


def _scenario(async_scheduling: bool, *, max_run: int = 512, workload: dict | None = None):
    return parse_scenario({
        "name": "async-scheduling", "seed": 5,
        "workload": workload or ONE_REQUEST,
        "replica": {"step_time": {"kind": "fixed", "step_s": STEP_S}, "max_decode_run_steps": max_run,
                    "engine": {"num_gpu_blocks": 400, "max_num_batched_tokens": 512, "max_num_seqs": 16,
                               "max_model_len": 2048, "async_scheduling": async_scheduling}},
        "output": {"record_iterations": True, "record_token_times": True},
    })


def _spec(rid: str, at: float, *, prompt: int = 64, out: int = 40) -> RequestSpec:
    ids = tuple(range(1000 * (1 + ord(rid[-1])), 1000 * (1 + ord(rid[-1])) + prompt))
    return RequestSpec(request_id=rid, arrival_s=at, pieces=(("ids", ids),), prompt_tokens=prompt,
                       output_tokens=out, max_tokens=out, output_segment=ord(rid[-1]))


def _requests(async_scheduling: bool, specs: list[RequestSpec], **kw) -> dict[str, dict]:
    res = run_scenario(_scenario(async_scheduling, **kw), specs=specs)
    assert res.ok, res.manifest.get("exception")
    t = res.tables["requests"].to_pylist()
    return {r["request_id"]: r for r in t}


@pytest.mark.parametrize("max_run", [1, 512])
def test_an_arrival_during_a_step_is_scheduled_one_step_later_with_async_scheduling(max_run):
    # a decodes from step 1 on (one step each 10 ms); b arrives 5 ms into the step that starts at 20 ms. With decode
    # runs on (512) its arrival cuts a's run, as it must in both modes
    specs = [_spec("a", 0.0), _spec("b", 0.025)]
    sync, asyn = _requests(False, specs, max_run=max_run), _requests(True, specs, max_run=max_run)
    assert sync["b"]["queue_s"] == pytest.approx(0.005)  # the next step, at 30 ms
    assert asyn["b"]["queue_s"] == pytest.approx(0.015)  # the step after, at 40 ms: the one at 30 ms was formed
    assert asyn["b"]["ttft_s"] - sync["b"]["ttft_s"] == pytest.approx(STEP_S)
    assert asyn["a"]["token_times_s"] == pytest.approx(sync["a"]["token_times_s"])  # a's steps are unchanged


def test_an_arrival_at_an_idle_replica_is_scheduled_at_once_in_both_modes():
    specs = [_spec("a", 0.0, out=3), _spec("b", 0.5, out=3)]
    for mode in (False, True):
        r = _requests(mode, specs)
        assert r["a"]["queue_s"] == 0.0 and r["b"]["queue_s"] == 0.0, mode


def test_an_arrival_during_the_last_step_of_everything_is_scheduled_next():
    # a's only token comes from its prefill step (0-10 ms): nothing runs on after it, so vLLM formed no step while
    # it ran, and b (sent at 5 ms) is scheduled at 10 ms in both modes
    specs = [_spec("a", 0.0, out=1), _spec("b", 0.005, out=3)]
    sync, asyn = _requests(False, specs), _requests(True, specs)
    assert sync["b"]["queue_s"] == pytest.approx(0.005)
    assert asyn["b"]["queue_s"] == pytest.approx(0.005)


def test_async_scheduling_delays_first_tokens_and_decode_runs_keep_its_tables():
    # (test_runner_properties draws async_scheduling too, for every invariant there)
    wl = {"kind": "synthetic", "num_requests": 120, "arrival": {"kind": "poisson", "rate_per_s": 30.0},
          "prompt_tokens": {"kind": "uniform", "low": 16, "high": 300},
          "output_tokens": {"kind": "uniform", "low": 1, "high": 80}}
    one = run_scenario(_scenario(True, max_run=1, workload=wl))
    runs = run_scenario(_scenario(True, max_run=512, workload=wl))
    sync = run_scenario(_scenario(False, max_run=512, workload=wl))
    assert one.ok and runs.ok and sync.ok
    a, b = one.tables["requests"], runs.tables["requests"]
    assert a.column("request_id").equals(b.column("request_id"))
    for col in ("queue_s", "ttft_s", "e2e_s"):  # (a run sums its step times in another order: the last bits move)
        assert np.allclose(a.column(col).to_numpy(), b.column(col).to_numpy(), rtol=1e-12, atol=1e-12), col
    composition = ("ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens")
    assert one.tables["iterations"].select(composition).equals(runs.tables["iterations"].select(composition))
    # later first tokens than synchronous scheduling, by under a step on average (some arrivals find it idle)
    t_async = np.mean(a.column("ttft_s").to_numpy())
    t_sync = np.mean(sync.tables["requests"].column("ttft_s").to_numpy())
    assert 0 < t_async - t_sync < STEP_S


def test_held_requests_count_as_waiting_so_littles_law_still_holds():
    wl = {"kind": "synthetic", "num_requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 40.0},
          "prompt_tokens": {"kind": "uniform", "low": 16, "high": 300},
          "output_tokens": {"kind": "uniform", "low": 1, "high": 60}}
    res = run_scenario(_scenario(True, workload=wl))
    assert res.ok
    s = res.summary
    levels = res.world.rec.level_means(s["sim_time_s"])
    in_system = levels[("replica", "running")] + levels[("replica", "waiting")]
    e2e = res.tables["requests"].column("e2e_s").to_pylist()
    assert in_system == pytest.approx(len(e2e) / s["sim_time_s"] * sum(e2e) / len(e2e), rel=1e-9)


def test_a_held_request_is_kept_out_of_the_next_step_and_can_be_aborted():
    eng = make_engine(async_scheduling=True)
    a, b, c = req("a", 40, out=5), req("b", 40, out=5), req("c", 40, out=5)
    eng.add(a)
    eng.add(b, held=True)
    eng.add(c, held=True)
    step = eng.schedule(0.0)
    assert [r.request_id for r in step.reqs] == ["a"]
    assert eng.has_work and len(eng.held) == 2
    assert eng.abort(c, 0.001)
    assert c.finished_reason == "abort" and eng.held == [b]
    assert eng.release_held() == 1 and eng.held == []
    eng.complete(step, 0.01)
    assert sorted(r.request_id for r in eng.schedule(0.01).reqs) == ["a", "b"]


def test_a_crash_drops_the_held_requests_too():
    world = SingleReplicaRun(_scenario(True), seed=5, replication=0, specs=[_spec("a", 0.0), _spec("b", 0.025)])
    world.start()
    world.env.run(until=0.027)
    assert [r.request_id for r in world.engine.held] == ["b"]
    dropped = world.replica.crash()
    assert sorted(r.request_id for r in dropped) == ["a", "b"]
    assert world.engine.held == [] and not world.engine.has_work


def _run_json(tmp_path, **over) -> object:
    src = Path(__file__).parent / "fixtures" / "recorded" / "offline-mixed"
    run = json.loads((src / "run.json").read_text())
    run.update(over)
    d = tmp_path / "run"
    d.mkdir()
    (d / "run.json").write_text(json.dumps(run))
    (d / "requests.jsonl").write_text((src / "requests.jsonl").read_text())
    return load_recorded_run(d)


@pytest.mark.parametrize(("hardware", "args", "expected"), [
    ("cpu 2-core x86_64 avx512 (AMD EPYC)", [], False),  # vLLM's CPU backend forces it off
    ("1xH100-80GB", [], True),  # vLLM's GPU default
    ("1xH100-80GB", ["--no-async-scheduling"], False),
    ("1xH100-80GB", ["--async-scheduling", "--no-async-scheduling"], False),  # the last one wins
    ("cpu 2-core", ["--async-scheduling"], True),
    ("1xH100-80GB", ["--async-scheduling=false"], False),
])
def test_a_recorded_run_says_whether_it_scheduled_asynchronously_and_the_replay_follows(tmp_path, hardware, args,
                                                                                        expected):
    rec = _run_json(tmp_path, hardware=hardware, engine_args=args)
    assert rec.run.async_scheduling is expected
    assert replay_scenario(rec, None).replica.engine.async_scheduling is expected


@pytest.mark.parametrize(("step_time", "setting", "expected"), [
    ({"kind": "profile", "profile": "llama3-70b-fp8-tp4-h100"}, None, True),  # a GPU: vLLM resolves it on
    ({"kind": "profile", "profile": "llama3-8b-bf16-tp1-h200"}, None, True),
    ({"kind": "profile", "profile": "cpu-tiny-llama"}, None, False),  # vLLM's CPU backend forces it off
    ({"kind": "fixed", "step_s": STEP_S}, None, False),
    ({"kind": "profile", "profile": "llama3-70b-fp8-tp4-h100"}, False, False),  # set: as set
    ({"kind": "profile", "profile": "cpu-tiny-llama"}, True, True),
])
def test_an_unset_async_scheduling_resolves_as_vllm_resolves_it(step_time, setting, expected):
    engine = {"num_gpu_blocks": 400, "max_model_len": 2048}
    if setting is not None:
        engine["async_scheduling"] = setting
    sc = parse_scenario({"name": "resolve", "workload": ONE_REQUEST,
                         "replica": {"step_time": step_time, "engine": engine}})
    world = SingleReplicaRun(sc, seed=0, replication=0, specs=[])
    assert world.engine.cfg.async_scheduling is expected


def test_every_fleet_replica_of_a_gpu_profile_schedules_asynchronously():
    from twin.models.fleet import FleetWorld
    from twin.scenario import load_scenario

    sc = load_scenario("scenarios/launch-day-10x.yaml")
    world = FleetWorld(sc, seed=1, replication=0)
    assert world.handles and all(h.replica.engine.cfg.async_scheduling for h in world.handles)
    off = load_scenario("scenarios/launch-day-10x.yaml", overrides=["fleet.models.large.engine.async_scheduling=false"])
    world = FleetWorld(off, seed=1, replication=0)
    assert {h.model for h in world.handles if not h.replica.engine.cfg.async_scheduling} == {"large"}


def _recording_of_a_replay(out: Path, *, asynchronous: bool, profile: str) -> Path:
    """A server recording made by the twin: a committed CPU server run's requests, replayed with ``profile`` under
    ``--async-scheduling`` or ``--no-async-scheduling``, written in the recorded-run format (its token times, step
    log and cached counts the twin's)."""
    from twin.calibration._vllm_common import write_run
    from twin.replay import replay

    src = Path(__file__).parent / "fixtures" / "recorded" / "server-poisson-high"
    run = json.loads((src / "run.json").read_text())
    run["engine_args"] = [*run["engine_args"], "--async-scheduling" if asynchronous else "--no-async-scheduling"]
    staged = out / "staged"
    staged.mkdir(parents=True)
    (staged / "run.json").write_text(json.dumps(run))
    (staged / "requests.jsonl").write_text((src / "requests.jsonl").read_text())
    rec = load_recorded_run(staged)
    res = replay(rec, profile=profile, step_times="profile", noise=False)
    assert res.ok
    sent = {q.request_id: q for q in rec.requests}
    reqs = sorted(({"request_id": r["request_id"], "arrival_s": sent[r["request_id"]].arrival_s,
                    "prompt_token_ids": list(sent[r["request_id"]].prompt_token_ids),
                    "max_tokens": sent[r["request_id"]].max_tokens, "output_tokens": len(r["token_times_s"]),
                    "token_times_s": r["token_times_s"], "e2e_s": r["e2e_s"],
                    "num_cached_tokens": r["num_cached_tokens"]} for r in res.tables["requests"].to_pylist()),
                  key=lambda x: x["arrival_s"])
    columns = ("ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens", "elapsed_ms", "kv_usage_pct")
    steps = [{"step": i, **{k: s[k] for k in columns}} for i, s in enumerate(res.tables["iterations"].to_pylist())]
    write_run(out / "run", run, reqs, steps)
    return out / "run"


def test_the_arrival_fit_reads_an_async_recording_a_step_earlier(tmp_path):
    from twin.calibration.server import arrival_bounds, fit_arrival_s, reconstruct
    from twin.replay import server_front_end

    profile = str(Path(__file__).parent / "fixtures" / "calibration" / "cpu-tiny-llama-freshclone-evening"
                  / "cpu-tiny-llama.yaml")
    fitted = {}
    for asynchronous in (False, True):
        rec = load_recorded_run(_recording_of_a_replay(tmp_path / str(asynchronous), asynchronous=asynchronous,
                                                       profile=profile))
        assert rec.run.async_scheduling is asynchronous
        server = server_front_end(rec, profile)
        steps = reconstruct(rec)
        lower, upper = arrival_bounds(rec, steps, front_end_s=server.step_time.overhead_s)
        fitted[asynchronous] = fit_arrival_s(lower, upper)
        assert fitted[asynchronous] == (server.arrival_s, len(rec.requests))  # every request consistent with it
        if asynchronous:  # read as if synchronous, the same recording fits a later arrival, fewer consistent
            as_sync = dataclasses.replace(rec, run=rec.run.model_copy(
                update={"engine_args": [*rec.run.engine_args, "--no-async-scheduling"]}))
            d, n = fit_arrival_s(*arrival_bounds(as_sync, steps, front_end_s=server.step_time.overhead_s))
            assert d > server.arrival_s + 0.002 and n < len(rec.requests)


def test_replay_and_fidelity_say_when_a_recording_scheduled_asynchronously(tmp_path, capsys):
    from twin.cli import main

    profile = str(Path(__file__).parent / "fixtures" / "calibration" / "cpu-tiny-llama-freshclone-evening"
                  / "cpu-tiny-llama.yaml")
    gpu = _recording_of_a_replay(tmp_path / "gpu", asynchronous=True, profile=profile)
    cpu = Path(__file__).parent / "fixtures" / "recorded" / "server-poisson-high"
    assert main(["replay", str(gpu), "--profile", profile]) == 0
    assert "(server, async scheduling, 48 requests)" in capsys.readouterr().out
    assert main(["replay", str(cpu), "--profile", profile]) == 0
    assert "(server, 48 requests)" in capsys.readouterr().out
    out = tmp_path / "f.json"
    assert main(["fidelity", "--profile", profile, str(gpu), str(cpu), "--json", str(out), "--draws", "1"]) == 0
    text = capsys.readouterr().out
    assert "run (server, async scheduling, 48 requests)" in text  # (not a repeat of the synchronous run)
    assert "server-poisson-high (server, 48 requests)" in text
    assert [r["async_scheduling"] for r in json.loads(out.read_text())["runs"]] == [True, False]
