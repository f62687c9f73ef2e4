"""A bounded loopback load test: N concurrent streams for T seconds, through the router vs straight to the
emulators, reporting the router's added TTFT (p50/p99) and the streams it sustained.

Run: ``python -m twin.router.loadtest --replicas 4 --streams 16,64 --duration-s 15`` (or
``benchmarks/router_overhead.py``). It starts ``twin emulate`` x K and one ``twin router`` as
subprocesses on free loopback ports, drives them from this process with closed-loop streaming clients
(each sends its next request when the previous one ends), and stops them all at the end. Every prompt
is distinct (no prefix-cache hits), so direct and routed runs do the same engine work. Everything is
bounded: a phase stops issuing at ``duration_s`` and waits at most ``request_timeout_s`` for the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from twin.router.local import free_ports, start_command, stop_command, wait_serving

KEY = "sk-loadtest-000001"
IDLE_PROBE_S = 5.0


@dataclass
class PhaseResult:
    name: str
    streams: int
    duration_s: float
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0
    peak_streams: int = 0
    router_cpu_s: float = 0.0  # CPU seconds the router process used during the phase
    client_cpu_s: float = 0.0  # this process (the load generator)
    router_idle_cpu_s: float = 0.0  # what the router would have used idle (scrapes) over the same time
    loadavg_1m: float = 0.0  # the host's 1-minute load average at the end of the phase
    emulators_cpu_s: float = 0.0

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        v = sorted(values)
        return v[min(len(v) - 1, int(q * len(v)))]


async def _phase(name: str, targets: list[str], *, streams: int, duration_s: float, prompt_tokens: int,
                 max_tokens: int, request_timeout_s: float, seed: int) -> PhaseResult:
    res = PhaseResult(name, streams, duration_s)
    loop = asyncio.get_running_loop()
    t_end = loop.time() + duration_s
    active = 0
    counter = 0

    async def worker(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal active, counter
        url = targets[i % len(targets)] + "/v1/completions"
        while loop.time() < t_end:
            counter += 1
            base = (seed * 7_919 + counter * 104_729) % 25_000
            body = {"prompt": [(base + k) % 32000 for k in range(prompt_tokens)], "max_tokens": max_tokens,
                    "stream": True}
            t0 = loop.time()
            first = None
            got = 0
            active += 1
            res.peak_streams = max(res.peak_streams, active)
            try:
                async with session.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"},
                                        timeout=aiohttp.ClientTimeout(total=request_timeout_s)) as resp:
                    if resp.status != 200:
                        res.errors += 1
                        await resp.read()
                        continue
                    done = False
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            break
                        n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                        if n and first is None:
                            first = loop.time() - t0
                        got += n
                    if not done or got != max_tokens or first is None:
                        res.errors += 1
                        continue
                res.ttft_s.append(first)
                res.e2e_s.append(loop.time() - t0)
                res.tokens += got
            except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError):
                res.errors += 1
            finally:
                active -= 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(i, session) for i in range(streams)))
    return res


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux); 0 elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace) -> list[tuple[PhaseResult, PhaseResult]]:
    procs: list[subprocess.Popen] = []
    out: list[tuple[PhaseResult, PhaseResult]] = []
    with tempfile.TemporaryDirectory(prefix="twin-loadtest-") as tmp:
        scenario, keys = Path(tmp) / "scenario.yaml", Path(tmp) / "KEYS.yaml"
        scenario.write_text(f"policy:\n  router: {{kind: {args.policy}}}\n")
        keys.write_text(f"keys:\n  {KEY}: {{tenant: loadtest}}\n")
        try:
            *ports, rport = free_ports(args.replicas + 1)
            logs = [Path(tmp) / f"emulate-{i}.log" for i in range(args.replicas)] + [Path(tmp) / "router.log"]
            for p, log in zip(ports, logs[:-1], strict=True):
                procs.append(start_command(["emulate", "--profile", args.profile, "--port", str(p),
                                            "--max-model-len", str(args.max_model_len)], log))
            ups = [x for p in ports for x in ("--upstream", f"http://127.0.0.1:{p}")]
            procs.append(start_command(["router", "--scenario", str(scenario), "--keys", str(keys), "--port",
                                        str(rport), "--max-model-len", str(args.max_model_len), *ups], logs[-1]))
            for p, proc, log in zip([*ports, rport], procs, logs, strict=True):
                wait_serving(proc, p, log)
            direct = [f"http://127.0.0.1:{p}" for p in ports]
            routed = [f"http://127.0.0.1:{rport}"]
            kw = dict(duration_s=args.duration_s, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                      request_timeout_s=args.request_timeout_s)
            router_pid, emu_pids = procs[-1].pid, [p.pid for p in procs[:-1]]
            c0 = _cpu_s(router_pid)
            time.sleep(IDLE_PROBE_S)  # the router's idle CPU (scrapes), subtracted from its per-request cost
            idle_cpu_per_s = (_cpu_s(router_pid) - c0) / IDLE_PROBE_S
            for n in args.streams:
                pair = []
                for name, targets, seed in (("direct", direct, 1), ("router", routed, 2)):
                    c0, e0, l0 = _cpu_s(router_pid), sum(map(_cpu_s, emu_pids)), time.process_time()
                    res = asyncio.run(_phase(name, targets, streams=n, seed=seed, **kw))
                    res.client_cpu_s = time.process_time() - l0
                    res.loadavg_1m = os.getloadavg()[0]
                    res.router_cpu_s, res.emulators_cpu_s = _cpu_s(router_pid) - c0, sum(map(_cpu_s, emu_pids)) - e0
                    res.router_idle_cpu_s = idle_cpu_per_s * args.duration_s
                    pair.append(res)
                d, r = pair
                out.append((d, r))
                _report(d, r)
        finally:
            for proc in procs:
                stop_command(proc, grace_s=10.0)
    return out


def _report(d: PhaseResult, r: PhaseResult) -> None:
    ms = 1000.0
    print(f"streams={d.streams} duration={d.duration_s:.0f}s")
    for x in (d, r):
        n = len(x.ttft_s)
        print(f"  {x.name:6s}: {n} requests ({n / x.duration_s:.1f}/s, {x.tokens / x.duration_s:.0f} tok/s), "
              f"errors {x.errors}, peak concurrent streams {x.peak_streams}, "
              f"TTFT p50 {x.pct(x.ttft_s, .5) * ms:.1f} ms p99 {x.pct(x.ttft_s, .99) * ms:.1f} ms, "
              f"E2E p50 {x.pct(x.e2e_s, .5) * ms:.1f} ms; CPU s: emulators {x.emulators_cpu_s:.1f}, "
              f"router {x.router_cpu_s:.1f}, client {x.client_cpu_s:.1f}; host load {x.loadavg_1m:.1f}")
    print(f"  router overhead: TTFT p50 {(r.pct(r.ttft_s, .5) - d.pct(d.ttft_s, .5)) * ms:+.1f} ms, "
          f"p99 {(r.pct(r.ttft_s, .99) - d.pct(d.ttft_s, .99)) * ms:+.1f} ms; "
          f"E2E p50 {(r.pct(r.e2e_s, .5) - d.pct(d.e2e_s, .5)) * ms:+.1f} ms; "
          f"throughput ratio router/direct {len(r.ttft_s) / max(1, len(d.ttft_s)):.2f}; "
          f"router CPU {(r.router_cpu_s - r.router_idle_cpu_s) / max(1, len(r.ttft_s) + r.errors) * ms:.2f} ms per "
          f"request net of idle scraping "
          f"(host: {os.cpu_count()} CPUs shared by client, router and emulators)", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--duration-s", type=float, default=15.0)
    p.add_argument("--profile", default="llama3-8b-bf16-tp1-h100")
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    args = p.parse_args(argv)
    if args.duration_s > 600 or max(args.streams) > 2000:
        p.error("bounded load only: duration-s <= 600 and streams <= 2000")
    return args


if __name__ == "__main__":
    run(parse_args())
