"""Per-request TTFT of server-mode runs, the recording against a replay: which requests set the tail, and why.

    from twin.calibration.ttft import ttft_report, format_report
    runs = ttft_report(["tests/fixtures/calibration/cpu-tiny-llama-quiet2/held-out/heldout-server-prefix-mix"],
                       profile="tests/fixtures/calibration/cpu-tiny-llama-quiet2/cpu-tiny-llama.yaml")
    print(format_report(runs))

``twin fidelity`` compares percentiles; a TTFT p90 of 48 requests is the 5th largest value, so five requests
decide it. This module lists every request with what could explain its TTFT: its place in the run (send order,
requests sent just before it), what it asks (prompt length, the cached tokens vLLM reported, whether it is the
first request of a shared prefix), when vLLM first scheduled it (``twin.calibration.server.reconstruct``: that
step, its recorded time, and the wait from the send until the step before it streamed), and its TTFT, real and
replayed (``twin.replay.replay``, as ``twin fidelity`` replays it). Per run it also gives the cold start: how much
later the first request's first token came than the profile's server section puts it
(``calibrate.first_step_excess_s``, the quantity ``--first-step`` fits) and how many requests were sent before
that token came. docs/calibration-sessions.md ("The server TTFT tail on the prefix mix") reads these rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twin.calibration.recorded import RecordedRun, load_recorded_run
from twin.calibration.server import ServerSteps, reconstruct, step_front_end_s
from twin.engine_profiles.profile import ServerFrontEnd
from twin.metrics import distribution

CROWD_WINDOW_S = 0.02  # "sent just before": within this of the request's send (a few decode steps here)


@dataclass(frozen=True, slots=True)
class TtftRow:
    """One request of a server run: its facts, its first scheduling step as recorded, its TTFT real and replayed."""

    request_id: str
    order: int  # position in send order, 0 = the run's first request
    send_s: float
    sent_before: int  # requests sent in the CROWD_WINDOW_S before this one
    prompt_tokens: int
    cached_tokens: int | None  # vLLM's usage.prompt_tokens_details.cached_tokens
    opens_prefix: bool  # the earliest request whose first KV block a later request shares
    first_step: int  # the recorded step that first scheduled it (reconstructed)
    wait_s: float | None  # send -> the step before ``first_step`` streamed; None when that came before the send
    step_elapsed_s: float  # recorded model time of ``first_step``
    step_prefill_tokens: int  # prompt tokens computed in ``first_step`` (all requests)
    real_ttft_s: float
    twin_ttft_s: float

    @property
    def excess_s(self) -> float:
        """How much later the real first token came than the replayed one."""
        return self.real_ttft_s - self.twin_ttft_s


@dataclass(frozen=True, slots=True)
class RunTtft:
    """The rows of one run and its TTFT percentiles (``twin.metrics.distribution``, as ``twin fidelity``)."""

    name: str
    path: Path
    rows: tuple[TtftRow, ...]
    real_p90_s: float
    twin_p90_s: float
    cold_start_excess_s: float | None  # None without a server section in the profile
    sent_before_first_token: int  # requests sent before the first request's first token reached the client

    def tail(self, *, real: bool = True) -> list[TtftRow]:
        """The requests at or above the run's TTFT p90, real (``real=True``) or replayed, largest first."""
        p90 = self.real_p90_s if real else self.twin_p90_s
        key = (lambda r: r.real_ttft_s) if real else (lambda r: r.twin_ttft_s)
        return sorted((r for r in self.rows if key(r) >= p90), key=lambda r: (-key(r), r.order))


def prefix_openers(rec: RecordedRun) -> set[str]:
    """Ids of the requests that open a shared prefix: the earliest sent of each group of two or more requests with
    the same first KV block (``block_size`` prompt tokens; vLLM caches whole blocks)."""
    bs = rec.run.block_size
    groups: dict[tuple[int, ...], list[str]] = {}
    for r in sorted(rec.requests, key=lambda x: (x.arrival_s, x.request_id)):
        if r.prompt_tokens >= bs:
            groups.setdefault(tuple(r.prompt_token_ids[:bs]), []).append(r.request_id)
    return {ids[0] for ids in groups.values() if len(ids) > 1}


def run_rows(rec: RecordedRun, twin_ttft_s: dict[str, float], *, window_s: float = CROWD_WINDOW_S,
             steps: ServerSteps | None = None) -> list[TtftRow]:
    """The rows of ``rec`` given the replayed TTFT of each request (from the send, as the client measured it);
    ``steps``: ``reconstruct(rec)`` where the caller has it already."""
    if steps is None:
        steps = reconstruct(rec)
    reqs = sorted(rec.requests, key=lambda x: (x.arrival_s, x.request_id))
    sends = np.array([r.arrival_s for r in reqs], dtype=np.float64)
    openers = prefix_openers(rec)
    rows = []
    for i, r in enumerate(reqs):
        assert r.token_times_s, f"{rec.path}: {r.request_id} streamed no token"
        k = steps.first_step[r.request_id]
        prev = steps.end_s.get(k - 1)
        rows.append(TtftRow(
            request_id=r.request_id, order=i, send_s=float(r.arrival_s),
            sent_before=int(np.sum((sends[:i] >= r.arrival_s - window_s))),
            prompt_tokens=r.prompt_tokens, cached_tokens=r.num_cached_tokens, opens_prefix=r.request_id in openers,
            first_step=k, wait_s=None if prev is None or prev <= r.arrival_s else prev - r.arrival_s,
            step_elapsed_s=float(steps.elapsed_s[k]), step_prefill_tokens=steps.shapes[k].prefill_tokens,
            real_ttft_s=float(r.token_times_s[0]), twin_ttft_s=float(twin_ttft_s[r.request_id])))
    return rows


def cold_start(rec: RecordedRun, server: ServerFrontEnd | None, steps: ServerSteps | None = None,
               ) -> tuple[float | None, int]:
    """``(excess_s, sent_before)``: the first request's first-token time beyond the profile's server model
    (``calibrate.first_step_excess_s`` with the ``server`` section's arrival, front end and step time, less its
    ``first_step_s`` where one is fitted; None without a server section), and the requests sent before that token
    reached the client. ``steps``: ``reconstruct(rec)`` where the caller has it already."""
    from twin.calibration.calibrate import first_step_excess_s
    from twin.calibration.regimes import predict_model_s

    q = min(rec.requests, key=lambda x: (x.arrival_s, x.request_id))
    assert q.token_times_s
    first_token = q.arrival_s + q.token_times_s[0]
    sent_before = sum(1 for r in rec.requests if r is not q and r.arrival_s < first_token)
    if server is None:
        return None, sent_before
    if steps is None:
        steps = reconstruct(rec)
    excess = first_step_excess_s(
        steps.elapsed_s, float(predict_model_s(server.step_time, steps.shapes[:1])[0]),
        first_token_s=q.token_times_s[0] - server.arrival_s, token_step=int(steps.token_steps[q.request_id][0]),
        fixed_s=step_front_end_s(steps, base_s=server.step_time.overhead_s, per_chunk_s=server.per_chunk_s,
                                 per_first_s=server.per_first_chunk_s, per_last_s=server.per_last_chunk_s,
                                 per_in_s=server.per_request_in_s))
    return excess - (server.step_time.first_step_s or 0.0), sent_before


def ttft_report(run_dirs: Sequence[str | Path], *, profile: str, noise: bool | None = None, noise_seed: int = 0,
                window_s: float = CROWD_WINDOW_S) -> list[RunTtft]:
    """Rows of every server-mode run among ``run_dirs`` (offline runs are skipped), replayed with ``profile`` as
    ``twin fidelity`` replays them (``noise`` and ``noise_seed`` as there)."""
    from twin.engine_profiles import load_profile
    from twin.replay import replay

    server = load_profile(profile).spec.server
    out = []
    for path in run_dirs:
        rec = load_recorded_run(path)
        if rec.run.mode != "server":
            continue
        result = replay(rec, profile=profile, step_times="profile", noise=noise, noise_seed=noise_seed)
        if not result.ok:
            raise RuntimeError(f"{rec.path}: the replay failed: {result.manifest['exception']}")
        req = result.tables["requests"].to_pydict()
        steps = reconstruct(rec)
        rows = run_rows(rec, dict(zip(req["request_id"], req["ttft_s"], strict=True)), window_s=window_s, steps=steps)
        excess, sent = cold_start(rec, server, steps)
        out.append(RunTtft(
            name=rec.path.name, path=rec.path, rows=tuple(rows),
            real_p90_s=float(distribution([r.real_ttft_s for r in rows])["p90"]),
            twin_p90_s=float(distribution([r.twin_ttft_s for r in rows])["p90"]),
            cold_start_excess_s=excess, sent_before_first_token=sent))
    return out


def format_report(runs: Sequence[RunTtft]) -> str:
    """One block per run: the percentiles, the cold start, and one line per request (``R``/``T``: in the real /
    replayed TTFT tail, at or above the p90)."""
    lines = []
    for run in runs:
        real_tail = {r.request_id for r in run.tail(real=True)}
        twin_tail = {r.request_id for r in run.tail(real=False)}
        cold = "n/a" if run.cold_start_excess_s is None else f"{run.cold_start_excess_s * 1e3:+.1f} ms"
        lines += [f"{run.path.parent.name}/{run.name}: TTFT p90 real {run.real_p90_s * 1e3:.1f} ms, twin "
                  f"{run.twin_p90_s * 1e3:.1f} ms ({(run.twin_p90_s / run.real_p90_s - 1):+.1%}); cold start {cold}, "
                  f"{run.sent_before_first_token} requests sent before the first token",
                  "  order tail   send_ms prompt cached opens crowd step   wait_ms step_ms step_pt  real_ms  twin_ms  "
                  "excess_ms"]
        for r in run.rows:
            tail = ("R" if r.request_id in real_tail else "-") + ("T" if r.request_id in twin_tail else "-")
            wait = "idle" if r.wait_s is None else f"{r.wait_s * 1e3:.1f}"
            lines.append(f"  {r.order:5d} {tail:>4} {r.send_s * 1e3:9.1f} {r.prompt_tokens:6d} "
                         f"{'-' if r.cached_tokens is None else r.cached_tokens:>6} {'yes' if r.opens_prefix else '':>5} "
                         f"{r.sent_before:5d} {r.first_step:4d} {wait:>9} {r.step_elapsed_s * 1e3:7.1f} "
                         f"{r.step_prefill_tokens:7d} {r.real_ttft_s * 1e3:8.1f} {r.twin_ttft_s * 1e3:8.1f} "
                         f"{r.excess_s * 1e3:+10.1f}")
        lines.append("")
    return "\n".join(lines)
