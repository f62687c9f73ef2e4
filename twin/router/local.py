"""Serving helpers: one blocking ``serve`` for the commands, ``LocalServers`` for tests and load tests, and the
helpers that start ``twin`` commands as processes and wait until each serves its port.

Both bind loopback by default and run aiohttp with ``handler_cancellation`` on, so a client that
disconnects cancels its handler (that is how cancellation reaches the upstream and the engine).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")


def serve(app: web.Application, *, host: str = "127.0.0.1", port: int, banner: str = "") -> None:
    """Serve until SIGTERM or SIGINT, then run the app's cleanup (aiohttp's ``run_app``)."""
    def _print(*_args: Any) -> None:
        if banner:
            print(banner, flush=True)

    web.run_app(app, host=host, port=port, handler_cancellation=True, print=_print, shutdown_timeout=5.0,
                access_log=None)


class LocalServers:
    """An event loop in a background thread hosting aiohttp apps on 127.0.0.1 (free ports by default)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="twin-local-servers", daemon=True)
        self._thread.start()
        self._runners: list[web.AppRunner] = []

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, app: web.Application, *, port: int = 0) -> int:
        """Start ``app`` (its startup hooks run here) and return the port it listens on."""
        async def _start() -> int:
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", port)
            await site.start()
            self._runners.append(runner)
            return int(runner.addresses[0][1])

        return self.call(_start())

    def stop(self, port: int) -> None:
        """Stop the app on ``port`` (its cleanup hooks run)."""
        async def _stop() -> None:
            for r in list(self._runners):
                if int(r.addresses[0][1]) == port:
                    self._runners.remove(r)
                    await r.cleanup()

        self.call(_stop())

    def close(self) -> None:
        async def _all() -> None:
            for r in reversed(self._runners):
                await r.cleanup()
            self._runners.clear()

        try:
            self.call(_all())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)
            self.loop.close()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now. Every socket is held until all are chosen: ports taken one at a
    time can repeat (the first is released before the second is drawn)."""
    import socket

    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def start_command(args: list[str], log_path: Path, *, cwd: Path | None = None) -> subprocess.Popen:
    """``python -m twin ARGS`` in its own process group, stdout and stderr to ``log_path``."""
    with open(log_path, "wb") as log:  # the child holds its own descriptor
        return subprocess.Popen([sys.executable, "-m", "twin", *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, process_group=0, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def wait_serving(proc: subprocess.Popen, port: int, log_path: Path, timeout_s: float = 60.0) -> None:
    """Return once ``proc`` (started by :func:`start_command`) serves on ``port``.

    Its banner in its log (``serve`` prints it once the socket is bound and SIGTERM is handled) is the proof
    that this process owns the port; /health answering 200 alone is not, since another process may hold a
    port that was free when it was drawn. Raises RuntimeError with the log's tail if the process exits or the
    time runs out.
    """
    import http.client
    import re

    deadline = time.monotonic() + timeout_s
    banner = re.compile(rb"http://\S*:%d(?!\d)" % port)

    def _fail(why: str) -> RuntimeError:
        return RuntimeError(f"{why}; its output:\n{log_path.read_bytes()[-4000:].decode(errors='replace')}")

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _fail(f"{' '.join(map(str, proc.args[2:]))} exited with {proc.returncode}")
        if banner.search(log_path.read_bytes()):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
                try:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        return
                finally:
                    conn.close()
            except OSError:
                pass
        time.sleep(0.1)
    raise _fail(f"port {port} not served after {timeout_s} s")


def stop_command(proc: subprocess.Popen, grace_s: float = 15.0) -> int | None:
    """SIGTERM, then SIGKILL the process group after ``grace_s``; the exit status SIGTERM gave (None if killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
        return None


class LocalFleet:
    """``n`` emulated replicas and one router in front of them, all in one :class:`LocalServers` loop."""

    def __init__(self, *, n: int, policy: dict[str, Any], keys: Any, config: Any = None, profile: str,
                 engine_overrides: dict[str, Any] | None = None, time_scale: float = 1.0) -> None:
        from twin.router.emulator import build_emulator
        from twin.router.service import RouterService

        self.servers = LocalServers()
        try:
            self.emulators = [build_emulator(profile=profile, engine_overrides=engine_overrides, time_scale=time_scale)
                              for _ in range(n)]
            self.emulator_ports = [self.servers.start(e.app()) for e in self.emulators]
            self.router = RouterService(policy=policy, keys=keys, config=config,
                                        upstreams=[f"http://127.0.0.1:{p}" for p in self.emulator_ports])
            self.router_port = self.servers.start(self.router.app())
        except BaseException:
            self.servers.close()
            raise

    def close(self) -> None:
        self.servers.close()
