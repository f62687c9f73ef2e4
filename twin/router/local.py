"""Serving helpers: one blocking ``serve`` for the commands, and ``LocalServers`` for tests and load tests.

Both bind loopback by default and run aiohttp with ``handler_cancellation`` on, so a client that
disconnects cancels its handler (that is how cancellation reaches the upstream and the engine).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
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
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
