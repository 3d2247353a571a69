"""`BadInput` is what the package's checks raise, and all they raise of ValueError: the command line refuses it in one
line and lets any other ValueError, a bug's, keep its traceback (tests/cli/test_cli.py and
tests/training/test_loop.py show both sides on a run). Read from the source with `ast`."""

import ast
from pathlib import Path

import pytest

from vanilla_transformer.errors import BadInput

PACKAGE = Path(__file__).resolve().parents[1] / "vanilla_transformer"
# The model's files ship with saved models and the metric script with evaluate: they import nothing of the package.
STANDALONE = ("modeling", "metrics")


def plain_value_errors(path: Path) -> list[int]:
    """The lines of `path` that make a ValueError itself (`raise ValueError(...)`, `error = ValueError(...)`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sorted(node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ValueError")


def test_bad_input_is_a_value_error_for_code_that_catches_those():
    with pytest.raises(ValueError, match="--num-beams must be"):
        raise BadInput("--num-beams must be a positive integer; got 0")


def test_the_package_checks_raise_bad_input_and_the_model_files_plain_value_error():
    plain = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] not in STANDALONE for line in plain_value_errors(path)]
    assert not plain, "a check outside modeling/ raises BadInput, which the command line refuses in one line:\n" + \
        "\n".join(plain)
    shipped = [path for path in (PACKAGE / "modeling").glob("*.py") if plain_value_errors(path)]
    assert shipped  # the rule reads what it says: the model's own checks are found


def test_the_rule_finds_a_plain_value_error(tmp_path):
    (tmp_path / "checks.py").write_text("def check(x):\n    if x:\n        raise ValueError('no')\n    err = ValueError('x')\n")
    assert plain_value_errors(tmp_path / "checks.py") == [3, 4]
