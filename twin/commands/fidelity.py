"""``twin fidelity --profile P RUN_DIR... [--json FILE] [--steps] [--host-witness]``: the twin's error on recorded runs,
by item.

``twin fidelity --sessions SESSION_DIR... [--profile P]``: many calibration sessions (the folders
``scripts/calibrate-cpu.sh`` writes) at once: each one's held-out runs with its own profile (or all with ``P``), a
line per session, and the latency items' error by workload over all of them (``twin.calibration.sessions``).

``--steps`` prints instead where the profile's step-time model is off, regime by regime (recorded step time over
the model's, binned by decode batch, prompt tokens, prefill requests, attention context, idle wakes:
``twin.calibration.residuals``); it replays nothing but the offline runs' recorded steps, so it takes seconds.

A report, not a gate: exit 0 even when items fail or bins are biased; 2 on bad input (a missing or malformed run
folder, an unknown profile or one without step-time coefficients).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", help="recorded run folders (with --sessions: session folders)")
    p.add_argument("--profile", default=None,
                   help="engine profile name or YAML path (gives step times only); required but with --sessions, "
                        "where it replaces each session's own profile")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON to this file")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="default relative tolerance of the timing items (default 0.10)")
    p.add_argument("--noise", action=argparse.BooleanOptionalAction, default=None,
                   help="profile replays draw each step's time from the profile's fitted step_time_noise "
                        "(default: on when the profile has that table; --no-noise: deterministic; docs/calibration.md)")
    p.add_argument("--draws", type=int, default=None,
                   help="with noise: replay each run with this many noise draws and judge their median "
                        "(default 1: one draw, the table as before; with --sessions 9, as the one command)")
    p.add_argument("--host-witness", action="store_true",
                   help="scale each profile replay's model time by the level the profile's host_witness term predicts "
                        "from the run's own host witness (runs and profiles recorded and fitted since 2026-12-08; "
                        "docs/calibration.md, \"The host witness in the replay\")")
    p.add_argument("--sessions", action="store_true",
                   help="the folders are calibration sessions (a profile *.yaml and held-out*/<workload>/ runs, as "
                        "scripts/calibrate-cpu.sh writes them): each one's held-out runs with its own profile, a line "
                        "per session and the latency items' error by workload over all of them")
    p.add_argument("--steps", action="store_true",
                   help="instead of the error table: the step-time model's residuals by regime (recorded / model "
                        "step time per bin, flagged where the median's 95%% interval is outside 1 +- --bias)")
    p.add_argument("--bias", type=float, default=0.05,
                   help="with --steps: the relative bias a bin's median must clearly exceed to be flagged "
                        "(default 0.05)")


def run(args: argparse.Namespace) -> int:
    from twin.calibration.fidelity import fidelity, format_table
    from twin.calibration.recorded import RecordedRunError
    from twin.commands._report import print_report
    from twin.engine_profiles import UnknownProfileError

    if not 0 < args.tolerance < 10:
        print("twin fidelity: --tolerance must be a positive fraction", file=sys.stderr)
        return 2
    if args.host_witness and (args.sessions or args.steps):
        print("twin fidelity: --host-witness goes with a plain table, not --sessions or --steps", file=sys.stderr)
        return 2
    if args.sessions:
        from twin.calibration.sessions import format_sessions, sessions_report

        if args.steps:
            print("twin fidelity: --sessions and --steps do not go together", file=sys.stderr)
            return 2
        return print_report("fidelity", lambda: sessions_report(args.run_dirs, profile=args.profile,
                                                                draws=9 if args.draws is None else args.draws,
                                                                tolerance=args.tolerance, noise=args.noise),
                            format_sessions, args.json, (RecordedRunError, UnknownProfileError, ValueError, OSError))
    if args.profile is None:
        print("twin fidelity: --profile is required (but with --sessions)", file=sys.stderr)
        return 2
    if args.steps:
        from twin.calibration.residuals import format_residuals, step_residuals

        return print_report("fidelity", lambda: step_residuals(args.run_dirs, profile=args.profile, bias=args.bias),
                            format_residuals, args.json, (RecordedRunError, UnknownProfileError, ValueError, OSError))
    return print_report("fidelity", lambda: fidelity(args.run_dirs, profile=args.profile, tolerance=args.tolerance,
                                                     noise=args.noise, draws=1 if args.draws is None else args.draws,
                                                     host_witness=args.host_witness),
                        format_table, args.json, (RecordedRunError, UnknownProfileError, ValueError, OSError))
