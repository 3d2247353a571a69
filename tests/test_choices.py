"""Every choice list the package offers is written once, in vanilla_transformer/choices.py, or, for the
learning-rate schedules, as the keys of training/schedule.py's registry.

A copy elsewhere (an option's `choices=`, a check's tuple) drifts the day one side gains a value: the
test reads the package's source and names each copy."""

import ast
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_presets_are_read_from_the_configuration():
    assert choices.PRESETS == PRESETS and set(choices.PRESET_NAMES) == set(PRESETS)
    assert choices.PRESET_NAMES == ("tiny", "small", "base", "big")  # the narrowest first


@pytest.mark.slow
def test_a_preset_added_to_the_configuration_alone_is_offered_everywhere(tmp_path):
    """One entry in the configuration's PRESETS: `train --preset` and `quickstart --preset` offer it and say its
    shape, the configuration builds it and the quickstart has a schedule for it."""
    shutil.copytree(PACKAGE, tmp_path / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    config_file = tmp_path / PACKAGE.name / "modeling" / "configuration_vanilla_transformer.py"
    source = config_file.read_text(encoding="utf-8")
    mini = '    "mini": {"d_model": 128, "encoder_layers": 3, "decoder_layers": 3, "num_heads": 4, "d_ff": 512, "dropout": 0.1},\n'
    config_file.write_text(source.replace("PRESETS = {\n", "PRESETS = {\n" + mini, 1), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    shape = "mini (d_model 128, 3 encoder and 3 decoder layers, d_ff 512)"
    for command, option in (("train", "--preset {tiny,mini,small,base,big}"), ("quickstart", "--preset {tiny,mini,small,base,big}")):
        shown = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", command, "--help"], capture_output=True,
                               text=True, env={**env, "COLUMNS": "1000"}, cwd=tmp_path, timeout=120, check=True)
        assert option in shown.stdout and shape in shown.stdout, shown.stdout
    built = subprocess.run(
        [sys.executable, "-c", "from vanilla_transformer import VanillaTransformerConfig\n"
         "from vanilla_transformer.quickstart import PRESET_SETTINGS\n"
         "print(VanillaTransformerConfig.from_preset('mini', vocab_size=100).encoder_layers, PRESET_SETTINGS['mini']['preset'])"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=True)
    assert built.stdout.split() == ["3", "mini"], built.stderr
