"""twin's command line: a thin table of subcommands, each in ``twin/commands/<name>.py``.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only
when their command runs, so ``twin --help`` stays fast and optional extras stay optional.

Exit codes: 0 success, 1 a run failed (its manifest is still written), 2 bad input (a clear message on
stderr naming the field, nothing written).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Adding a command touches this table and its own module only.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("twin.commands.run", "run a scenario and write its tables, manifest and summary"),
    "validate": ("twin.commands.validate", "check scenario files without running them"),
    "replay": ("twin.commands.replay", "replay a recorded real-engine run on one simulated replica"),
    "drill": ("twin.commands.drill", "run an on-call drill (region loss) and print its timeline"),
    "n-minus-1": ("twin.commands.nminus1", "N-1 planning check: the largest share of peak at which losing a region holds"),
    "record": ("twin.commands.record", "record real vLLM runs (CPU, dummy weights) as recorded-run folders"),
    "calibrate": ("twin.commands.calibrate", "fit an engine profile's step times from recorded real-engine runs"),
    "fidelity": ("twin.commands.fidelity", "the twin's error on recorded runs, item by item, with tolerances"),
    "capacity": ("twin.commands.capacity", "back-of-envelope fleet size and cost from the capacity model"),
    "emulate": ("twin.commands.emulate", "serve one emulated replica (twin engine + profile) with an OpenAI API"),
    "router": ("twin.commands.router", "OpenAI-compatible router over vLLM servers using a twin routing policy"),
    "report": ("twin.commands.report", "write a self-contained HTML report (charts, key tables) of a run folder"),
    "sweep": ("twin.commands.sweep", "run scenarios x policies x seeds (local processes or dask), one folder per run"),
    "results": ("twin.commands.results", "query a sweep folder with SQL (DuckDB) or summarise it across seeds"),
    "check": ("twin.commands.check", "CI policy gate: a small fleet suite per router vs committed baselines"),
    "dashboard": ("twin.commands.dashboard", "serve the what-if dashboard (Streamlit) on a loopback port"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twin", description="A digital twin of an LLM chat-serving fleet.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in COMMANDS:
        parser = build_parser()
        if argv and argv[0] not in {"-h", "--help"}:
            parser.print_usage(sys.stderr)
            print(f"twin: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"twin {name}", description=help_text)
    module.add_arguments(parser)
    try:
        args = parser.parse_args(rest)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    return int(module.run(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
