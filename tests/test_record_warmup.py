"""The warm-up's long prompts (``_vllm_common.prefill_warmup_requests``): what they send, without vLLM.

The marked test ``test_record_vllm.py::test_record_server`` checks on a real server that the warm-up leaves no
request, step or counter in the run; this one checks the plan itself on the engine settings the workload sets use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.calibration._vllm_common import (
    WARMUP_IDS,
    decode_warmup_requests,
    prefill_warmup_requests,
    rehearsal_requests,
    warmup_fields,
    warmup_plan,
    warmup_summary,
)
from twin.calibration.recorded import load_recorded_run
from twin.calibration.regimes import predict_model_s
from twin.calibration.server import reconstruct
from twin.calibration.workload_sets import SETS
from twin.calibration.workloads import FIRST_TOKEN_ID, build_requests
from twin.engine_profiles import load_profile
from twin.paths import REPO_ROOT


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@pytest.mark.parametrize("blocks", [None, 1024, 40, 20, 12, 2])
@pytest.mark.parametrize("max_model_len", [512, 1024, 2112])
def test_prompts_fit_the_engine_and_hit_only_themselves(blocks: int | None, max_model_len: int) -> None:
    bs = 128 if blocks != 20 else 16
    engine = {"max_model_len": max_model_len, "max_num_batched_tokens": 2048, "max_num_seqs": 128}
    waves = prefill_warmup_requests(engine, bs, blocks)
    if blocks is not None and (blocks - 1) * bs - 2 < bs:
        assert waves == []  # not even one block's prompt fits with a block to spare
        return
    assert waves, "a server with room for a long prompt gets one"
    longest = waves[0][0]["prompt_token_ids"]
    room = max_model_len - 2 if blocks is None else min(max_model_len - 2, (blocks - 1) * bs - 2)
    assert len(waves[0]) == 1 and len(longest) == room  # the largest prefill the engine can be asked for
    for wave in waves:
        # every request of a wave resident at once, with a block to spare: the warm-up preempts nothing
        need = sum(_blocks(len(r["prompt_token_ids"]) + r["max_tokens"], bs) for r in wave)
        assert blocks is None or need <= blocks - 1
        for r in wave:
            assert len(r["prompt_token_ids"]) + r["max_tokens"] <= max_model_len
            assert set(r["prompt_token_ids"]) <= set(WARMUP_IDS) and max(WARMUP_IDS) < FIRST_TOKEN_ID
    if len(waves) > 1:
        hit, fresh = waves[1]
        cached = hit["prompt_token_ids"].index(WARMUP_IDS[1])
        assert cached % bs == 0 and cached >= bs  # whole blocks of the first prompt: a prefix-cache hit
        assert hit["prompt_token_ids"][:cached] == longest[:cached]
        assert len(fresh["prompt_token_ids"]) == len(hit["prompt_token_ids"]) - cached  # the same new length
        assert fresh["prompt_token_ids"][:bs] != longest[:bs]  # and nothing cached for it


def test_the_workload_sets_get_both_waves_and_their_prompts_never_share_a_block() -> None:
    # Both modes warm up (offline since 2026-12-02): every built-in workload gets the long prompt, and both waves
    # unless its block count cannot hold two long prompts at once (offline-kv-pressure's 12 blocks).
    specs = [w for ws in SETS.values() for w in ws.values()]
    assert {w.mode for w in specs} == {"offline", "server"}
    for w in specs:
        engine = w.engine.model_dump()
        decode, waves = warmup_plan(engine, 128, engine["num_gpu_blocks_override"] or 1024)
        assert len(waves) == (1 if w.name == "offline-kv-pressure" else 2), w.name
        assert decode and all(r["prompt_token_ids"] == [WARMUP_IDS[0]] for r in decode)
        for r in build_requests(w):
            assert min(r.prompt_token_ids) >= FIRST_TOKEN_ID  # no workload block can equal a warm-up block


@pytest.mark.parametrize(("max_num_seqs", "block_size", "override", "n"),
                         [(128, 128, None, 127), (8, 128, None, 8), (128, 16, None, 15), (128, 128, 12, 11),
                          (1, 128, None, 1), (128, 128, 1, 1)])
def test_decode_warm_up_fits_one_block_each_and_decodes_every_batch_size(
        max_num_seqs: int, block_size: int, override: int | None, n: int) -> None:
    engine = {"max_num_seqs": max_num_seqs, "num_gpu_blocks_override": override}
    reqs = decode_warmup_requests(engine, block_size)
    assert len(reqs) == n
    assert sorted(r["max_tokens"] for r in reqs) == list(range(1, n + 1))  # batch n, then n - 1, ... 1
    # prompt + output - 1 tokens in KV: inside one block and never filling it, so nothing is hashed
    assert all(len(r["prompt_token_ids"]) + r["max_tokens"] - 1 < block_size for r in reqs)
    assert len({r["request_id"] for r in reqs}) == n and all(r["request_id"].startswith("warmup-") for r in reqs)
    waves = prefill_warmup_requests({"max_model_len": 1024, "num_gpu_blocks_override": override}, block_size,
                                    override or 1024)
    fields = warmup_fields(warmup_summary(reqs, waves))
    assert fields["warmup_requests"] == n + sum(len(w) for w in waves)
    assert fields["warmup"]["prefill_prompt_tokens"] == [[len(r["prompt_token_ids"]) for r in w] for w in waves]


@pytest.mark.parametrize("workload", ["sweep-decode-batch", "sweep-kv-pressure", "heldout-offline-kv-prefix",
                                      "offline-prefix", "sweep-prompt-length"])
def test_the_offline_rehearsal_has_the_runs_shape_and_shares_no_block(workload: str) -> None:
    spec = next(ws[workload] for ws in SETS.values() if workload in ws)
    run = [{"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens} for r in build_requests(spec)]
    bs = 16  # smaller than any block size the sets use, so more of each prompt is in full blocks
    reh = rehearsal_requests(run)
    assert [len(r["prompt_token_ids"]) for r in reh] == [len(r["prompt_token_ids"]) for r in run]
    assert [r["max_tokens"] for r in reh] == [min(r["max_tokens"], 4) for r in run]
    assert len({r["request_id"] for r in reh}) == len(reh) and all(r["request_id"].startswith("warmup-") for r in reh)
    # a block is cached under the hash of every token up to its end: no two full blocks of the rehearsal, the long
    # prompts or the run have the same tokens from the start, except the run's own shared prefixes
    def blocks(prompt: list[int]) -> set[tuple[int, ...]]:
        return {tuple(prompt[: (k + 1) * bs]) for k in range(len(prompt) // bs)}

    engine = spec.engine.model_dump()
    long_prompts = [r["prompt_token_ids"] for w in prefill_warmup_requests(engine, bs, None) for r in w]
    seen = set().union(*(blocks(p) for p in long_prompts)) | set().union(*(blocks(r["prompt_token_ids"]) for r in run))
    for r in reh:
        assert set(r["prompt_token_ids"]) <= set(WARMUP_IDS)
        mine = blocks(r["prompt_token_ids"])
        assert not mine & seen, r["request_id"]
        seen |= mine


def _session(name: str) -> Path:
    return REPO_ROOT / "tests" / "fixtures" / "calibration" / f"cpu-tiny-llama-{name}"


def _step_ratios(fit, rec) -> tuple[list, np.ndarray]:  # noqa: ANN001 (StepTimeCoefficients, RecordedRun)
    """A recorded run's reconstructed step shapes and each step's recorded time / ``fit``'s model time."""
    steps = reconstruct(rec)
    return steps.shapes, np.asarray(steps.elapsed_s) / np.asarray(predict_model_s(fit, steps.shapes))


def _first_long_prefill_ratios(root: Path) -> tuple[float, float]:
    """A committed session's server runs: the median over runs of each one's first step with 256+ prefill tokens, and
    the median of their later such steps, as recorded time / the session's server fit (model time; docs/calibration.md,
    "The first long prefill of a fresh server")."""
    fit = load_profile(str(root / "cpu-tiny-llama.yaml")).spec.server.step_time
    first, later = [], []
    for run in sorted(root.glob("calibration/sweep-server-*")) + sorted(root.glob("held-out*/heldout-server-*")):
        shapes, all_ratios = _step_ratios(fit, load_recorded_run(run))
        ratios = [r for s, r in zip(shapes, all_ratios.tolist(), strict=True)
                  if s.prefill_requests and s.prefill_tokens >= 256]
        first.append(ratios[0])
        later.extend(ratios[1:])
    return float(np.median(first)), float(np.median(later))


@pytest.mark.parametrize(("session", "warm"), [("freshhost2", False), ("freshhost3", False), ("interleaved4", False),
                                               ("prefillwarm", True), ("prefillwarm2", True),
                                               ("prefillwarm3", True)])
def test_the_first_long_prefill_runs_at_the_fit_only_after_the_prefill_warm_up(session: str, warm: bool) -> None:
    """The documented finding, on the committed sessions: with the one-token warm-up only, a server run's first long
    prefill took 1.65-2.11x the fit in these three (median over a session's ten server runs; 1.33-2.11x over the twelve
    such sessions) where its later ones took ~1.0x; with the long prompts it takes what the later ones do."""
    first, later = _first_long_prefill_ratios(_session(session))
    assert 0.9 <= later <= 1.1
    if warm:
        assert abs(first / later - 1) < 0.1
    else:
        assert first / later > 1.3


def _offline_first_step_ratio(root: Path) -> float:
    """A committed session's offline sweep runs (those without preemption, which the log alone reconstructs): the
    median over runs of the first step's recorded time / the session's offline fit, over the same ratio's median
    over the run's steps, so the host's level in each run cancels (docs/calibration-sessions.md, "An offline
    warm-up")."""
    fit = load_profile(str(root / "cpu-tiny-llama.yaml")).spec.step_time
    firsts = []
    for run in sorted(root.glob("calibration/sweep-*")):
        rec = load_recorded_run(run)
        if rec.run.mode != "offline" or rec.metric("num_preemptions"):
            continue
        ratios = _step_ratios(fit, rec)[1]
        firsts.append(ratios[0] / np.median(ratios))
    assert len(firsts) == 6
    return float(np.median(firsts))


@pytest.mark.parametrize(("session", "warm"), [("freshhost2", False), ("freshhost3", False), ("interleaved4", False),
                                               ("prefillwarm2", False), ("prefillwarm3", False),
                                               ("offlinewarm", True), ("offlinewarm2", True)])
def test_an_offline_runs_first_step_runs_at_its_level_only_after_the_offline_warm_up(session: str, warm: bool) -> None:
    """The documented finding: without a warm-up an offline run's first step took 1.43-2.41x its run's level in these
    five sessions (the median over a session's six reconstructable sweep runs; 1.13-2.41x over all nineteen before
    the offline warm-up); with the warm-up and the rehearsal of the run's opening 0.91 and 1.10x in the two sessions
    since (a first step after the scheduler's pause still runs a few ms long on some hosts: docs/calibration.md,
    "An offline warm-up")."""
    first = _offline_first_step_ratio(_session(session))
    if warm:
        assert first < 1.2
    else:
        assert first > 1.4
