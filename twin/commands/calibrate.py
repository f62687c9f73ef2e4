"""``twin calibrate RUN_DIR... [--name NAME] [--out FILE]``: fit an engine profile from recorded runs.

    twin calibrate tests/fixtures/calibration/cpu-tiny-llama/calibration/* --name cpu-tiny-llama --out p.yaml
    twin replay RUN_DIR --profile p.yaml        # the written file is a profile path anywhere --profile is taken
    twin calibrate --cross-validate RUN_DIR... [--first-step] [--json FILE]   # leave-one-run-out error table

``--prefill-per-request``, ``--first-step`` and ``--decode-{single-request,context-sq,batch-change}`` add optional
model terms, ``--run-levels`` fits them with a speed level per run (twin.calibration.calibrate.FitOptions);
``--cross-validate`` writes no profile: it fits once per run, leaving that run out, replays the run left out and
prints the error table and total (twin.calibration.crossval), so an option can be judged on runs the fit did not see.

Each offline run is replayed with its recorded step times; runs whose step composition the twin does not
reproduce are refused (named on stderr) and the fit uses the rest. Server-mode runs fit the profile's
``server`` section (API front end and server step time; twin.calibration.server) and nothing else. Exit 0 with a profile written, 2 on bad input or
when no run can be used.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", help="recorded run folders (run.json, requests.jsonl, iterations.csv)")
    p.add_argument("--name", default=None, help="profile name (default: the --out file stem, else 'calibrated')")
    p.add_argument("--out", type=Path, default=None, help="profile YAML to write (default: <name>.yaml)")
    p.add_argument("--date", default=None, help="provenance generated_on (YYYY-MM-DD; default today, UTC)")
    p.add_argument("--prefill-per-request", action="store_true",
                   help="fit a per-request term in the prefill regime (off by default; docs/calibration.md)")
    p.add_argument("--idle-wake", action="store_true",
                   help="fit the server section's extra time of the first step after the engine sat idle, applied by "
                        "replays of server runs (off by default)")
    p.add_argument("--intake-step", action="store_true",
                   help="fit the engine's own step time per request sent while a step runs (the API server's intake "
                        "on the cores the engine shares), applied by replays with the profile's step times (off by "
                        "default; docs/calibration.md)")
    p.add_argument("--first-step", action="store_true",
                   help="fit the extra time of a run's first step, applied by replays (off by default)")
    p.add_argument("--decode-single-request", action="store_true",
                   help="fit an extra decode-step time when exactly one request decodes (off by default)")
    p.add_argument("--decode-floor", action="store_true",
                   help="fit a batch floor in the decode regime: a decode step of fewer requests costs what one of "
                        "the fitted floor does (off by default; docs/calibration.md)")
    p.add_argument("--decode-context-sq", action="store_true",
                   help="fit a decode term in context tokens squared per request (off by default)")
    p.add_argument("--decode-batch-change", action="store_true",
                   help="fit the extra time of a decode step with fewer requests than the decode step before it, "
                        "applied by replays (off by default)")
    p.add_argument("--run-levels", action="store_true",
                   help="fit the coefficients with a speed level per run, so the host's drift between runs is not "
                        "read as a step-shape term (off by default; docs/calibration.md)")
    p.add_argument("--server-scaled-offline", action="store_true",
                   help="the server section's step time as the offline fit's terms times one fitted factor, not "
                        "regimes of its own (off by default; docs/calibration.md)")
    p.add_argument("--server-offline-attention", action="store_true",
                   help="the server section's attention term (per_attention_pair_s) from the offline fit, scaled by "
                        "the server runs' speed; the other server terms fitted as before (off by default; "
                        "docs/calibration.md)")
    p.add_argument("--server-offline-context", action="store_true",
                   help="the server section's decode context term (per_context_token_s) from the offline fit, scaled "
                        "by the server runs' speed on their decode steps; the other server terms fitted as before "
                        "(off by default; docs/calibration.md)")
    p.add_argument("--server-shared-context", action="store_true",
                   help="the server section's decode shared_context_fraction (what a context token another decode "
                        "request of the step reads too costs), fitted on the server runs whose decode steps read "
                        "shared prefixes; those runs are kept out of the other server terms (off by default; "
                        "docs/calibration.md)")
    p.add_argument("--stream-ends", action="store_true",
                   help="fit the server front end's time per stream opened and closed in a step (a request's first "
                        "and last chunk), applied by replays of server runs (off by default; docs/calibration.md)")
    p.add_argument("--intake", action="store_true",
                   help="fit the server front end's time per request sent while a step runs (the API server taking "
                        "it in), applied by replays of server runs (off by default; docs/calibration.md)")
    p.add_argument("--cross-validate", action="store_true",
                   help="write no profile: leave each run out of the fit in turn and print the error on it")
    p.add_argument("--noise", action=argparse.BooleanOptionalAction, default=None,
                   help="with --cross-validate: replays draw step times from the fitted step_time_noise "
                        "(default: on, as twin fidelity)")
    p.add_argument("--seeds", type=int, default=None,
                   help="with --cross-validate and noise: noise draws per left-out run, totals over all (default 1)")
    p.add_argument("--json", type=Path, default=None, help="with --cross-validate: also write the report as JSON")


def _label(path: Path) -> str:
    """A run folder as written in the provenance: relative to the repository, else to the current folder,
    else its name (tracked files never hold absolute paths)."""
    from twin.paths import REPO_ROOT

    for base in (REPO_ROOT, Path.cwd()):
        try:
            return str(path.resolve().relative_to(base.resolve()))
        except ValueError:
            continue
    return path.name


def _decode_terms(d: object) -> str:
    """The optional decode terms of a ``DecodeCoefficients`` that are set, as printed after the linear ones."""
    parts = [(d.floor_requests, lambda v: f" (requests counted as at least {v})"),  # type: ignore[attr-defined]
             (d.single_request_s, lambda v: f" + {v * 1e3:.3f} ms if 1 req"),  # type: ignore[attr-defined]
             (d.per_context_token_sq_s, lambda v: f" + {v * 1e12:.4f} ps*ctx^2/req"),  # type: ignore[attr-defined]
             (d.batch_change_s, lambda v: f" + {v * 1e3:.3f} ms if the batch shrank")]  # type: ignore[attr-defined]
    return "".join(f(v) for v, f in parts if v)


def _cross_validate(args: argparse.Namespace, options: object) -> int:
    from twin.calibration.calibrate import CalibrationError
    from twin.calibration.crossval import cross_validate, format_cv_table
    from twin.calibration.recorded import RecordedRunError
    from twin.commands._report import print_report

    return print_report("calibrate", lambda: cross_validate(args.run_dirs, options=options,  # type: ignore[arg-type]
                                                            noise=args.noise, seeds=args.seeds or 1),
                        format_cv_table, args.json, (CalibrationError, RecordedRunError, ValueError, OSError))


def run(args: argparse.Namespace) -> int:
    from twin.calibration.calibrate import CalibrationError, FitOptions, calibrate
    from twin.calibration.recorded import RecordedRunError
    from twin.engine_profiles.derive import write_spec

    options = FitOptions(prefill_per_request=args.prefill_per_request, first_step=args.first_step,
                         decode_single_request=args.decode_single_request, decode_context_sq=args.decode_context_sq,
                         decode_batch_change=args.decode_batch_change, run_levels=args.run_levels,
                         server_scaled_offline=args.server_scaled_offline, idle_wake=args.idle_wake,
                         server_offline_attention=args.server_offline_attention, stream_ends=args.stream_ends,
                         intake=args.intake, intake_step=args.intake_step, decode_floor=args.decode_floor,
                         server_offline_context=args.server_offline_context,
                         server_shared_context=args.server_shared_context)
    if args.cross_validate:
        if args.out is not None or args.name is not None:
            print("twin calibrate: --cross-validate writes no profile (drop --out / --name)", file=sys.stderr)
            return 2
        return _cross_validate(args, options)
    if args.json is not None or args.noise is not None or args.seeds is not None:
        print("twin calibrate: --json, --noise and --seeds go with --cross-validate", file=sys.stderr)
        return 2
    name = args.name or (args.out.stem if args.out else "calibrated")
    out = args.out or Path(f"{name}.yaml")
    labels = [_label(Path(d)) for d in args.run_dirs]
    command = ("twin calibrate " + " ".join(shlex.quote(x) for x in labels) + f" --name {shlex.quote(name)}"
               + (" --prefill-per-request" if options.prefill_per_request else "")
               + (" --first-step" if options.first_step else "")
               + (" --decode-single-request" if options.decode_single_request else "")
               + (" --decode-context-sq" if options.decode_context_sq else "")
               + (" --decode-batch-change" if options.decode_batch_change else "")
               + (" --run-levels" if options.run_levels else "")
               + (" --server-scaled-offline" if options.server_scaled_offline else "")
               + (" --idle-wake" if options.idle_wake else "")
               + (" --server-offline-attention" if options.server_offline_attention else "")
               + (" --stream-ends" if options.stream_ends else "")
               + (" --intake" if options.intake else "")
               + (" --intake-step" if options.intake_step else "")
               + (" --decode-floor" if options.decode_floor else "")
               + (" --server-offline-context" if options.server_offline_context else "")
               + (" --server-shared-context" if options.server_shared_context else ""))
    try:
        result = calibrate(args.run_dirs, name=name, command=command, generated_on=args.date, source_label=_label,
                           options=options)
    except (CalibrationError, RecordedRunError, OSError) as exc:
        print(f"twin calibrate: {exc}", file=sys.stderr)
        return 2
    for why in result.refused:
        print(f"twin calibrate: refused {why}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_spec(result.spec, out)
    st, fq = result.spec.step_time, result.spec.fit_quality
    assert st is not None and fq is not None
    print(f"wrote {out} (profile {name!r}) from {len(result.used)} runs, {len(result.refused)} refused")
    print(f"  overhead_s        {st.overhead_s * 1e3:.3f} ms/step ({result.overhead_samples_s.size} samples)")
    d, pf = st.decode, st.prefill
    print(f"  decode  (n={fq.decode.num_samples:>5})  base {d.base_s * 1e3:.3f} ms + {d.per_request_s * 1e6:.2f} us/req"
          f" + {d.per_context_token_s * 1e9:.2f} ns/ctx tok" + _decode_terms(d) + ";"
          f" mean |rel err| {fq.decode.mean_abs_rel_error:.1%}, max {fq.decode.max_abs_rel_error:.1%}")
    print(f"  prefill (n={fq.prefill.num_samples:>5})  base {pf.base_s * 1e3:.3f} ms + {pf.per_token_s * 1e6:.2f} us/tok"
          f" + {pf.per_attention_pair_s * 1e9:.3f} ns/pair + {pf.per_decode_context_token_s * 1e9:.2f} ns/ctx tok"
          + (f" + {pf.per_request_s * 1e6:.2f} us/req" if options.prefill_per_request else "") + ";"
          f" mean |rel err| {fq.prefill.mean_abs_rel_error:.1%}, max {fq.prefill.max_abs_rel_error:.1%}")
    if options.first_step:
        print(f"  first step        +{st.first_step_s * 1e3:.3f} ms (replays only)"
              + ("" if result.spec.server is None else
                 f"; server +{result.spec.server.step_time.first_step_s * 1e3:.3f} ms"))
    sv = result.spec.server
    if sv is None:
        print("  server            none (no server-mode run given: server replays use the offline step time, no front end)")
        return 0
    sd, sp, sq = sv.step_time.decode, sv.step_time.prefill, sv.fit_quality
    print(f"  server front end  arrival {sv.arrival_s * 1e3:.1f} ms; per step {sv.step_time.overhead_s * 1e3:.3f} ms"
          f" + {sv.per_chunk_s * 1e3:.3f} ms per streamed chunk "
          f"({_runs(len(sv.provenance.sources) - len(result.shared_context_runs))})")
    if options.server_shared_context and result.shared_context_runs:
        print(f"  server shared     a decode context token another request of the step reads too costs "
              f"{sv.step_time.decode.shared_context_fraction:.2f} of one (fitted on "
              f"{_runs(len(result.shared_context_runs))} that share prefixes; replays only)")
    elif options.server_shared_context:
        print("  server shared     not fitted: no server run given reads a shared prefix in its decode steps")
    if options.stream_ends:
        print(f"  server streams    +{sv.per_first_chunk_s * 1e3:.3f} ms per stream opened, "
              f"+{sv.per_last_chunk_s * 1e3:.3f} ms per stream closed in a step (replays only)")
    if options.intake:
        print(f"  server intake     +{sv.per_request_in_s * 1e3:.3f} ms per request sent while a step runs"
              " (replays only)")
    if options.intake_step:
        print(f"  server intake step +{sv.per_request_in_step_s * 1e3:.3f} ms of engine time per request sent while a "
              "step runs (profile replays only)")
    if options.idle_wake:
        print(f"  server idle wake  +{sv.idle_wake_s * 1e3:.3f} ms on the first step after the engine sat idle"
              " (replays only)")
    print(f"  server decode  (n={sq.decode.num_samples:>5})  base {sd.base_s * 1e3:.3f} ms + {sd.per_request_s * 1e6:.2f} us/req"
          f" + {sd.per_context_token_s * 1e9:.2f} ns/ctx tok" + _decode_terms(sd) + ";"
          f" mean |rel err| {sq.decode.mean_abs_rel_error:.1%}, max {sq.decode.max_abs_rel_error:.1%}")
    print(f"  server prefill (n={sq.prefill.num_samples:>5})  base {sp.base_s * 1e3:.3f} ms + {sp.per_token_s * 1e6:.2f} us/tok"
          f" + {sp.per_attention_pair_s * 1e9:.3f} ns/pair + {sp.per_decode_context_token_s * 1e9:.2f} ns/ctx tok;"
          f" mean |rel err| {sq.prefill.mean_abs_rel_error:.1%}, max {sq.prefill.max_abs_rel_error:.1%}")
    return 0


def _runs(n: int) -> str:
    return f"{n} server run" + ("" if n == 1 else "s")
