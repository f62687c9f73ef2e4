"""``twin run SCENARIO [--seed N] [--out DIR] [--set key=value]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from twin.results import dumps, write_outputs
from twin.scenario import ScenarioError, load_scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="scenario YAML file")
    p.add_argument("--seed", type=int, default=None, help="root seed (default: the scenario's)")
    p.add_argument("--replication", type=int, default=0, help="replication index (independent streams)")
    p.add_argument("--out", default=None, help="output folder (default: runs/<scenario>-seed<N>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario field by dotted path, e.g. workload.num_requests=200")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.add_argument("--report", action="store_true",
                   help="also write report.html and report.md into the output folder and print the tier tables "
                        "(needs the 'report' extra for the HTML)")
    p.add_argument("--baseline", default=None, metavar="RUN_DIR", help="compare the report with this earlier run")


def format_summary(summary: dict, *, title: str) -> str:
    """A readable table of the summary."""
    lines = [title, "=" * len(title)]
    req = summary["requests"]
    lines.append("requests: " + ", ".join(f"{k} {v}" for k, v in req.items() if v or k in ("arrived", "completed")))
    for k, v in summary.get("outcomes_by_reason", {}).items():
        lines.append(f"  {k:<30} {v}")
    lines.append("")
    lines.append(f"{'latency (s)':<12}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}{'mean':>10}")
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "queue_s"):
        d = summary[key]
        cells = "".join(f"{(d[c] if d[c] == d[c] else float('nan')):>10.4f}" for c in ("p50", "p90", "p95", "p99", "mean"))
        lines.append(f"{key:<12}{cells}")
    lines.append("")
    rows = [
        ("output tokens/s", f"{summary['output_tokens_per_s']:.1f}"),
        ("goodput (req/s)", f"{summary['goodput_rps']:.3f}"),
        ("SLO attainment", f"{summary['slo_attainment']:.3f}  (TTFT <= {summary['slo']['ttft_s']} s, "
                           f"TPOT <= {summary['slo']['itl_s']} s)"),
        ("prefix-cache hit rate", f"{summary['prefix_cache_hit_rate']:.3f}"),
        ("preemptions", str(summary["preemptions"])),
        ("engine steps", str(summary["engine_steps"])),
        ("KV usage (mean)", f"{summary['kv_usage_mean']:.3f}"),
        ("simulated time", f"{summary['sim_time_s']:.1f} s"),
        ("wall time", f"{summary['wall_s']:.2f} s"),
    ]
    width = max(len(r[0]) for r in rows)
    lines += [f"{a:<{width}}  {b}" for a, b in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from twin.runner import run_scenario

    try:
        scenario = load_scenario(args.scenario, overrides=args.overrides)
    except ScenarioError as exc:
        print(f"twin run: {exc}", file=sys.stderr)
        return 2
    seed = scenario.seed if args.seed is None else args.seed
    out = Path(args.out) if args.out else Path("runs") / f"{scenario.name}-seed{seed}"
    result = run_scenario(scenario, seed=seed, replication=args.replication)
    if not result.ok:
        write_outputs(out, tables={}, files={"manifest.json": dumps(result.manifest)})
        print(f"twin run: the run failed: {result.manifest['exception']}\n(manifest written to {out})", file=sys.stderr)
        return 1
    write_outputs(out, tables=result.tables,
                  files={"manifest.json": dumps(result.manifest), "summary.json": dumps(result.summary)})
    if not args.quiet:
        print(format_summary(result.summary, title=f"{scenario.name} (seed {seed})"))
    if args.report:
        from twin.report import ReportError, load_run, render_markdown, write_report

        try:
            baseline = load_run(args.baseline) if args.baseline else None
            html_path, md_path = write_report(out, out / "report.html", baseline=baseline)
        except (ReportError, ImportError) as exc:
            print(f"twin run: report not written: {exc} (pip install 'twin[report]' for the HTML)", file=sys.stderr)
            return 2
        if not args.quiet:
            md = render_markdown(load_run(out), baseline)
            start = md.find("## Per tier")
            print("\n" + (md[start:] if start >= 0 else md).strip())
            print(f"\nreport: {html_path} and {md_path}")
    if not args.quiet:
        print(f"\nwrote {out}/")
    return 0
