"""The server recorder's check of vLLM's start-up line "KV cache size: N tokens" (``_vllm_common.logged_kv_tokens``)
against the values real engines logged: N counts requests of ``max_model_len``, so it is ``blocks x block_size`` only
where ``max_model_len`` is a multiple of the block size (sweep-server-context's 2,112 is not)."""

from __future__ import annotations

import json
from pathlib import Path

from twin.calibration._vllm_common import logged_kv_tokens
from twin.paths import REPO_ROOT


def _logged_runs() -> list[dict]:
    runs = []
    for p in sorted((REPO_ROOT / "tests" / "fixtures" / "calibration").glob("*/**/run.json")):
        run = json.loads(Path(p).read_text())
        if "kv_cache_size_tokens_logged" in run.get("workload", {}):
            runs.append(run)
    return runs


def test_logged_kv_size_of_every_committed_server_run() -> None:
    runs = _logged_runs()
    assert len(runs) >= 300
    # sweep-server-context (max_model_len 2,112) logs fewer tokens than its blocks hold
    assert any(r["max_model_len"] % r["block_size"] for r in runs)
    for r in runs:
        assert logged_kv_tokens(r["num_gpu_blocks"], r["block_size"], r["max_model_len"]) == \
            r["workload"]["kv_cache_size_tokens_logged"], r["workload"]["name"]


def test_logged_kv_size_formula() -> None:
    assert logged_kv_tokens(341, 128, 1024) == 341 * 128
    assert logged_kv_tokens(341, 128, 2112) == 42364  # 341 / 17 requests of 2,112 tokens
    assert logged_kv_tokens(1024, 128, 1152) == 1024 * 128
