"""``twin replay RUN_DIR [--profile P] [--step-times profile|recorded] [--out DIR]``."""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

import pyarrow as pa

from twin.results import dumps, write_outputs

ITER_COLUMNS = ("step", "ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens", "elapsed_ms", "kv_usage_pct")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a recorded run folder (run.json, requests.jsonl, iterations.csv)")
    p.add_argument("--profile", default=None, help="engine profile name or YAML path for step times")
    p.add_argument("--step-times", choices=("profile", "recorded"), default=None,
                   help="'recorded': each step takes the recorded iteration time (+ the profile's overhead); "
                        "default: 'profile' when --profile is given, else 'recorded'")
    p.add_argument("--noise", action=argparse.BooleanOptionalAction, default=None,
                   help="draw each profile step time from the profile's fitted step_time_noise "
                        "(default: on when the profile has that table; --no-noise: deterministic; docs/calibration.md)")
    p.add_argument("--out", default=None, help="output folder (default: runs/replay-<run>)")
    p.add_argument("--json", action="store_true", help="print comparison.json instead of the table")


def iterations_csv(table: pa.Table) -> str:
    d = table.to_pydict()
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(ITER_COLUMNS)
    for i in range(table.num_rows):
        w.writerow([d["step"][i], d["ctx_requests"][i], d["ctx_tokens"][i], d["gen_requests"][i], d["gen_tokens"][i],
                    f"{d['elapsed_ms'][i]:.3f}", f"{d['kv_usage_pct'][i]:.2f}"])
    return buf.getvalue()


def format_comparison(c: dict) -> str:
    from twin.replay import format_step_timing, run_label

    lines = [f"replay of {c['run']} ({run_label(c)})"]
    if "steps" in c:
        comp = c["composition"]
        lines.append(f"  steps                  real {c['steps']['real']:>8}  twin {c['steps']['twin']:>8}  "
                     f"{'match' if c['steps']['match'] else 'DIFFER'}")
        lines.append(f"  step composition       {'identical' if comp['match'] else 'first differs at step ' + str(comp['first_mismatch_step']) + ': real ' + str(comp['real_at_mismatch']) + ' twin ' + str(comp['twin_at_mismatch'])}")
    for key in ("preemptions", "prefix_cache_hits"):
        item = c[key]
        verdict = "n/a" if item["match"] is None else ("match" if item["match"] else "DIFFER")
        lines.append(f"  {key:<22} real {str(item['real']):>8}  twin {item['twin']:>8}  {verdict}")
    n = c["num_cached_tokens"]
    lines.append(f"  per-request cached     {n['match']}/{n['compared']} requests match")
    lines.append("")
    lines.append(f"  {'latency':<8}{'pct':>6}{'real (ms)':>12}{'twin (ms)':>12}{'error':>9}")
    for key, d in c["latency"].items():
        for p in ("p50", "p90", "p99"):
            r, t, e = d[p]["real"], d[p]["twin"], d[p]["rel_error"]
            fmt = lambda x: "n/a" if x is None or x != x else f"{x * 1000:.2f}"  # noqa: E731
            lines.append(f"  {key:<8}{p:>6}{fmt(r):>12}{fmt(t):>12}{'' if e is None else f'{e:+.1%}':>9}")
    if "step_time_sum_s" in c:
        s = c["step_time_sum_s"]
        err = "" if s["rel_error"] is None else f"{s['rel_error']:+.1%}"
        lines.append(f"  step-time sum (s)   real {s['real']:.3f}  twin {s['twin']:.3f}  {err}")
    timing_line = format_step_timing(c.get("recorded_step_times") or {})
    if timing_line is not None:
        lines.append("  " + timing_line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from twin.calibration.recorded import RecordedRunError, load_recorded_run
    from twin.replay import compare, recorded_step_timing, replay, server_front_end
    from twin.scenario import ScenarioError

    try:
        rec = load_recorded_run(args.run_dir)
    except (RecordedRunError, OSError) as exc:
        print(f"twin replay: {exc}", file=sys.stderr)
        return 2
    mode = args.step_times or ("profile" if args.profile else "recorded")
    try:
        result = replay(rec, profile=args.profile, step_times=mode, noise=args.noise)
    except (ScenarioError, ValueError) as exc:
        print(f"twin replay: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("runs") / f"replay-{rec.path.name}"
    if not result.ok:
        write_outputs(out, tables={}, files={"manifest.json": dumps(result.manifest)})
        print(f"twin replay: the replay failed: {result.manifest['exception']}", file=sys.stderr)
        return 1
    comparison = compare(rec, result, server=server_front_end(rec, args.profile))
    comparison["step_times"] = mode
    if mode == "recorded":
        comparison["recorded_step_times"] = recorded_step_timing(result)
    comparison["profile"] = args.profile
    req = result.tables["requests"].select(["request_id", "arrival_s", "ttft_s", "e2e_s", "output_tokens",
                                            "num_cached_tokens", "preemptions", "token_times_s"])
    write_outputs(out, tables={"requests": req, "events": result.tables["events"]},
                  files={"iterations.csv": iterations_csv(result.tables["iterations"]),
                         "comparison.json": dumps(comparison), "manifest.json": dumps(result.manifest),
                         "summary.json": dumps(result.summary)})
    print(dumps(comparison) if args.json else format_comparison(comparison))
    return 0
