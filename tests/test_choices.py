"""Every choice list the package offers is written once, in vanilla_transformer/choices.py, or, for the
learning-rate schedules, as the keys of training/schedule.py's registry.

A copy elsewhere (an option's `choices=`, a check's tuple) drifts the day one side gains a value: the
test reads the package's source and names each copy."""

import ast
import inspect
from pathlib import Path

from vanilla_transformer import choices
from vanilla_transformer.modeling.configuration_vanilla_transformer import PRESETS
from vanilla_transformer.training.schedule import SCHEDULES

PACKAGE = Path(choices.__file__).parent
CHOICE_LISTS = {name: value for name, value in vars(choices).items()
                if isinstance(value, tuple) and len(value) >= 2 and all(isinstance(v, str) for v in value)}
CHOICE_LISTS["SCHEDULES"] = tuple(SCHEDULES)  # defined where the schedules are, as a registry


def string_lists(root: Path):
    """(file:line, the strings) of each list or tuple of two or more string literals under `root`."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                yield f"{path.relative_to(root.parent)}:{node.lineno}", tuple(e.value for e in node.elts)


def copies(root: Path) -> list[str]:
    """Where a list with the values of one of choices.py's (in any order) is written out again."""
    wanted = {frozenset(value): name for name, value in CHOICE_LISTS.items()}
    return [f"{where} repeats choices.{wanted[frozenset(values)]}" for where, values in string_lists(root)
            if frozenset(values) in wanted and not where.startswith("vanilla_transformer/choices.py:")]


def test_the_choice_lists_are_found():
    assert {"TOKENIZER_MODELS", "QUANTIZATIONS", "PRESET_NAMES", "SCHEDULES", "ENGINES"} <= set(CHOICE_LISTS)


def test_no_choice_list_is_written_twice():
    assert copies(PACKAGE) == []


def test_a_copy_is_named(tmp_path):
    package = tmp_path / "vanilla_transformer"
    (package / "cli").mkdir(parents=True)
    (package / "cli" / "export.py").write_text('CHOICES = ("int8", "float32", "int8_float32", "float16", "int8_float16", "bfloat16")\n'
                                               'p.add_argument("--model-type", choices=["bpe", "unigram"])\n'
                                               'ENGINES = ("ctranslate2", "transformers")\n'
                                               'SIDES = ("source", "target")\n')
    assert sorted(copies(package)) == ["vanilla_transformer/cli/export.py:1 repeats choices.QUANTIZATIONS",
                               "vanilla_transformer/cli/export.py:2 repeats choices.TOKENIZER_MODELS",
                               "vanilla_transformer/cli/export.py:3 repeats choices.ENGINES"]


def test_the_modules_that_offer_a_choice_take_it_from_choices():
    from vanilla_transformer import inference, tokenizer
    from vanilla_transformer.cli import build_parser
    from vanilla_transformer.export import ctranslate2
    from vanilla_transformer.training import arguments, schedule
    from vanilla_transformer.visualize import app

    assert tokenizer.DEFAULT_VOCAB_SIZE is arguments.DEFAULT_VOCAB_SIZE is choices.DEFAULT_VOCAB_SIZE
    assert tokenizer.MODEL_TYPES is arguments.TOKENIZER_MODELS is choices.TOKENIZER_MODELS
    assert schedule.SCHEDULES is arguments.SCHEDULES and not hasattr(choices, "SCHEDULES")
    assert ctranslate2.QUANTIZATIONS is choices.QUANTIZATIONS
    assert app.Limits() == app.Limits(**choices.SERVE_LIMITS)
    for command in ("translate", "evaluate"):
        args = build_parser().parse_args([command, "--model", "m"])
        assert (args.engine, args.batch_size) == (choices.ENGINES[0], choices.TRANSLATION_BATCH_SIZE)
    for function in (inference.translate_texts, inference.translate_nbest, ctranslate2.CTranslate2Translator.translate):
        assert inspect.signature(function).parameters["batch_size"].default == choices.TRANSLATION_BATCH_SIZE
    # The modeling files cannot import choices.py (a saved folder holds them alone): the config's table is held equal.
    assert set(choices.PRESET_NAMES) == set(PRESETS)
