"""``twin router``: the OpenAI-compatible router in front of vLLM servers, with a twin policy (docs/router.md)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", required=True, help="YAML with a policy.router section (other keys ignored)")
    parser.add_argument("--keys", required=True, help="KEYS.yaml: {keys: {<key>: {tenant, tokens_per_minute}}}")
    parser.add_argument("--upstream", action="append", required=True, help="base URL of a vLLM server (repeat)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--scrape-interval-s", type=float, default=None)
    parser.add_argument("--block-size", type=int, default=None, help="the engines' KV block size")
    parser.add_argument("--max-model-len", type=int, default=None, help="the engines' max model length")
    parser.add_argument("--model", default=None, help="served model name of the upstreams")
    parser.add_argument("--seed", type=int, default=None, help="the policy's seed")


def run(args: argparse.Namespace) -> int:
    try:
        from pydantic import ValidationError

        from twin.router.keys import load_keys
        from twin.router.local import serve
        from twin.router.service import RouterService, RouterServiceConfig, load_policy_file
    except ImportError as exc:
        print(f"twin router: {exc} (install the extra: pip install -e '.[router]')", file=sys.stderr)
        return 2
    try:
        policy, section = load_policy_file(args.scenario)
        flags = {"scrape_interval_s": args.scrape_interval_s, "block_size_tokens": args.block_size,
                 "max_model_len": args.max_model_len, "model": args.model, "seed": args.seed}
        section.update({k: v for k, v in flags.items() if v is not None})
        config = RouterServiceConfig.model_validate(section)
        keys = load_keys(args.keys)
        service = RouterService(policy=policy, upstreams=args.upstream, keys=keys, config=config)
    except (OSError, ValueError, ValidationError) as exc:
        print(f"twin router: {exc}", file=sys.stderr)
        return 2
    serve(service.app(), host=args.host, port=args.port,
          banner=f"twin router: {policy.kind} over {len(args.upstream)} upstreams on http://{args.host}:{args.port}")
    return 0
