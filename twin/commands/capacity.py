"""``twin capacity``: the capacity model of ``twin.capacity`` from a preset or an inputs file.

    twin capacity --preset seed-10m
    twin capacity --file my-fleet.yaml --set prefix_cache_hit_fraction=0.8 --json
    twin capacity --cross-check --preset seed-10m [--profile NAME] [--json]

``--cross-check`` simulates one replica at rising load (``twin.crosscheck``) and sets what it measures
next to the arithmetic (docs/capacity.md, "Cross-check by simulation").

Bad input (unknown preset, unreadable file, a typo'd field, a value out of range) prints one message
per problem naming the field and returns 2; nothing else is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from twin.capacity import PRESETS, CapacityInputs, CapacityResult, compute_capacity

# Output field -> unit shown in the table (the JSON carries raw numbers; docs/capacity.md has them all).
UNITS: dict[str, str] = {
    "turns_per_day": "turns/day", "avg_rps": "req/s", "peak_rps": "req/s",
    "peak_prompt_tokens_per_s": "tok/s", "peak_uncached_prompt_tokens_per_s": "tok/s",
    "peak_output_tokens_per_s": "tok/s", "generation_duration_s": "s", "active_streams": "streams",
    "kv_tokens_per_stream": "tokens", "kv_bytes_per_stream": "bytes", "free_kv_bytes_per_replica": "bytes",
    "streams_per_replica_by_memory": "streams", "streams_per_replica_by_latency": "streams",
    "streams_per_replica": "streams", "decode_capacity_per_replica_tokens_per_s": "tok/s",
    "decode_capacity_per_gpu_tokens_per_s": "tok/s", "replicas_at_saturation": "replicas",
    "replicas": "replicas", "replicas_by_concurrency": "replicas", "replicas_with_reserve": "replicas",
    "gpus": "GPUs", "gpus_with_reserve": "GPUs", "nodes": "nodes", "output_tokens_per_month": "tokens",
    "usd_per_month": "USD", "usd_per_m_output_tokens": "USD/M tok",
    "prefill_capacity_per_replica_tokens_per_s": "tok/s", "prefill_share_of_replica_time": "fraction",
    "replicas_with_prefill": "replicas", "fleet_fraction_saved_per_10pt_prefix_hit": "fraction",
    "long_context_kv_ratio": "x", "long_context_kv_bytes_per_stream": "bytes",
    "long_context_streams_per_replica_by_memory": "streams", "usd_per_stream_hour": "USD/stream-hour",
    "usd_per_long_context_stream_hour": "USD/stream-hour",
}


class InputError(Exception):
    """Bad command-line input; the message names what is wrong."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"named inputs: {', '.join(PRESETS)}")
    source.add_argument("--file", type=Path, help="YAML or JSON mapping of CapacityInputs fields")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one input (value parsed as YAML: 0.8, true, null); repeatable")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--cross-check", dest="cross_check", action="store_true",
                        help="simulate one replica at rising load and compare with the arithmetic (~40 s)")
    parser.add_argument("--profile", dest="sim_profile", metavar="NAME",
                        help="engine profile to simulate with --cross-check (default: the inputs' or 70B FP8 TP4 H100)")
    parser.add_argument("--seed", type=int, default=1, help="root seed of the --cross-check runs (default 1)")


def run(args: argparse.Namespace) -> int:
    if args.sim_profile is not None and not args.cross_check:
        print("twin capacity: --profile goes with --cross-check (to set the inputs' profile use --set profile=NAME)",
              file=sys.stderr)
        return 2
    try:
        inputs = build_inputs(preset=args.preset, file=args.file, overrides=args.overrides)
        result = compute_capacity(inputs)
        if args.cross_check:
            from twin.engine_profiles import load_profile

            if args.sim_profile is not None:
                load_profile(args.sim_profile)  # an unknown name fails here, as input, before any simulation
    except InputError as exc:
        print(f"twin capacity: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        for line in describe_validation_error(exc):
            print(f"twin capacity: {line}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as exc:  # profile conflicts, unknown profile, missing profile module
        print(f"twin capacity: {exc}", file=sys.stderr)
        return 2
    if args.cross_check:
        return _cross_check(args, inputs, result)
    if args.json:
        print(json.dumps({"preset": args.preset, **result.model_dump(), "inputs": inputs.model_dump()}, indent=2))
    else:
        print(render_table(inputs, result))
    return 0


def build_inputs(*, preset: str | None, file: Path | None, overrides: list[str]) -> CapacityInputs:
    """The base mapping (preset or file) with each ``--set`` applied, validated once at the end."""
    if preset is None and file is None:
        raise InputError(f"give --preset ({', '.join(PRESETS)}) or --file")
    if preset is not None:
        if preset not in PRESETS:
            raise InputError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        data: dict[str, Any] = PRESETS[preset].model_dump(exclude_unset=True)
    else:
        data = _read_mapping(file)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"--set {item!r}: expected KEY=VALUE")
        if key not in CapacityInputs.model_fields:
            raise InputError(f"--set {key}: not an input field{_did_you_mean(key)}")
        try:
            data[key] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise InputError(f"--set {key}: cannot parse value {raw!r}") from exc
    return CapacityInputs.model_validate(data)


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--file {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise InputError(f"--file {path}: not valid YAML/JSON ({str(exc).splitlines()[0]})") from exc
    if not isinstance(data, dict):
        raise InputError(f"--file {path}: expected a mapping of input fields, got {type(data).__name__}")
    return data


def _did_you_mean(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(CapacityInputs.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def describe_validation_error(exc: ValidationError) -> list[str]:
    """One line per problem: ``field: message (got value)``."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "inputs"
        hint = _did_you_mean(field) if err["type"] == "extra_forbidden" else ""
        got = "" if err["type"] == "extra_forbidden" else f" (got {err.get('input')!r})"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{field}: {msg}{got}{hint}")
    return lines


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, float) and abs(value) >= 1e13:
        return f"{value:.4g}"
    if isinstance(value, int) or value.is_integer():
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:,.2f}"
    return f"{value:.4g}"


def render_table(inputs: CapacityInputs, result: CapacityResult) -> str:
    """Inputs that are set, then every output with its unit, in aligned columns."""
    rows: list[tuple[str, str, str]] = [("INPUTS", "", "")]
    rows += [(k, _fmt(v), "") for k, v in inputs.model_dump().items() if v is not None]
    rows += [("", "", ""), ("OUTPUTS", "", "")]
    rows += [(k, _fmt(v), UNITS.get(k, "")) for k, v in result.model_dump().items()]
    name_w = max(len(r[0]) for r in rows)
    value_w = max(len(r[1]) for r in rows)
    return "\n".join(f"{n:<{name_w}}  {v:>{value_w}}  {u}".rstrip() for n, v, u in rows)


# ------------------------------------------------------------------------------------ --cross-check


def _cross_check(args: argparse.Namespace, inputs: CapacityInputs, result: CapacityResult) -> int:
    from twin.crosscheck import run_crosscheck

    try:
        report = run_crosscheck(inputs, result, preset=args.preset, profile=args.sim_profile, seed=args.seed)
    except ValueError as exc:  # e.g. no speed target in the inputs
        print(f"twin capacity: --cross-check: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.model_dump(), indent=2))
    else:
        print(render_cross_check(report))
    return 0


def _opt(value: float | None, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def render_cross_check(r: Any) -> str:
    """The ladder as a table, the headline comparison, the computed gap text and the wall time."""
    tgt_ms = r.tpot_target_s * 1e3
    lines = [
        f"cross-check of {r.preset or 'the inputs'}: one replica of {r.profile} ({r.profile_note})",
        f"workload: {r.prompt_tokens:,} prompt + {r.output_tokens:,} output tokens per request (constant), Poisson "
        f"arrivals; a {r.prefix_tokens:,}-token shared prefix on {r.prefix_fraction:.0%} of requests -> prefix-cache "
        f"hit rate {r.prefix_hit_achieved:.3f} measured (target {r.prefix_hit_target:.2f})",
        f"targets: {r.speed_target_tokens_per_s:.3g} tok/s per stream -> TPOT <= {tgt_ms:.1f} ms "
        f"({r.speed_target_note}); TTFT p99 <= " + (f"{r.ttft_slo_s:g} s (the inputs' mean_ttft_s)"
                                                    if r.ttft_slo_s is not None else "- (none stated)"),
        f"ladder: fractions of {r.saturation_rate_per_s:.3g} req/s (offline-burst completion rate) + the model's "
        f"per-replica peak rate + bisections at the TPOT target; seed {r.seed}; window = second half of arrivals",
        "",
    ]
    head = ["rate", "reqs", "running", "waiting", "L", "lambda*E2E", "model L", "E2E", "TPOT p50", "TPOT p95",
            "TTFT p50", "TTFT p99", "out tok/s", "KV max", "prefill", "cap"]
    units = ["req/s", "", "mean", "mean", "run+wait", "", "lambda*dur", "s", "ms", "ms", "ms", "ms", "", "", "time", ""]
    rows = [head, units]
    for p in r.points:
        rows.append([f"{p.rate_per_s:.3g}", f"{p.num_requests}", f"{p.running_mean:.1f}", f"{p.waiting_mean:.1f}",
                     f"{p.in_system_mean:.1f}", f"{p.littles_lambda_w:.1f}", _opt(p.analytic_in_system, ".1f"),
                     f"{p.e2e_mean_s:.2f}", f"{p.tpot_p50_s * 1e3:.1f}", f"{p.tpot_p95_s * 1e3:.1f}",
                     f"{p.ttft_p50_s * 1e3:.0f}", f"{p.ttft_p99_s * 1e3:.0f}", f"{p.output_tokens_per_s:,.0f}",
                     f"{p.kv_usage_max:.0%}", f"{p.prefill_time_share:.0%}", "yes" if p.at_cap else ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in rows]

    def at(a: Any) -> str:
        return "none" if a.streams is None else f"{a.streams:.0f} streams at {a.rate_per_s:.3g} req/s " \
               f"(TPOT {a.tpot_s * 1e3:.1f} ms)"

    lat, mem = r.analytic_streams_by_latency, r.analytic_streams_by_memory
    rr = r.analytic_rate_per_replica
    ref = min(r.points, key=lambda p: abs(p.rate_per_s - rr)) if rr is not None else None
    cmp = [
        ("", "simulated", "capacity model"),
        (f"streams at TPOT p50 <= {tgt_ms:.1f} ms", at(r.at_target_p50),
         f"{_opt(lat, 'd')} by latency, {_opt(mem, 'd')} by memory"),
        (f"streams at TPOT p95 <= {tgt_ms:.1f} ms", at(r.at_target_p95), ""),
        ("output tok/s at the p50 target", _opt(r.at_target_p50.output_tokens_per_s, ",.0f"),
         _opt(r.analytic_decode_capacity_per_replica_tokens_per_s, ",.0f")),
        (f"TTFT knee: p99 > {_opt(r.ttft_slo_s, 'g')} s",
         "not reached" if r.ttft_knee_slo is None
         else f"{r.ttft_knee_slo:.3g} req/s, {r.ttft_knee_slo_streams:.0f} streams",
         ""),
        (f"TTFT knee: p99 > {r.ttft_knee_factor:g}x lightest load's",
         "not reached" if r.ttft_knee_relative is None
         else f"{r.ttft_knee_relative:.3g} req/s, {r.ttft_knee_relative_streams:.0f} streams", ""),
        ("KV room (streams of prompt+output)", f"{r.sim_kv_capacity_streams}", _opt(mem, "d")),
    ]
    if ref is not None and rr is not None:
        cmp.append((f"Little's law at {ref.rate_per_s:.3g} req/s",
                    f"L {ref.in_system_mean:.0f}, lambda*E2E {ref.littles_lambda_w:.0f} (E2E {ref.e2e_mean_s:.1f} s)",
                    f"{_opt(r.analytic_active_streams_per_replica, '.0f')} per replica "
                    f"({_opt(r.analytic_generation_duration_s, 'g')} s lifetime)"))
    w0, w1 = max(len(c[0]) for c in cmp), max(len(c[1]) for c in cmp)
    lines += [""] + [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in cmp]
    lines += ["", "gap explained:"] + [f"  - {g}" for g in r.gap_explained]
    lines += ["", f"wall time: {r.wall_s:.1f} s (CPU {r.cpu_s:.1f} s)"]
    return "\n".join(lines)
