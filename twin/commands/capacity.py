"""``twin capacity``: the capacity model of ``twin.capacity`` from a preset or an inputs file.

    twin capacity --preset seed-10m
    twin capacity --file my-fleet.yaml --set prefix_cache_hit_fraction=0.8 --json

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


def run(args: argparse.Namespace) -> int:
    try:
        inputs = build_inputs(preset=args.preset, file=args.file, overrides=args.overrides)
        result = compute_capacity(inputs)
    except InputError as exc:
        print(f"twin capacity: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        for line in describe_validation_error(exc):
            print(f"twin capacity: {line}", file=sys.stderr)
        return 2
    except ValueError as exc:  # profile conflicts or a missing profile module
        print(f"twin capacity: {exc}", file=sys.stderr)
        return 2
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
