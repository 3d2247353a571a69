"""docs/benchmarks.md is generated from the current benchmark report, and benchmarks/results holds one report per benchmark."""

import re

import pytest

from benchmarks.__main__ import DOCS_PAGE, RESULTS, ROOT, current_report, main, render_docs


def test_docs_page_is_the_rendering_of_the_current_report(tmp_path):
    report = current_report(RESULTS, "benchmarks")
    page = render_docs(report, tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    assert DOCS_PAGE.read_text(encoding="utf-8") == page  # regenerate: python -m benchmarks --docs-from REPORT.json
    assert f"from {report.relative_to(ROOT).as_posix()}:" in page
    for heading in ("## Method", "## Current results", "### Training", "### Generation", "## How to reproduce"):
        assert f"\n{heading}" in page
    for link in re.findall(r"\]\(\.\./([^)]+)\)", page):
        assert (ROOT / link).is_file(), link


def test_results_hold_only_the_current_report_of_each_benchmark():
    stems = {path.stem for path in RESULTS.iterdir() if path.suffix in (".json", ".md")}
    for prefix in ("benchmarks", "score-functions", "big-corpus"):
        current = current_report(RESULTS, prefix)
        assert current is not None, prefix
        assert {stem for stem in stems if stem.startswith(f"{prefix}-")} == {current.stem}


def test_docs_from_refuses_a_report_that_is_not_there(capsys):
    with pytest.raises(SystemExit):
        main(["--docs-from", str(RESULTS / "benchmarks-1999-01-01-cpu.json")])
    assert "--docs-from: no report at" in capsys.readouterr().err
