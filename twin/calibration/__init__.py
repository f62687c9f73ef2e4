"""Calibration against real engines: record vLLM runs (workloads, recorder, recorded-run reader).

Nothing here imports vLLM: the engine runs in its own virtual environment as a subprocess.
"""
