"""The built-in workload sets, by name: what ``twin record --sweep`` and ``--workload`` record.

The *calibration sweep* (:data:`CALIBRATION_SWEEP`) varies one thing at a time: decode batch size, prefill
chunk size (small ``max_num_batched_tokens``), prompt length, KV pressure (a small
``num_gpu_blocks_override`` so preemptions happen) and prefix sharing. The *held-out* set
(:data:`HELD_OUT`) uses other arrival patterns, prefix mixes and KV pressure, for validation only.
:data:`FIXTURES` are the small workloads committed under ``tests/fixtures/recorded/``.
The spec classes are in :mod:`twin.calibration.workloads`.
"""

from __future__ import annotations

from twin.calibration.workloads import Arrivals, EngineSpec, LengthDist, SharedPrefix, WorkloadSpec


def _w(name: str, **kw) -> WorkloadSpec:
    return WorkloadSpec(name=name, **kw)


# ---------------------------------------------------------------------------------------------------
# Committed fixtures (cpu-tiny-llama; small so a recording takes well under a minute after start-up).
FIXTURES: dict[str, WorkloadSpec] = {
    w.name: w
    for w in [
        _w(
            "offline-mixed",
            description="(a) plain mixed prefill/decode, all queued at t=0, budget 1024",
            seed=1,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=768),
            output_tokens=LengthDist(min_tokens=8, max_tokens=96),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024),
        ),
        _w(
            "offline-chunked-256",
            description="(b) chunked prefill at a small budget (max_num_batched_tokens 256)",
            seed=2,
            num_requests=24,
            prompt_tokens=LengthDist(min_tokens=200, max_tokens=1000),
            output_tokens=LengthDist(min_tokens=8, max_tokens=48),
            engine=EngineSpec(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=1280),
        ),
        _w(
            "offline-kv-pressure",
            description="(c) KV pressure: 12 blocks of 128 tokens (11 usable) so running requests get preempted",
            seed=3,
            num_requests=24,
            prompt_tokens=LengthDist(min_tokens=100, max_tokens=300),
            output_tokens=LengthDist(min_tokens=96, max_tokens=200),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024, num_gpu_blocks_override=12),
        ),
        _w(
            "offline-prefix",
            description="(d) three shared 512-token system prompts (80% of requests), prefix caching on",
            seed=4,
            num_requests=40,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=256),
            output_tokens=LengthDist(min_tokens=8, max_tokens=48),
            shared_prefix=SharedPrefix(num_prefixes=3, prefix_tokens=512, share_fraction=0.8),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024),
        ),
        _w(
            "offline-no-chunking",
            description="(e) chunked prefill off: whole prompts only, head-of-line blocking at budget 1536",
            seed=5,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=100, max_tokens=1200),
            output_tokens=LengthDist(min_tokens=8, max_tokens=64),
            engine=EngineSpec(
                max_num_batched_tokens=1536, max_num_seqs=32, max_model_len=1536, enable_chunked_prefill=False
            ),
        ),
        _w(
            "server-poisson-low",
            description="server, Poisson arrivals at 4 req/s",
            mode="server",
            seed=6,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=512),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=4.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "server-poisson-high",
            description="server, Poisson arrivals at 16 req/s",
            mode="server",
            seed=7,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=512),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=16.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "server-prefix",
            description="server, Poisson 8 req/s, two shared 384-token system prompts (75% of requests)",
            mode="server",
            seed=8,
            num_requests=40,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=256),
            output_tokens=LengthDist(min_tokens=16, max_tokens=64),
            shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=384, share_fraction=0.75),
            arrivals=Arrivals(kind="poisson", rate_per_s=8.0),
            engine=EngineSpec(max_model_len=1024),
        ),
    ]
}

# ---------------------------------------------------------------------------------------------------
# Calibration sweep: one axis at a time, offline (exact step composition) on cpu-tiny-llama, plus four server
# runs for the server front end and the server step time: three arrival rates (the third, 24 req/s, since 2026-12-04:
# docs/calibration-sessions.md, "A busier server run in the sweep") and a held batch with contexts apart from it (since
# 2026-12-06: "Decode context apart from batch in the server sweep").
CALIBRATION_SWEEP: dict[str, WorkloadSpec] = {
    w.name: w
    for w in [
        _w(
            "sweep-decode-batch",
            description="decode batch size sweeps 48 -> 1: short prompts, output lengths spread 8..256",
            seed=101,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=64),
            output_tokens=LengthDist(min_tokens=8, max_tokens=256),
            engine=EngineSpec(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=512),
        ),
        _w(
            "sweep-prefill-chunk-128",
            description="prefill chunk size 128 (max_num_batched_tokens 128)",
            seed=102,
            num_requests=16,
            prompt_tokens=LengthDist(min_tokens=256, max_tokens=1024),
            output_tokens=LengthDist(min_tokens=4, max_tokens=16),
            engine=EngineSpec(max_num_batched_tokens=128, max_num_seqs=16, max_model_len=1088),
        ),
        _w(
            "sweep-prefill-chunk-512",
            description="prefill chunk size 512",
            seed=103,
            num_requests=16,
            prompt_tokens=LengthDist(min_tokens=256, max_tokens=1024),
            output_tokens=LengthDist(min_tokens=4, max_tokens=16),
            engine=EngineSpec(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=1088),
        ),
        _w(
            "sweep-prefill-chunk-2048",
            description="prefill chunk size 2048",
            seed=104,
            num_requests=16,
            prompt_tokens=LengthDist(min_tokens=256, max_tokens=1024),
            output_tokens=LengthDist(min_tokens=4, max_tokens=16),
            engine=EngineSpec(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=1088),
        ),
        _w(
            "sweep-prompt-length",
            description="prompt length 16..1500 (log-uniform), one request at a time (max_num_seqs 1)",
            seed=105,
            num_requests=24,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=1500, log_uniform=True),
            output_tokens=LengthDist(min_tokens=4, max_tokens=8),
            engine=EngineSpec(max_num_batched_tokens=2048, max_num_seqs=1, max_model_len=1536),
        ),
        _w(
            "sweep-kv-pressure",
            description="KV pressure: 16 blocks (15 usable) for 32 requests with long outputs -> preemptions",
            seed=106,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=64, max_tokens=384),
            output_tokens=LengthDist(min_tokens=64, max_tokens=256),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024, num_gpu_blocks_override=16),
        ),
        _w(
            "sweep-prefix-sharing",
            description="prefix sharing: four 640-token system prompts on 90% of requests",
            seed=107,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=256),
            output_tokens=LengthDist(min_tokens=8, max_tokens=32),
            shared_prefix=SharedPrefix(num_prefixes=4, prefix_tokens=640, share_fraction=0.9),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024),
        ),
        # Server mode (the OpenAI API server in front of the engine): only these fit the profile's server
        # section (front-end time, server step time; twin.calibration.server). Offline steps fit the rest.
        _w(
            "sweep-server-rate-6",
            description="server, Poisson 6 req/s: few concurrent streams, front end mostly idle",
            mode="server",
            seed=108,
            num_requests=40,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=640),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=6.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "sweep-server-rate-14",
            description="server, Poisson 14 req/s: tens of concurrent streams, front end busy",
            mode="server",
            seed=109,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=640),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=14.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "sweep-server-rate-24",
            description="server, Poisson 24 req/s: faster than a 2-core CPU drains, 40-55 streams a step at the peak",
            mode="server",
            seed=111,
            num_requests=64,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=640),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=24.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        # The three runs above tie the decode context to the batch (the context per request is about the same at
        # every rate: correlation 0.996 over their decode steps), so they cannot tell the two terms apart. Here the
        # batch is held at 8 by max_num_seqs while whole prompts of 16..1800 tokens come and go through it.
        _w(
            "sweep-server-context",
            description="server, decode context apart from batch size: 8 streams at a time (max_num_seqs 8), "
                        "prompts 16..1800, all sent within ~1 s",
            mode="server",
            seed=112,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=1800),
            output_tokens=LengthDist(min_tokens=96, max_tokens=192),
            arrivals=Arrivals(kind="poisson", rate_per_s=40.0),
            engine=EngineSpec(max_num_seqs=8, max_model_len=2112),
        ),
    ]
}

# ---------------------------------------------------------------------------------------------------
# Held-out validation workloads: arrival patterns, prefix mixes and KV pressure the sweep does not use.
HELD_OUT: dict[str, WorkloadSpec] = {
    w.name: w
    for w in [
        _w(
            "heldout-server-bursty",
            description="server, bursty gamma arrivals (mean 10 req/s, cv 3), mixed lengths",
            mode="server",
            seed=201,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=900, log_uniform=True),
            output_tokens=LengthDist(min_tokens=8, max_tokens=128),
            arrivals=Arrivals(kind="gamma", rate_per_s=10.0, cv=3.0),
            engine=EngineSpec(max_model_len=1152),
        ),
        _w(
            "heldout-server-prefix-mix",
            description="server, Poisson 12 req/s, two 512-token prefixes weighted 3:1, on 60% of requests",
            mode="server",
            seed=202,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=192),
            output_tokens=LengthDist(min_tokens=8, max_tokens=64),
            shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=512, share_fraction=0.6, weights=(3.0, 1.0)),
            arrivals=Arrivals(kind="poisson", rate_per_s=12.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "heldout-offline-kv-prefix",
            description="offline, KV pressure (20 blocks) together with shared prefixes and budget 512",
            seed=203,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=256),
            output_tokens=LengthDist(min_tokens=64, max_tokens=192),
            shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=256, share_fraction=0.7),
            engine=EngineSpec(max_num_batched_tokens=512, max_num_seqs=32, max_model_len=768, num_gpu_blocks_override=20),
        ),
    ]
}

# The server prefix mixes of the diagnostic set: all but the seed, the count and the prefixes.
_PREFIX_MIX = dict(mode="server", prompt_tokens=LengthDist(min_tokens=16, max_tokens=256),
                   output_tokens=LengthDist(min_tokens=8, max_tokens=64),
                   arrivals=Arrivals(kind="poisson", rate_per_s=10.0), engine=EngineSpec(max_model_len=1024))
_THREE_PREFIXES = SharedPrefix(num_prefixes=3, prefix_tokens=384, share_fraction=0.7, weights=(2.0, 1.0, 1.0))

# ---------------------------------------------------------------------------------------------------
# Diagnostic workloads: recordable by name, in no session (docs/calibration.md says what each was for).
DIAGNOSTIC: dict[str, WorkloadSpec] = {
    w.name: w
    for w in [
        _w(
            "diag-decode-context",
            description="decode context apart from batch size: the batch held at 8 while each request's context "
                        "spans 16..2000 tokens",
            seed=110,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=1800),
            output_tokens=LengthDist(min_tokens=128, max_tokens=256),
            engine=EngineSpec(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=2112),
        ),
        # A server prefix mix (not the held-out one: three 384-token prefixes on 70 % of the requests), and the same
        # with each sharing request's prefix its own (drawn from 4096, so none repeats): the same prompt lengths,
        # outputs and send times. Decode steps that read a shared prefix against steps without one; the first fits
        # the server section's shared_context_fraction (docs/calibration-sessions.md, "Shared prefixes in decode
        # steps").
        _w("diag-prefix-mix-shared", seed=212, num_requests=48, shared_prefix=_THREE_PREFIXES, **_PREFIX_MIX,
           description="server, Poisson 10 req/s, three 384-token prefixes weighted 2:1:1, on 70% of requests"),
        _w("diag-prefix-mix-unique", seed=212, num_requests=48, **_PREFIX_MIX,
           shared_prefix=SharedPrefix(num_prefixes=4096, prefix_tokens=384, share_fraction=0.7),
           description="diag-prefix-mix-shared with each sharing request's 384-token prefix drawn from 4096 (unique)"),
        # The sweep's fifth server run for one session (2026-12-06, commit 39b6449), recorded by the one command in
        # tests/fixtures/calibration/cpu-small-llama-freshclone-prefix: it fitted the server section's
        # shared_context_fraction, which that session's held-out runs then rejected (docs/calibration-sessions.md,
        # "Shared prefixes in decode steps"). Three system prompts, as diag-prefix-mix-shared, with other requests and
        # more.
        _w("sweep-server-prefix", seed=113, num_requests=64, shared_prefix=_THREE_PREFIXES, **_PREFIX_MIX,
           description="server, Poisson 10 req/s, three 384-token prefixes weighted 2:1:1, on 70% of requests"),
    ]
}

SETS: dict[str, dict[str, WorkloadSpec]] = {
    "calibration": CALIBRATION_SWEEP,
    "held-out": HELD_OUT,
    "fixtures": FIXTURES,
    "diagnostic": DIAGNOSTIC,
}


def get_workload(name: str) -> WorkloadSpec:
    """A built-in workload by name (from any set)."""
    for group in SETS.values():
        if name in group:
            return group[name]
    known = sorted(n for g in SETS.values() for n in g)
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(known)}")


def _spread(a: list, b: list) -> list:
    """``a`` and ``b`` merged so that each is spread evenly over the result: item k of a list of n sits at
    fraction (k + 1/2) / n of the way through, ties to ``a``."""
    keyed = [((k + 0.5) / len(a), 0, x) for k, x in enumerate(a)]
    keyed += [((k + 0.5) / len(b), 1, x) for k, x in enumerate(b)]
    return [x for *_, x in sorted(keyed, key=lambda t: t[:2])]


def session_plan(heldout_repeats: int) -> list[tuple[str, str]]:
    """The recording order of one calibration session: ``(folder, workload)`` pairs, the calibration sweep in
    ``calibration`` and held-out repeat i in ``held-out`` (i = 1) or ``held-out-repeat{i}``.

    The sweep and the held-out repeats are interleaved, and the sweep's server runs spread among its
    offline ones, rather than recorded one set after the other: on a shared VM the host's speed drifts over
    minutes, and a sweep recorded in one stretch gives the fit that stretch's speed while the held-out runs
    see the next ones (docs/calibration-sessions.md, "Interleaved recording"). Spread through the session, the fit's
    runs see the same mix of the host's speeds as the held-out runs they are judged on.
    """
    if heldout_repeats < 1:
        raise ValueError("heldout_repeats must be at least 1")
    sweep = [("calibration", n) for n, w in CALIBRATION_SWEEP.items() if w.mode == "offline"]
    server = [("calibration", n) for n, w in CALIBRATION_SWEEP.items() if w.mode != "offline"]
    held = [("held-out" if i == 1 else f"held-out-repeat{i}", n)
            for i in range(1, heldout_repeats + 1) for n in HELD_OUT]
    return _spread(_spread(sweep, server) if server else sweep, held)
