"""The package stays small enough to change: no function over 50 lines (from its `def` to its last line,
decorators aside, docstring included; the config's `__init__` aside, long by transformers' convention) and no command-line module over 300 lines. Read from the source
with `ast`; nothing is imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vanilla_transformer"
MAX_FUNCTION_LINES = 50
MAX_CLI_FILE_LINES = 300
# A config's __init__ takes every field as a keyword with its default and sets it on its own line, as MarianConfig
# does on the transformers versions we support: long by convention, and one line per field is the plain reading.
CONVENTIONAL = {"vanilla_transformer/modeling/configuration_vanilla_transformer.py": {"__init__"}}


def function_lengths(path: Path):
    """(line, name, length) of every function and method in `path`, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.lineno, node.name, node.end_lineno - node.lineno + 1


def test_no_function_over_50_lines():
    long = [f"{path.relative_to(ROOT)}:{line} {name} is {length} lines"
            for path in sorted(PACKAGE.rglob("*.py"))
            for line, name, length in function_lengths(path)
            if length > MAX_FUNCTION_LINES and name not in CONVENTIONAL.get(str(path.relative_to(ROOT)), ())]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split each by job):\n" + "\n".join(long)


def test_no_cli_file_over_300_lines():
    long = [f"{path.relative_to(ROOT)} is {length} lines"
            for path in sorted((PACKAGE / "cli").rglob("*.py"))
            if (length := len(path.read_text(encoding="utf-8").splitlines())) > MAX_CLI_FILE_LINES]
    assert not long, f"command-line modules over {MAX_CLI_FILE_LINES} lines:\n" + "\n".join(long)


def test_the_measures_count_what_they_say(tmp_path):
    """A function's length runs from its `def` (not its decorator) to its last line."""
    source = tmp_path / "example.py"
    source.write_text("@decorator\ndef f():\n    '''Doc.'''\n    return 1\n\n\nclass C:\n    def g(self):\n        pass\n")
    assert list(function_lengths(source)) == [(2, "f", 3), (8, "g", 2)]
