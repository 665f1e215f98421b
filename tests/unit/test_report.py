"""benchmarks/report.py's tables: the Markdown every benchmark prints and the README quotes."""

from __future__ import annotations

from benchmarks import report


def test_markdown_table_aligns_columns_and_keeps_cells_as_given() -> None:
    table = report.markdown_table([("name", "l"), ("tok/s", "r")], [["a", "1.0"], ["b | c", "-"]])
    assert table.splitlines() == ["| name | tok/s |", "|---|--:|", "| a | 1.0 |", "| b | c | - |"]
    assert report.markdown_table([("only", "r")], []).splitlines() == ["| only |", "|--:|"]


def test_results_table_formats_each_figure_and_marks_missing_ones() -> None:
    result = {"target": "frontend", "concurrency": 4, "requests": 10, "errors": 0, "output_tok_per_s": 12.345,
              "req_per_s": 1.234, "ttft_ms": {"p50": 1, "p90": 2, "p99": 3},
              "itl_ms": {"p50": 1.5, "p90": 2.5, "p99": None}, "e2e_ms": {"p50": 10, "p90": 20, "p99": 30},
              "output_tokens_per_request": 64.0}
    header, rule, row = report.results_table([result]).splitlines()
    assert header.count("|") == rule.count("|") == row.count("|") == 11
    assert row == "| frontend | 4 | 10 | 0 | 12.3 | 1.23 | 1 / 2 / 3 | 1.5 / 2.5 / - | 10 / 20 / 30 | 64.0 |"
