"""BENCHMARKS.md, the current-results page, cites only results files that exist, and every
figure it states comes with a command in its row (docs: the page's method paragraph)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "BENCHMARKS.md"
CITED = re.compile(r"benchmarks/results/[\w.{},-]+")


def expand(pattern: str) -> list[str]:
    """Shell brace expansion, as the page writes runs of files (`run{1,2}`)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def test_expand_writes_out_every_combination() -> None:
    assert expand("a_{x,y}_run{1,2}.json") == [
        "a_x_run1.json",
        "a_x_run2.json",
        "a_y_run1.json",
        "a_y_run2.json",
    ]


def test_every_cited_results_file_exists() -> None:
    cited = {path for match in CITED.findall(PAGE.read_text()) for path in expand(match)}
    assert cited, "the page cites no results file"
    missing = sorted(path for path in cited if not (ROOT / path).is_file())
    assert missing == []


def test_every_table_row_with_a_figure_has_a_command() -> None:
    rows = [
        line
        for line in PAGE.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| ---") and "**" in line
    ]
    assert rows
    # A row may name the commands of the rows above it ("the two commands above").
    without = [
        row[:80]
        for row in rows
        if "`" not in row.split("|")[2] and "commands above" not in row.split("|")[2]
    ]
    assert without == []
