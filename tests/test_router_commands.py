"""``twin emulate`` and ``twin router`` as processes: loopback, /health, clean stop on SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from twin.router.local import free_ports, start_command, stop_command, wait_serving  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_emulate_and_router_commands_serve_and_stop_on_sigterm(tmp_path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("name: x\nworkload: {ignored: true}\npolicy:\n  router: {kind: llm_d_scorer}\n")
    keys = tmp_path / "KEYS.yaml"
    keys.write_text("keys:\n  sk-cmd-test-0001: {tenant: t1}\n")
    eport, rport = free_ports(2)
    elog, rlog = tmp_path / "emulate.log", tmp_path / "router.log"
    emu = start_command(["emulate", "--profile", "llama3-8b-bf16-tp1-h100", "--port", str(eport), "--max-model-len",
                         "2048", "--num-gpu-blocks", "256", "--block-size", "16", "--max-num-seqs", "8",
                         "--max-num-batched-tokens", "512"], elog, cwd=REPO)
    router = None
    try:
        wait_serving(emu, eport, elog, timeout_s=30.0)
        router = start_command(["router", "--scenario", str(scenario), "--keys", str(keys), "--upstream",
                                f"http://127.0.0.1:{eport}", "--port", str(rport), "--max-model-len", "2048",
                                "--scrape-interval-s", "0.2"], rlog, cwd=REPO)
        wait_serving(router, rport, rlog, timeout_s=30.0)
        conn = http.client.HTTPConnection("127.0.0.1", rport, timeout=30.0)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1] * 600, "max_tokens": 3}).encode(),
                     headers={"Authorization": "Bearer sk-cmd-test-0001"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        assert resp.status == 200 and body["usage"]["completion_tokens"] == 3
        text = get(eport, "/metrics")[1].decode()
        assert 'vllm:prompt_tokens_total{model_name="twin-model",engine="0"} 600.0' in text
        assert stop_command(router) == 0, rlog.read_text()
        assert stop_command(emu) == 0, elog.read_text()
        for p in (eport, rport):
            with pytest.raises(OSError):
                get(p, "/health")
    finally:
        for p in (router, emu):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def test_free_ports_are_distinct() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64


def test_wait_serving_wants_the_process_own_banner(tmp_path) -> None:
    """/health answering on the port is not enough: the process must have said it serves there (another process
    may hold a port that was free when it was drawn)."""
    from aiohttp import web

    from twin.router.local import LocalServers

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    servers = LocalServers()
    try:
        port = servers.start(app)  # someone else serves /health on the port
        log = tmp_path / "quiet.log"
        quiet = start_command(["--help"], log, cwd=REPO)  # exits without a banner
        with pytest.raises(RuntimeError, match="exited with 0"):
            wait_serving(quiet, port, log, timeout_s=30.0)
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], process_group=0)
        try:
            with pytest.raises(RuntimeError, match="not served after"):
                wait_serving(sleeper, port, log, timeout_s=1.0)
            log.write_text(f"twin emulate: x on http://127.0.0.1:{port} (blocks 1)\n")
            wait_serving(sleeper, port, log, timeout_s=5.0)  # banner and health: returns
        finally:
            assert stop_command(sleeper) == -signal.SIGTERM
    finally:
        servers.close()


def test_router_command_rejects_a_bad_policy_section(tmp_path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("policy:\n  router: {kind: prefix_afinity}\n")
    keys = tmp_path / "KEYS.yaml"
    keys.write_text("keys:\n  sk-cmd-test-0001: {tenant: t1}\n")
    done = subprocess.run([sys.executable, "-m", "twin", "router", "--scenario", str(scenario), "--keys", str(keys),
                           "--upstream", "http://127.0.0.1:9", "--port", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "prefix_affinity" in done.stderr  # the did-you-mean


PROBE = """
import sys
import twin.router.service, twin.router.keys
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("simpy", "pandas", "numpy") or m.startswith("twin.models"))
print(",".join(bad))
"""


def test_router_service_imports_no_simulator_modules() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout
