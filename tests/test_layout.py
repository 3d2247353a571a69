"""A module's tests are found from its path: `vanilla_transformer/P/M.py` is tested in `tests/P/test_M.py`, and a
package's `__init__.py` in `tests/P/test_P.py`. `COVERED_ELSEWHERE` is the one list of modules tested in another
file, each with the file and why. An `__init__.py` that holds only its docstring has nothing to test.
The command line's option machinery stays out of training/ (`TRAINING_IMPORTS`).
Read from the file tree and with `ast`; nothing is imported."""

import ast
from pathlib import Path

from test_code_shape import imported_modules

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vanilla_transformer"
TESTS = ROOT / "tests"

# module (under vanilla_transformer/) -> (test file under tests/, why it is tested there)
COVERED_ELSEWHERE = {
    "__init__.py": ("cli/test_cli.py", "its lazy imports keep `--help` free of torch"),
    "checks/adapters.py": ("safety/test_hostile_adapters.py", "adapters are files users hand us"),
    "checks/files.py": ("checks/test_model_folder.py", "reads the files a model folder holds"),
    "checks/folder_fields.py": ("checks/test_model_folder.py", "the table the folder's gate checks against"),
    "checks/bounds.py": ("cli/test_options.py", "the bounds every command's numeric options keep"),
    "cli/__main__.py": ("cli/test_cli.py", "`python -m vanilla_transformer.cli` is how the tests run commands"),
    "cli/attention.py": ("cli/test_cli.py", "a command of its own, run end to end"),
    "cli/evaluate.py": ("cli/test_cli.py", "a command of its own, run end to end"),
    "cli/export.py": ("export/test_ctranslate2.py", "a command is tested with the work it runs"),
    "cli/push.py": ("cli/test_cli.py", "a command of its own, run end to end"),
    "cli/quickstart.py": ("test_quickstart.py", "a command is tested with the work it runs"),
    "cli/streams.py": ("cli/test_cli.py", "the lines translate and evaluate read"),
    "cli/train.py": ("training/test_loop.py", "a command is tested with the work it runs"),
    "cli/train_tokenizer.py": ("test_tokenizer.py", "a command is tested with the work it runs"),
    "cli/translate.py": ("cli/test_cli.py", "a command of its own, run end to end"),
    "cli/translators.py": ("cli/test_cli.py", "the engines translate and evaluate decode with"),
    "corpora/__init__.py": ("corpora/test_loading.py", "re-exports the names its modules define, tested with each"),
    "metrics/bleu_chrf/bleu_chrf.py": ("metrics/test_metrics.py", "the metric script the package's metrics load"),
    "model_card/__init__.py": ("model_card/test_card.py", "re-exports the names its modules define, tested with each"),
    "model_card/retarget.py": ("model_card/test_card.py", "retargets the cards the builder makes"),
    "modeling/__init__.py": ("modeling/test_hf_native.py", "its registration writes the auto_map saved folders load by"),
    "modeling/attention.py": ("modeling/test_modeling_vanilla_transformer.py", "the paper's attention, in the model"),
    "modeling/configuration_vanilla_transformer.py": ("modeling/test_modeling_vanilla_transformer.py",
                                                      "the config is read by the model it builds"),
    "modeling/input_checks.py": ("modeling/test_modeling_vanilla_transformer.py", "the checks of the forward's inputs"),
    "modeling/saving.py": ("modeling/test_modeling_vanilla_transformer.py", "what makes a saved folder load"),
    "modeling/value_checks.py": ("safety/test_hostile_folders.py", "bounds on the decoding options a folder holds"),
    "visualize/api.py": ("cli/test_serve.py", "the JSON endpoint `serve` answers on"),
    "visualize/app.py": ("cli/test_serve.py", "the app `serve` runs"),
    "visualize/score_drawings.py": ("visualize/test_neuron_view.py", "what the neuron view draws"),
    # training/: a module tested with the part of the run it serves.
    "training/criterion.py": ("training/test_batches.py", "the loss of the batches it is given"),
    "training/evaluation.py": ("training/test_step.py", "scores the model the step trains"),
    "training/logs.py": ("training/test_selection_and_logs.py", "the run's logs"),
}


def expected_test(module: str) -> str:
    """`P/M.py` -> `P/test_M.py`; a package's `P/__init__.py` -> `P/test_P.py` (both under tests/)."""
    path = Path(module)
    name = (path.parent.name or PACKAGE.name) if path.name == "__init__.py" else path.stem
    return str(path.parent / f"test_{name}.py")


def only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def modules() -> list[str]:
    found = sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)
    return [str(path.relative_to(PACKAGE)) for path in found
            if not (path.name == "__init__.py" and only_a_docstring(path))]


def test_every_module_has_its_test_file_or_an_entry_in_the_table():
    missing = [f"vanilla_transformer/{module}: expected tests/{expected_test(module)}, or an entry in COVERED_ELSEWHERE"
               for module in modules()
               if module not in COVERED_ELSEWHERE and not (TESTS / expected_test(module)).is_file()]
    assert not missing, "modules without a test file:\n" + "\n".join(missing)


def test_every_entry_in_the_table_names_a_module_and_a_test_file_that_exist():
    stale = [f"{module} -> tests/{test}: " + ("no such module" if not (PACKAGE / module).is_file() else
                                              "no such test file" if not (TESTS / test).is_file() else
                                              f"has tests/{expected_test(module)}: drop the entry")
             for module, (test, _) in COVERED_ELSEWHERE.items()
             if not (PACKAGE / module).is_file() or not (TESTS / test).is_file()
             or (TESTS / expected_test(module)).is_file()]
    assert not stale, "stale entries in COVERED_ELSEWHERE:\n" + "\n".join(stale)


def test_test_file_names_are_unique_across_the_tests():
    names = [path.name for path in TESTS.rglob("test_*.py")]
    doubled = sorted({name for name in names if names.count(name) > 1})
    assert not doubled, f"test files sharing a name (pytest imports each by its name): {doubled}"


def test_the_rule_maps_modules_and_packages():
    assert expected_test("cli/translate.py") == "cli/test_translate.py"
    assert expected_test("corpora/__init__.py") == "corpora/test_corpora.py"
    assert expected_test("tokenizer.py") == "test_tokenizer.py"
    assert expected_test("__init__.py") == "test_vanilla_transformer.py"
    assert expected_test("metrics/bleu_chrf/bleu_chrf.py") == "metrics/bleu_chrf/test_bleu_chrf.py"


# The modules of cli/ that import training/, and what: `train` and `quickstart` run training (anything), and
# options.py takes the options other commands share with `train` from their one declaration, TrainArguments.
# The option machinery is cli/options.py's, the bounds checks/bounds.py's: neither is training's.
TRAINING_IMPORTS = {
    "cli/train.py": None,
    "cli/quickstart.py": None,
    "cli/options.py": {"vanilla_transformer.training.arguments", "vanilla_transformer.training.arguments.TrainArguments"},
}


def test_the_command_line_imports_training_only_to_train():
    wrong = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        module = str(path.relative_to(PACKAGE))
        allowed = TRAINING_IMPORTS.get(module, set())
        imported = {name for name in imported_modules(path) if name.startswith("vanilla_transformer.training")}
        if allowed is not None and imported - allowed:
            wrong.append(f"vanilla_transformer/{module} imports {', '.join(sorted(imported - allowed))}")
    for path in sorted((PACKAGE / "training").glob("*.py")):  # and training/ never imports the command line
        imported = sorted(name for name in imported_modules(path) if name.startswith("vanilla_transformer.cli"))
        if imported:
            wrong.append(f"{path.relative_to(ROOT)} imports {', '.join(imported)}")
    assert not wrong, "imports across cli/ and training/:\n" + "\n".join(wrong)
