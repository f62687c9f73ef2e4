"""Are two run folders the same results? Every Parquet table value for value (NaN equals NaN, so a column
of NaNs compares equal) and ``summary.json`` without its ``wall_s`` fields. Exit status 0 when identical.

A speed-up must leave results unchanged: run a scenario on fixed seeds before and after, then

    python -m benchmarks.identical runs/before runs/after
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq


def strip_wall(o):
    """``o`` (a summary) without its ``wall_s`` fields, at any depth."""
    if isinstance(o, dict):
        return {k: strip_wall(v) for k, v in o.items() if k != "wall_s"}
    if isinstance(o, list):
        return [strip_wall(v) for v in o]
    return o


def _same(x, y) -> bool:
    return x == y or (x != x and y != y)  # NaN == NaN


def compare(a: Path, b: Path) -> list[str]:
    """Lines describing each table and the summary; a line containing DIFFERENT marks a difference."""
    out = []
    for f in sorted(a.glob("*.parquet")):
        other = b / f.name
        if not other.exists():
            out.append(f"{f.name}: DIFFERENT (missing in {b})")
            continue
        ta, tb = pq.read_table(f), pq.read_table(other)
        eq = ta.schema == tb.schema and ta.num_rows == tb.num_rows and all(
            all(_same(x, y) for x, y in zip(ta.column(c).to_pylist(), tb.column(c).to_pylist()))
            for c in ta.column_names)
        out.append(f"{f.name}: {ta.num_rows} rows {'identical' if eq else 'DIFFERENT'}")
    sa = strip_wall(json.loads((a / "summary.json").read_text()))
    sb = strip_wall(json.loads((b / "summary.json").read_text()))
    out.append(f"summary.json: {'identical' if sa == sb else 'DIFFERENT'}")
    if sa != sb:
        out += [f"  {k}: {sa[k]!r} vs {sb.get(k)!r}" for k in sa if sa[k] != sb.get(k)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    lines = compare(args.before, args.after)
    print("\n".join(lines))
    return 1 if any("DIFFERENT" in x for x in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
