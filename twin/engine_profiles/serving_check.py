"""A shipped GPU profile through the whole engine against measured vLLM serving points.

``silicon_sample.csv`` (`../shared/calibration/raw/aiconfigurator/systems/`) holds vLLM serving benchmarks: a client
keeps ``concurrency`` streams open (`vllm bench serve --max-concurrency C`), every prompt ``isl`` tokens and every
answer ``osl``, and reports the mean TTFT and TPOT. The profile's own checks (``derive``) compare TPOT with a formula
for the closed loop's mean step; this runs the loop itself on one simulated replica (the engine, its KV blocks, its
batching), with synchronous and asynchronous scheduling side by side, so the TPOT check covers the scheduler too and
TTFT can be looked at.

What the file does not say, and the loop has to assume (each an option): how many prompts the client sent
(``prompts_per_stream`` × concurrency), whether the first wave, sent at once, counts in the means
(``keep_first_wave``), and how far the answers' lengths spread (``osl_jitter``: a fraction drawn uniformly either
side of ``osl``). With every answer exactly ``osl`` long the streams finish together and their successors are
prefilled together, every wave; the measured low-concurrency TTFTs (one prompt's prefill and a step or so) say the
real streams did not move in lockstep. TPOT hardly depends on these choices; TTFT depends on all of them
(docs/profiles.md, "Serving points through the engine").

    python -m twin.engine_profiles.serving_check                       # Llama-3.1-70B FP8, H100, TP4: 15 points
    python -m twin.engine_profiles.serving_check --osl-jitter 0.3 --keep-first-wave --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import simpy

from twin.engine_profiles import derive_num_gpu_blocks, load_profile
from twin.engine_profiles.checks import SiliconPoint, silicon_points
from twin.engine_settings import EngineSettings
from twin.models.engine import Engine
from twin.models.recorder import Recorder
from twin.models.replica import Replica
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq, pieces_from_ids
from twin.paths import shared_dir
from twin.results import write_text_atomic
from twin.rng import stream
from twin.runner import engine_config


@dataclass(frozen=True)
class LoopResult:
    ttft_s: float  # mean over the requests counted
    tpot_s: float  # mean of each request's (last token - first token) / (tokens - 1)
    requests: int  # counted


def closed_loop(profile: str, *, concurrency: int, isl: int, osl: int, async_scheduling: bool,
                prompts_per_stream: int = 8, osl_jitter: float = 0.1, stagger_s: float = 0.001,
                keep_first_wave: bool = False, seed: int = 0) -> LoopResult:
    """``concurrency`` streams on one replica of ``profile``: the client opens them ``stagger_s`` apart, and sends
    the next prompt (unique tokens, no prefix hits) as soon as a stream's answer ends, until
    ``prompts_per_stream × concurrency`` were sent. The first wave (the first ``concurrency`` to finish) is left out
    of the means unless ``keep_first_wave``."""
    prof = load_profile(profile)
    es = EngineSettings(max_model_len=isl + int(osl * (1 + osl_jitter)) + 16, async_scheduling=async_scheduling)
    blocks = derive_num_gpu_blocks(prof, block_size=es.block_size, gpu_memory_utilization=es.gpu_memory_utilization,
                                   max_num_batched_tokens=es.max_num_batched_tokens)
    env = simpy.Environment()
    rng = stream(seed, 0, "serving_check.lengths")
    total = prompts_per_stream * concurrency
    sent: list[EngineRequest] = []
    done: list[EngineRequest] = []

    def submit() -> None:
        i = len(sent)
        n_out = max(2, int(round(osl * (1.0 + osl_jitter * (2.0 * rng.random() - 1.0)))))
        ids = list(range(i * (isl + 1) + 1, i * (isl + 1) + 1 + isl))  # unique per request
        r = EngineRequest(request_id=f"r{i}", arrival_s=env.now, max_tokens=n_out, target_output_tokens=n_out,
                          seq=TokenSeq(pieces_from_ids(ids), block_size=es.block_size, output_segment=i),
                          record_token_times=True)
        sent.append(r)
        replica.submit(r)

    def finished(r: EngineRequest) -> None:
        done.append(r)
        if len(sent) < total:
            submit()

    replica = Replica(env, scope="replica", engine=Engine(engine_config(es, blocks, gpu=prof.on_gpu)),
                      step_model=prof.step_time_model(), recorder=Recorder(), on_finished=finished)

    def open_streams():
        for _ in range(concurrency):
            submit()
            yield env.timeout(stagger_s)

    replica.start()
    env.process(open_streams())
    env.run()
    counted = done if keep_first_wave else done[concurrency:]
    ttft = [r.token_times[0] - r.arrival_s for r in counted if r.token_times]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in counted
            if r.token_times and len(r.token_times) > 1]
    return LoopResult(ttft_s=float(np.mean(ttft)), tpot_s=float(np.mean(tpot)), requests=len(counted))


@dataclass(frozen=True)
class PointCheck:
    point: SiliconPoint
    sync: LoopResult
    asynchronous: LoopResult


def check_points(profile: str, points: list[SiliconPoint], **loop: object) -> list[PointCheck]:
    return [PointCheck(p, *(closed_loop(profile, concurrency=p.concurrency, isl=p.isl, osl=p.osl,
                                         async_scheduling=a, **loop) for a in (False, True)))  # type: ignore[arg-type]
            for p in points]


def _err(twin: float, real: float | None) -> float | None:
    return None if not real else twin / real - 1.0


def format_checks(profile: str, checks: list[PointCheck]) -> str:
    lines = [f"{profile}: closed loops on one simulated replica against measured vLLM serving means",
             f"{'ISL':>6}{'OSL':>6}{'C':>4} | {'TPOT ms':>8}{'sync':>8}{'err':>7}{'async':>8}{'err':>7} | "
             f"{'TTFT ms':>8}{'sync':>8}{'err':>7}{'async':>8}{'err':>7}"]

    def cell(x: float, real: float | None) -> str:
        e = _err(x, real)
        return f"{x * 1e3:>8.1f}" + (f"{e:>+7.0%}" if e is not None else f"{'n/a':>7}")

    errs: dict[str, list[float]] = {"tpot sync": [], "tpot async": [], "ttft sync": [], "ttft async": []}
    for c in checks:
        p = c.point
        lines.append(f"{p.isl:>6}{p.osl:>6}{p.concurrency:>4} | {p.tpot_s * 1e3:>8.2f}{cell(c.sync.tpot_s, p.tpot_s)}"
                     f"{cell(c.asynchronous.tpot_s, p.tpot_s)} | "
                     + (f"{p.ttft_s * 1e3:>8.1f}" if p.ttft_s else f"{'n/a':>8}")
                     + f"{cell(c.sync.ttft_s, p.ttft_s)}{cell(c.asynchronous.ttft_s, p.ttft_s)}")
        for key, x, real in (("tpot sync", c.sync.tpot_s, p.tpot_s), ("tpot async", c.asynchronous.tpot_s, p.tpot_s),
                             ("ttft sync", c.sync.ttft_s, p.ttft_s), ("ttft async", c.asynchronous.ttft_s, p.ttft_s)):
            e = _err(x, real)
            if e is not None:
                errs[key].append(e)
    lines.append("")
    for key, v in errs.items():
        if v:
            lines.append(f"{key:>10}: mean error {np.mean(v):+.1%}, mean |error| {np.mean(np.abs(v)):.1%}, "
                         f"worst {max(v, key=abs):+.1%} ({len(v)} points)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m twin.engine_profiles.serving_check",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--profile", default="llama3-70b-fp8-tp4-h100")
    ap.add_argument("--model-path", default="meta-llama/Llama-3.1-70B", help="silicon_sample.csv's model_path")
    ap.add_argument("--system", default="h100_sxm")
    ap.add_argument("--precision", default="fp8")
    ap.add_argument("--tp", type=int, default=None, help="the points of this TP (default: the profile's)")
    ap.add_argument("--prompts-per-stream", type=int, default=8)
    ap.add_argument("--osl-jitter", type=float, default=0.1)
    ap.add_argument("--stagger-s", type=float, default=0.001)
    ap.add_argument("--keep-first-wave", action="store_true")
    ap.add_argument("--max-osl", type=int, default=None, help="leave out points with longer answers (faster)")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    tp = args.tp or load_profile(args.profile).tp
    try:
        measured = silicon_points(shared_dir(), model_path=args.model_path, system=args.system,
                                  precision=args.precision)
    except FileNotFoundError as exc:
        print(f"serving_check: the measured points are read from ../shared (or $TWIN_SHARED): {exc}", file=sys.stderr)
        return 2
    points = [p for p in measured if p.tp == tp and (args.max_osl is None or p.osl <= args.max_osl)]
    if not points:
        print(f"serving_check: no {args.model_path} {args.precision} point on {args.system} at TP {tp}",
              file=sys.stderr)
        return 2
    checks = check_points(args.profile, points, prompts_per_stream=args.prompts_per_stream,
                          osl_jitter=args.osl_jitter, stagger_s=args.stagger_s, keep_first_wave=args.keep_first_wave)
    print(format_checks(args.profile, checks))
    if args.json:
        write_text_atomic(Path(args.json), json.dumps([{"point": asdict(c.point), "sync": asdict(c.sync),
                                                "async": asdict(c.asynchronous)} for c in checks], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
