"""Comments explain, they do not keep a diary: no dates, clock times, timings or machine names in the
package's or the tests' Python files. Measurements belong in benchmarks/results and docs/, which the
benchmark commands write."""

import re
from pathlib import Path

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


def test_no_dates_timings_or_machine_names_in_python_files():
    hits = []
    for folder in ("vanilla_transformer", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if DIARY.search(line) and not ALLOWED.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "numbers belong in benchmarks/results and docs/, not in code:\n" + "\n".join(hits)
