"""The recorder keeps the server's front end off the model's cores (``_vllm_common.pin_front_end``).

No vLLM here: a stand-in process group plays the engine (one process whose main thread is bound to one CPU, as
vLLM's CPU worker binds its threads, and one unbound helper thread) and the API server (an unbound process).
Everything runs in a child interpreter, since the function also pins the calling process (the recorder's client).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(r"""
    import json, os, subprocess, sys, time
    from twin.calibration._vllm_common import pin_front_end, _threads

    allowed = sorted(os.sched_getaffinity(0))
    model_cpu = allowed[0]
    worker = ("import os, threading, time\n"  # a helper thread started before the main thread binds itself
              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
              f"os.sched_setaffinity(0, {{{model_cpu}}})\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    server = "import time; print('ready', flush=True); time.sleep(60)"
    lead = subprocess.Popen([sys.executable, "-c", server], stdout=subprocess.PIPE, text=True, process_group=0)
    eng = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True,
                           process_group=lead.pid)
    try:
        for p in (lead, eng):
            assert p.stdout.readline().strip() == "ready"
        info = pin_front_end(lead.pid)
        aff = lambda pid: {str(t): sorted(os.sched_getaffinity(t)) for t in _threads(pid)}
        print(json.dumps({"allowed": allowed, "model_cpu": model_cpu, "info": info, "lead": aff(lead.pid),
                          "engine": aff(eng.pid), "engine_main": eng.pid, "self": aff(os.getpid())}))
    finally:
        for p in (lead, eng):
            p.kill()
            p.wait()
""")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least two usable CPUs")
def test_front_end_threads_leave_the_model_cpu() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    rest = [c for c in r["allowed"] if c != r["model_cpu"]]
    info = r["info"]
    assert info["pinned"] is True
    assert info["engine_cpus"] == [r["model_cpu"]] and info["front_end_cpus"] == rest
    assert info["processes"] == 2
    # the bound thread keeps its CPU; every other thread, the group's and the caller's, moves to the rest
    assert r["engine"].pop(str(r["engine_main"])) == [r["model_cpu"]]
    moved = list(r["engine"].values()) + list(r["lead"].values()) + list(r["self"].values())
    assert moved and all(a == rest for a in moved)
    assert info["threads_pinned"] == len(moved)


def test_nothing_is_pinned_without_a_bound_thread() -> None:
    """No thread of the group is bound (e.g. ``VLLM_CPU_OMP_THREADS_BIND=nobind``): leave everything as it is."""
    script = textwrap.dedent(r"""
        import json, os, subprocess, sys
        from twin.calibration._vllm_common import pin_front_end
        p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, process_group=0)
        try:
            assert p.stdout.readline().strip() == "ready"
            before = sorted(os.sched_getaffinity(0))
            info = pin_front_end(p.pid)
            print(json.dumps({"info": info, "same": sorted(os.sched_getaffinity(0)) == before}))
        finally:
            p.kill()
            p.wait()
    """)
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs CPU affinity")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["info"]["pinned"] is False and r["info"]["engine_cpus"] == [] and r["same"]


CORE_SCRIPT = textwrap.dedent(r"""
    import json, os, subprocess, sys
    from twin.calibration._vllm_common import pin_front_end, _threads

    allowed = sorted(os.sched_getaffinity(0))
    model_cpu = allowed[0]
    worker = (f"import os, time; os.sched_setaffinity(0, {{{model_cpu}}}); print('ready', flush=True); "
              "time.sleep(60)")
    # the engine core: a process with a helper thread that starts the worker as its child, as vLLM's multiprocess
    # executor does, and waits
    core = ("import subprocess, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE, text=True)\n"
            "assert w.stdout.readline().strip() == 'ready'\n"
            "print(w.pid, flush=True)\n"
            "time.sleep(60)\n")
    server = "import time; print('ready', flush=True); time.sleep(60)"
    lead = subprocess.Popen([sys.executable, "-c", server], stdout=subprocess.PIPE, text=True, process_group=0)
    eng = subprocess.Popen([sys.executable, "-c", core], stdout=subprocess.PIPE, text=True, process_group=lead.pid)
    worker_pid = None
    try:
        assert lead.stdout.readline().strip() == "ready"
        worker_pid = int(eng.stdout.readline())
        info = pin_front_end(lead.pid, engine_core=sys.argv[1])
        aff = lambda pid: sorted({tuple(sorted(os.sched_getaffinity(t))) for t in _threads(pid)})
        print(json.dumps({"allowed": allowed, "model_cpu": model_cpu, "info": info, "lead": aff(lead.pid),
                          "core": aff(eng.pid), "core_pid": eng.pid, "worker": aff(worker_pid),
                          "self": aff(os.getpid())}))
    finally:
        if worker_pid:
            os.kill(worker_pid, 9)  # it holds the caller's stderr open
        for p in (eng, lead):
            p.kill()
            p.wait()
""")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least two usable CPUs")
@pytest.mark.parametrize("engine_core", ["model", "front-end"])
def test_engine_core_goes_where_asked(engine_core: str) -> None:
    """``engine_core="model"``: the process that started the bound worker is bound to the model's CPU with it; the API
    server and the client still leave it. ``"front-end"`` (the default): the engine core goes with the front end."""
    out = subprocess.run([sys.executable, "-c", CORE_SCRIPT, engine_core], capture_output=True, text=True, timeout=60,
                         check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    model, rest = [r["model_cpu"]], [c for c in r["allowed"] if c != r["model_cpu"]]
    assert r["info"]["pinned"] is True and r["info"]["engine_core"] == engine_core
    assert r["worker"] == [model] and r["lead"] == [rest] and r["self"] == [rest]
    if engine_core == "model":
        assert r["info"]["engine_core_pids"] == [r["core_pid"]] and r["info"]["engine_core_threads"] >= 2
        assert r["core"] == [model]
    else:
        assert "engine_core_pids" not in r["info"]
        assert r["core"] == [rest]


def test_an_unknown_engine_core_place_is_refused() -> None:
    from twin.calibration._vllm_common import pin_front_end
    from twin.calibration.record import record_workload
    from twin.calibration.workload_sets import get_workload

    with pytest.raises(ValueError, match="engine_core"):
        pin_front_end(os.getpgid(0), engine_core="gpu")
    with pytest.raises(ValueError, match="front-end, model"):
        record_workload(get_workload("server-prefix"), Path("unused"), engine_core="anywhere")
