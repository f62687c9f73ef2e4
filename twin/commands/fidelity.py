"""``twin fidelity --profile P RUN_DIR... [--json FILE] [--steps]``: the twin's error on recorded runs, by item.

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
    p.add_argument("run_dirs", nargs="+", help="recorded run folders")
    p.add_argument("--profile", required=True, help="engine profile name or YAML path (gives step times only)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON to this file")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="default relative tolerance of the timing items (default 0.10)")
    p.add_argument("--noise", action=argparse.BooleanOptionalAction, default=None,
                   help="profile replays draw each step's time from the profile's fitted step_time_noise "
                        "(default: on when the profile has that table; --no-noise: deterministic; docs/calibration.md)")
    p.add_argument("--draws", type=int, default=1,
                   help="with noise: replay each run with this many noise draws and judge their median "
                        "(default 1: one draw, the table as before)")
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

    if args.steps:
        from twin.calibration.residuals import format_residuals, step_residuals

        return print_report("fidelity", lambda: step_residuals(args.run_dirs, profile=args.profile, bias=args.bias),
                            format_residuals, args.json, (RecordedRunError, UnknownProfileError, ValueError, OSError))
    if not 0 < args.tolerance < 10:
        print("twin fidelity: --tolerance must be a positive fraction", file=sys.stderr)
        return 2
    return print_report("fidelity", lambda: fidelity(args.run_dirs, profile=args.profile, tolerance=args.tolerance,
                                                     noise=args.noise, draws=args.draws),
                        format_table, args.json, (RecordedRunError, UnknownProfileError, ValueError, OSError))
