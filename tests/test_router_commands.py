"""``twin emulate`` and ``twin router`` as processes: loopback, /health, clean stop on SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from twin.router.local import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if get(port, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"port {port} never became healthy")


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "twin", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, process_group=0,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_emulate_and_router_commands_serve_and_stop_on_sigterm(tmp_path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("name: x\nworkload: {ignored: true}\npolicy:\n  router: {kind: llm_d_scorer}\n")
    keys = tmp_path / "KEYS.yaml"
    keys.write_text("keys:\n  sk-cmd-test-0001: {tenant: t1}\n")
    eport, rport = free_port(), free_port()
    emu = start(["emulate", "--profile", "llama3-8b-bf16-tp1-h100", "--port", str(eport), "--max-model-len", "2048",
                 "--num-gpu-blocks", "256", "--block-size", "16", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "512"])
    router = None
    try:
        wait_healthy(eport, emu)
        router = start(["router", "--scenario", str(scenario), "--keys", str(keys), "--upstream",
                        f"http://127.0.0.1:{eport}", "--port", str(rport), "--max-model-len", "2048",
                        "--scrape-interval-s", "0.2"])
        wait_healthy(rport, router)
        conn = http.client.HTTPConnection("127.0.0.1", rport, timeout=30.0)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1] * 600, "max_tokens": 3}).encode(),
                     headers={"Authorization": "Bearer sk-cmd-test-0001"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        assert resp.status == 200 and body["usage"]["completion_tokens"] == 3
        text = get(eport, "/metrics")[1].decode()
        assert 'vllm:prompt_tokens_total{model_name="twin-model",engine="0"} 600.0' in text
        assert stop(router) == 0
        assert stop(emu) == 0
        for p in (eport, rport):
            with pytest.raises(OSError):
                get(p, "/health")
    finally:
        for p in (router, emu):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
            if p is not None and p.stdout is not None:
                p.stdout.close()


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
