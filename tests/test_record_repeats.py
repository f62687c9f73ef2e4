"""Repeats through one engine start (``twin record --repeats K``): where the passes land, how a server log is cut into
passes, and that fidelity takes the passes for repeats of one workload. No vLLM here; ``tests/test_record_vllm.py``
records passes with the real engine (``pytest -m vllm``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from twin.calibration import _vllm_common as common
from twin.calibration import _vllm_server as server
from twin.calibration.fidelity import workload_key
from twin.calibration.recorded import load_recorded_run
from twin.cli import main
from twin.commands.record import repeat_dir
from twin.paths import REPO_ROOT

RUN = REPO_ROOT / "tests" / "fixtures" / "recorded" / "server-poisson-low"


def _stand_in_recorder(monkeypatch: pytest.MonkeyPatch, seen: list) -> None:
    """``record_workload`` that keeps where it was asked to write and writes a committed run to each folder."""
    def record(spec, out, *, repeat_dirs=(), **kwargs):
        seen.append((spec.name, Path(out), [Path(p) for p in repeat_dirs]))
        for folder in [out, *repeat_dirs]:
            shutil.copytree(RUN, folder)
        return out

    monkeypatch.setattr("twin.calibration.record.record_workload", record)


def test_a_pass_lands_beside_the_folder_named() -> None:
    assert repeat_dir(Path("runs/r/bursty"), 2) == Path("runs/r/bursty-repeat2")
    assert repeat_dir(Path("runs/s/held-out"), 4) == Path("runs/s/held-out-repeat4")


def test_repeats_of_one_workload_and_of_a_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    seen: list = []
    _stand_in_recorder(monkeypatch, seen)
    assert main(["record", "--workload", "heldout-server-bursty", "--repeats", "3", "--out", str(tmp_path / "b")]) == 0
    assert seen == [("heldout-server-bursty", tmp_path / "b", [tmp_path / "b-repeat2", tmp_path / "b-repeat3"])]
    out = capsys.readouterr().out
    assert "through the same engine start" in out and out.count("server, 32 requests") == 3  # a summary per pass
    seen.clear()
    # a sweep: the one command's layout of held-out repeats, <out>-repeat<k>/<workload>
    assert main(["record", "--sweep", "held-out", "--repeats", "2", "--out", str(tmp_path / "held-out")]) == 0
    assert [(name, out, more) for name, out, more in seen] == [
        (name, tmp_path / "held-out" / name, [tmp_path / "held-out-repeat2" / name])
        for name in ("heldout-server-bursty", "heldout-server-prefix-mix", "heldout-offline-kv-prefix")]
    seen.clear()
    capsys.readouterr()
    assert main(["record", "--workload", "heldout-server-bursty", "--out", str(tmp_path / "one")]) == 0
    assert seen == [("heldout-server-bursty", tmp_path / "one", [])]  # the default: one pass, nothing beside it
    assert "through the same engine start" not in capsys.readouterr().out


@pytest.mark.parametrize("repeats", ["0", "-2"])
def test_no_pass_is_refused(repeats: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["record", "--workload", "heldout-server-bursty", "--repeats", repeats, "--out", str(tmp_path)]) == 2
    assert f"--repeats must be 1 or more, not {repeats}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_only_a_job_with_passes_marks_them() -> None:
    assert common.out_dirs({"out_dir": "/s/run"}) == ["/s/run"]
    assert common.out_dirs({"out_dir": "/s/run", "out_dirs": ["/s/run", "/s/run-2"]}) == ["/s/run", "/s/run-2"]
    assert common.engine_start_field(1, 1) == {}  # a run with its engine to itself: run.json as before
    assert common.engine_start_field(2, 3) == {"engine_start": {"pass": 2, "passes": 3}}


def _line(i: int, ctx_req: int, ctx_tok: int, gen: int, ms: float) -> str:
    return (f"(APIServer pid=1) INFO Engine 000: Iteration({i}): {ctx_req} context requests, {ctx_tok} context tokens, "
            f"{gen} generation requests, {gen} generation tokens, iteration elapsed time: {ms:.2f} ms, CPU KV cache "
            "usage: 1.0%\n")


def test_a_server_log_is_cut_into_its_passes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each pass's run gets the iteration lines logged between the offset taken just before its requests and the end
    of the pass (the last pass: to the end of the log), its warm-up steps those since the previous pass ended; the
    start-up lines serve every pass."""
    monkeypatch.setattr(common._md, "version", lambda name: "0.32.0+cpu")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(REPO_ROOT / "twin" / "calibration" / "models" / "cpu-tiny-llama" / "config.json", model)
    startup = "INFO Overriding num_gpu_blocks=0 with num_gpu_blocks_override=64\nmax_num_batched_tokens=512\n"
    pieces = [startup,
              _line(0, 1, 100, 0, 5.0),  # pass 1's warm-up
              _line(1, 2, 300, 0, 30.0), _line(2, 0, 0, 2, 10.0),  # pass 1's run
              "INFO Resetting prefix cache...\n", _line(3, 1, 90, 0, 4.0),  # pass 2's warm-up
              _line(4, 2, 300, 0, 31.0), _line(5, 0, 0, 2, 11.0), _line(6, 0, 0, 1, 9.0),  # pass 2's run
              "INFO Shutting down\n"]
    log = "".join(pieces)
    cut = [len("".join(pieces[:k]).encode()) for k in range(len(pieces) + 1)]
    engine = {"dtype": "bfloat16", "kv_cache_dtype": "auto", "max_num_batched_tokens": 512, "max_num_seqs": 8,
              "max_model_len": 512, "enable_chunked_prefill": True, "enable_prefix_caching": True}
    job = {"model_dir": str(model), "hardware": "cpu test", "workload": {"name": "w"}, "engine": engine}
    cache_info = {"block_size": "128", "num_gpu_blocks": "64", "enable_prefix_caching": "True"}
    passes = [{"warmup": {"decode_requests": 1, "prefill_prompt_tokens": []}, "probe": None, "before": {},
               "after": {"prompt_tokens": 600.0}, "cache_info": cache_info, "offset": offset, "end": end,
               "requests": [], "host_load": {"other_cores": 0.0}}
              for offset, end in ((cut[2], cut[4]), (cut[6], cut[9]))]
    for k, (rec, start, end) in enumerate([(passes[0], 0, passes[0]["end"]), (passes[1], passes[0]["end"], None)], 1):
        server._write_pass(job, ["--x"], engine, log, rec, start, end, {"pinned": False}, k, 2, str(tmp_path / f"p{k}"))
    runs = [json.loads((tmp_path / f"p{k}" / "run.json").read_text()) for k in (1, 2)]
    steps = [(tmp_path / f"p{k}" / "iterations.csv").read_text().splitlines()[1:] for k in (1, 2)]
    assert [len(s) for s in steps] == [2, 3]
    assert [s.split(",")[5] for s in steps[1]] == ["31.0", "11.0", "9.0"]
    assert [r["workload"]["warmup_steps"]["elapsed_ms"] for r in runs] == [[5.0], [4.0]]
    assert [r["workload"]["engine_start"] for r in runs] == [{"pass": 1, "passes": 2}, {"pass": 2, "passes": 2}]
    assert all(r["num_gpu_blocks"] == 64 and r["workload"]["num_gpu_blocks_source"].startswith("log") for r in runs)
    assert [r["metrics_delta"] for r in runs] == [{"prompt_tokens": 600}, {"prompt_tokens": 600}]


def test_passes_of_one_start_are_repeats_of_their_workload(tmp_path: Path) -> None:
    for k in (1, 2):
        shutil.copytree(RUN, tmp_path / f"p{k}")
        path = tmp_path / f"p{k}" / "run.json"
        run = json.loads(path.read_text())
        run["workload"] |= common.engine_start_field(k, 2)
        path.write_text(json.dumps(run))
    keys = {workload_key(load_recorded_run(tmp_path / f"p{k}")) for k in (1, 2)}
    assert keys == {workload_key(load_recorded_run(RUN))}
