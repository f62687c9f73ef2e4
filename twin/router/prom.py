"""A minimal Prometheus text exposition (counters, gauges, histograms) and a parser for scrapes.

Small on purpose: the router and the emulator export a handful of series, and the core stays free of a
metrics client dependency. Label values are escaped as the text format requires.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """Exposed as ``<name>_total``."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        for labels, v in sorted(self.values.items()):
            lines.append(f"{self.name}_total{_labels(self.labelnames, labels)} {_num(v)}")
        return lines


class Gauge(_Metric):
    """Set values, or a callback read at exposition time (``fn`` returns ``{labels: value}``)."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                 fn: Callable[[], dict[tuple[str, ...], float]] | None = None) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[tuple[str, ...], float] = {}
        self.fn = fn

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = float(value)

    def render(self) -> list[str]:
        values = self.fn() if self.fn is not None else self.values
        lines = self.header()
        for labels, v in sorted(values.items()):
            lines.append(f"{self.name}{_labels(self.labelnames, labels)} {_num(v)}")
        return lines


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self.series: dict[tuple[str, ...], list[float]] = {}  # bucket counts (non-cumulative), then sum

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.setdefault(labels, [0.0] * (len(self.buckets) + 1))
        for i, b in enumerate(self.buckets):
            if value <= b:
                s[i] += 1
                break
        s[-1] += value

    def render(self) -> list[str]:
        lines = self.header()
        for labels, s in sorted(self.series.items()):
            cum = 0.0
            for b, c in zip(self.buckets, s, strict=False):
                cum += c
                le = 'le="' + _num(b) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, labels, le)} {_num(cum)}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, labels)} {_num(s[-1])}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, labels)} {_num(cum)}")
        return lines


M = TypeVar("M", bound=_Metric)


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: M) -> M:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines.extend(m.render())  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def parse_exposition(text: str) -> dict[str, float]:
    """Sample name (labels dropped) -> value summed over its label sets (one engine per server).

    Raises ``ValueError`` on a line that is not ``name[{labels}] value [timestamp]``.
    """
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            name_part, rest = line.split("{", 1)[0], line.rsplit("}", 1)[1]
        else:
            name_part, _, rest = line.partition(" ")
        fields = rest.split()
        if not name_part or not fields:
            raise ValueError(f"not an exposition line: {raw[:200]!r}")
        out[name_part.strip()] = out.get(name_part.strip(), 0.0) + float(fields[0])
    return out
