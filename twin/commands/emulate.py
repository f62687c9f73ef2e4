"""``twin emulate``: one OpenAI-compatible replica whose timing is twin's engine + a profile (docs/router.md)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="engine profile name (twin/engine_profiles/data) or YAML path")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--model-name", default="twin-model", help="served model name")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size in tokens")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (default: from the profile)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="hold an arrival back a step as vLLM on a GPU does (default: as vLLM resolves it, on "
                             "for a GPU profile, off for a CPU one)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every step time (1 = real time)")


def run(args: argparse.Namespace) -> int:
    try:
        from twin.router.emulator import build_emulator
        from twin.router.local import serve
    except ImportError as exc:  # the router extra is missing
        print(f"twin emulate: {exc} (install the extra: pip install -e '.[router]')", file=sys.stderr)
        return 2
    try:
        emu = build_emulator(profile=args.profile, engine_overrides=engine_overrides(args), model_name=args.model_name,
                             vocab_size=args.vocab_size, time_scale=args.time_scale)
    except (ValueError, KeyError) as exc:
        print(f"twin emulate: {exc}", file=sys.stderr)
        return 2
    c = emu.engine.cfg
    serve(emu.app(), host=args.host, port=args.port,
          banner=f"twin emulate: {args.profile} on http://{args.host}:{args.port} (blocks {c.num_gpu_blocks}, "
                 f"block {c.block_size}, budget {c.max_num_batched_tokens}, seqs {c.max_num_seqs}, "
                 f"max_model_len {c.max_model_len}, {'async' if c.async_scheduling else 'synchronous'} scheduling)")
    return 0


def engine_overrides(args: argparse.Namespace) -> dict:
    """The ``EngineSettings`` fields the flags set (the rest keep their defaults)."""
    overrides = {k: v for k, v in {
        "block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len, "async_scheduling": args.async_scheduling}.items() if v is not None}
    if args.no_prefix_caching:
        overrides["enable_prefix_caching"] = False
    return overrides
