"""Comparing two runs' result tables value for value (not a test module)."""

from __future__ import annotations


def assert_same_tables(a, b, names: tuple[str, ...] = ("events", "levels", "requests")) -> None:  # noqa: ANN001
    """The named tables of two ``RunResult``s have the same schema, rows and values (NaN equal to NaN)."""
    for name in names:
        ta, tb = a.tables[name], b.tables[name]
        assert ta.schema == tb.schema and ta.num_rows == tb.num_rows, name
        for col in ta.column_names:
            assert all(x == y or (x != x and y != y)
                       for x, y in zip(ta.column(col).to_pylist(), tb.column(col).to_pylist())), (name, col)
