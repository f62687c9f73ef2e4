"""A production router and an engine emulator that speak the OpenAI API (optional extra ``router``).

* :mod:`twin.router.service` — an asynchronous OpenAI-compatible proxy in front of vLLM servers that
  places every request with the same :mod:`twin.policies` policy the twin simulates.
* :mod:`twin.router.emulator` — an OpenAI-compatible server whose timing comes from twin's ``Engine``
  and an engine profile, in real time, with vLLM's metric names.
* :mod:`twin.router.loadtest` — a bounded loopback load test (router vs direct).

Importing this package is cheap; aiohttp is imported by the modules that serve or send requests.
See ``docs/router.md``.
"""
