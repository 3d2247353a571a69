"""Comments explain, they do not keep a diary: no dates, clock times, timings or machine names in the
package's or the tests' Python files. Measurements belong in benchmarks/results and docs/, which the
benchmark commands write. The pages (README.md, docs/*.md) describe the design as it is: no working diary,
issue numbers, commit hashes or dates; those stay in the dated reports of benchmarks/results/. Neither the
package nor the tests name issues: a test says what it checks and why, which a reader can act on."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIARY = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"  # a date
    r"|\b\d{1,2}:\d\d(:\d\d)? ?UTC\b"  # a clock time
    r"|\bZen ?\d\b|\bEPYC\b|\bXeon\b"  # a machine
    r"|[Mm]easured (on|at|here)\b"  # a measurement's diary
    r"|\b\d+(\.\d+)? ?(ms|s|seconds|minutes) (instead of|vs\.?|against)\b"  # a timing
    r"|\b\d[\d,.]* (tokens|sentences)/s\b"  # a throughput
    r"|\b\d+(\.\d+)? ?% (faster|slower|fewer|more|less)\b"  # a speed-up
    r"|#.*\btook (about )?\d[\d.,]*([-–]\d[\d.,]*)? ?(ms|s|seconds|minutes)\b"  # a timing in a comment
)
# Code that formats the current time (a lock file's holder) is not a diary.
ALLOWED = re.compile(r"strftime|%Y-%m-%d")


# "Issue #63", "issue 5", "(#46)", "#54:"; not a link's anchor or an HTML entity.
ISSUE = r"(?<![\w/&])#\d+\b|\bissues? ?#?\d+"


def python_lines():
    """(path, line number, line) of every Python file of the package, the benchmarks and the tests but this one."""
    for folder in ("vanilla_transformer", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != Path(__file__).resolve():
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    yield path.relative_to(ROOT), number, line


def test_no_dates_timings_or_machine_names_in_python_files():
    hits = [f"{path}:{number}: {line.strip()}" for path, number, line in python_lines()
            if DIARY.search(line) and not ALLOWED.search(line)]
    assert not hits, "numbers belong in benchmarks/results and docs/, not in code:\n" + "\n".join(hits)


def test_no_issue_numbers_in_python_files():
    hits = [f"{path}:{number}: {line.strip()}" for path, number, line in python_lines()
            if re.search(ISSUE, line, re.IGNORECASE)]
    assert not hits, "say what is checked and why, not which issue asked for it:\n" + "\n".join(hits)


def test_reports_are_named_by_their_topic_not_an_issue():
    names = sorted(path.name for path in (ROOT / "benchmarks" / "results").iterdir()
                   if re.search(ISSUE, path.name, re.IGNORECASE))
    assert not names, "name a report for what it measures (a reader finds it by topic):\n" + "\n".join(names)


# A test's heading or comment states the rule it guards: "row 7" keys it to a table the repository does not hold,
# and "Before: ..." tells what earlier code did, which a reader of the test cannot act on.
TEST_HISTORY = re.compile(r"^\s*# -+ rows? \d+\b|(#|\"\"\").*\bBefore:")


def test_tests_state_the_rule_they_guard_not_its_history():
    hits = [f"{path}:{number}: {line.strip()}" for path, number, line in python_lines() if TEST_HISTORY.search(line)]
    assert not hits, "say the rule the test guards, not a table row or what the code did before:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", ["# --- row 7: the beam count has a bound ---", "# --- rows 3 and 5: serve ---",
                                  '    """Before: N lines per input and no index."""', "    # Before: a traceback.",
                                  "        # The same command again. Before: both ran."])
def test_the_history_rule_finds_each_form(line):
    assert TEST_HISTORY.search(line), line


@pytest.mark.parametrize("line", ["# --- the JSON endpoint: POST /v1/translate ---", "    # a side is missing (rows 2, 4)",
                                  '    assert "row 3 holds int 5" in result.stderr', "    # Refused before the work."])
def test_the_history_rule_leaves_rules_alone(line):
    assert not TEST_HISTORY.search(line), line


@pytest.mark.parametrize("line", ["Issue #63, every stream", "(#46)", "issues #18, #47", "# #54: one line", "issue 5"])
def test_the_issue_rule_finds_each_way_of_naming_one(line):
    assert re.search(ISSUE, line, re.IGNORECASE), line


@pytest.mark.parametrize("line", ["attention.md#the-neuron-view", "&#39;", "color #1f2937", "case 7's lock", "5 issues"])
def test_the_issue_rule_leaves_code_alone(line):
    assert not re.search(ISSUE, line, re.IGNORECASE), line


# The pages describe the design as it is. A record keeps its date, machine and hashes in a dated report under
# benchmarks/results/, which a page may link or name: its path is the only place a page may hold a date.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPORT_PATH = re.compile(r"benchmarks/results/[\w.-]+")
PAGE_DIARY = re.compile(
    r"\bsessions?\b|\btoday('s)?\b"  # a working diary's words
    rf"|{ISSUE}"  # an issue number
    # A commit hash: a word of 7-40 hex digits mixing digits and letters. Prose has no such words, and unlike
    # asking git, the rule holds in a shallow clone or an unpacked sdist, and for another repository's commits.
    r"|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
    r"|\b20\d\d-\d\d-\d\d\b|\b\d{1,2}:\d\d ?UTC\b"  # a date, a clock time
    r"|\b(January|February|March|April|May|June|July|August|September|October|November|December) 20\d\d\b",
    re.IGNORECASE,
)
# In the README, a user's page, a machine is named only beside the dated report its numbers come from.
MACHINE = re.compile(r"\bZen ?\d\b|\bEPYC\b|\bXeon\b|\bGraviton\d?\b|\bApple M\d\b")


def diary_lines(text: str) -> list[tuple[int, str]]:
    return [(number, line) for number, line in enumerate(text.splitlines(), 1)
            if PAGE_DIARY.search(REPORT_PATH.sub("", line))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_describe_the_design_as_it_is(page):
    hits = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in diary_lines(page.read_text(encoding="utf-8"))]
    assert not hits, "a dated record belongs in benchmarks/results/, linked from the page:\n" + "\n".join(hits)


def test_the_readme_names_a_machine_only_beside_its_dated_report():
    paragraphs = (ROOT / "README.md").read_text(encoding="utf-8").split("\n\n")
    unlinked = [p for p in paragraphs if MACHINE.search(p) and not re.search(r"\]\(benchmarks/results/[\w.-]+\)", p)]
    assert not unlinked, "README.md names a machine without linking its report:\n" + "\n---\n".join(unlinked)


@pytest.mark.parametrize("line", [
    "the reorganisation of this session", "Today's default", "as #45 asked", "see issue 52", "code 46f1caf",
    "(2026-11-26, AMD EPYC)", "v5 ran 11:22 UTC", "measured in November 2026", "from commit 3aa6e93d0c",
])
def test_the_page_rule_finds_each_kind_of_diary(line):
    assert diary_lines(line), line


@pytest.mark.parametrize("line", [
    "[the report](../benchmarks/results/tuning-2026-11-24-cpu.md)", "attention.md#the-neuron-view",
    "a 2-core AMD EPYC, Zen 3", "GNMT α 0.6 (Wu et al. 2016)", "d_model 192, 3,455 steps", "deadbeef", "1234567",
    "CUDA 12.8, torch 2.13.0",
])
def test_the_page_rule_leaves_the_design_alone(line):
    assert not diary_lines(line), line
