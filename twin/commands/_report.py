"""What ``twin calibrate --cross-validate`` and ``twin fidelity`` share: build a report, print its table, and
write it as JSON on request; a bad input prints one line naming the command and exits 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def print_report(command: str, build: Callable[[], dict[str, Any]], table: Callable[[dict[str, Any]], str],
                 json_path: Path | None, errors: tuple[type[BaseException], ...]) -> int:
    from twin.results import dumps, write_text_atomic

    try:
        report = build()
    except errors as exc:
        print(f"twin {command}: {exc}", file=sys.stderr)
        return 2
    print(table(report))
    if json_path is not None:
        write_text_atomic(json_path, dumps(report))
        print(f"wrote {json_path}")
    return 0
