"""The main job end to end, with a tiny model and a budget of half a minute: a few seconds of training are
enough for every step of the job to run."""

import json

import pytest

from vanilla_transformer.cli import main
from vanilla_transformer.metrics import repeated_phrase
from vanilla_transformer.quickstart import format_summary, training_arguments
from vanilla_transformer.training.compute import cpu_computes_bf16


@pytest.fixture(scope="module")
def quickstart_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quickstart") / "model"
    assert main(["quickstart", "--output-dir", str(folder), "--minutes", "0.5", "--preset", "tiny",
                 "--test-samples", "8"]) == 0
    return folder


@pytest.mark.slow
def test_quickstart_prints_a_summary_and_leaves_a_complete_folder(quickstart_folder):
    summary = json.loads((quickstart_folder / "quickstart.json").read_text())
    assert summary["split"] == "test" and summary["scored_pairs"] == 8 and 0 <= summary["bleu"] <= 100 and 0 <= summary["chrf"] <= 100
    assert summary["steps"] > 0 and summary["parameters"] > 0
    # It says what it trained with: bf16 only where the CPU computes it (VANILLA_TRANSFORMER_CPU_BF16 fakes the
    # answer), and the attention implementation that timed fastest.
    assert summary["precision"] == ("bf16" if cpu_computes_bf16() else "fp32")
    assert summary["attention"] in ("sdpa", "eager")
    assert f"training steps in {summary['precision']} with {summary['attention']} attention," in format_summary(summary)
    # --test-samples 8 of the 634 test verses: the summary and the card's scores say so.
    assert "test split (the first 8 of 634 pairs): BLEU" in format_summary(summary)
    assert "Scored on the first 8 of the 634 sentences of the test split only" in (quickstart_folder / "README.md").read_text()
    assert len(summary["examples"]) == 3 and all(e["translation"] is not None for e in summary["examples"])
    assert all(e["repeats"] == repeated_phrase(e["translation"]) for e in summary["examples"])
    assert 0 <= summary["repeating"] <= 8 and 0 <= summary["references_repeating"] <= 8
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "results.json",
                 "README.md", "modeling_vanilla_transformer.py", "configuration_vanilla_transformer.py",
                 "generation.py", "search.py", "pipeline_vanilla_transformer.py"):
        assert (quickstart_folder / name).is_file(), name
    attention = quickstart_folder / "attention"
    assert (attention / "overview.png").is_file() and (attention / "bertviz.pt").is_file()
    assert len(list(attention.glob("cross_layer*.png"))) == 2  # tiny has 2 decoder layers
    card = (quickstart_folder / "README.md").read_text()
    assert f"{summary['bleu']:.2f}" in card or f"{summary['bleu']:.1f}" in card


@pytest.mark.slow
def test_quickstart_folder_translates_in_a_process_without_the_package(quickstart_folder, run_without_package):
    out = run_without_package(
        f"""
        from transformers import pipeline
        translate = pipeline("translation", model={str(quickstart_folder)!r}, trust_remote_code=True)
        result = translate(["In the beginning, God created the heavens and the earth.", "Jesus wept."])
        assert len(result) == 2 and all(isinstance(r["translation_text"], str) for r in result), result
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_every_quickstart_preset_decays_its_learning_rate_to_zero_at_the_end_of_its_budget(tmp_path):
    for preset in ("base", "small", "tiny"):
        args = training_arguments(tmp_path, 15.0, preset)
        assert args.lr_schedule == "linear" and args.time_limit is not None and args.max_steps is None


def test_quickstart_rejects_a_budget_too_small_for_the_preset(tmp_path):
    with pytest.raises(ValueError, match="`minutes` must be more than 1.5 for preset 'small'"):
        training_arguments(tmp_path, 1.5, "small")
    with pytest.raises(ValueError, match="`preset` must be one of 'tiny', 'small', 'base', 'big'; got 'huge'"):
        training_arguments(tmp_path, 10.0, "huge")
    with pytest.raises(ValueError, match="`minutes` must be more than 1.5 for preset 'small'"):
        training_arguments(tmp_path, float("nan"), "small")


@pytest.mark.parametrize("argv, message", [
    (["--minutes", "1"], "`minutes` must be more than 1.5 for preset 'small'"),
    (["--minutes", "nan", "--preset", "tiny"], "`minutes` must be more than"),
    (["--test-samples", "0", "--preset", "tiny"], "--test-samples must be a positive integer; got 0"),
    (["--preset", "tiny"], "holds quickstart.json, which the quickstart's summary would replace"),
])
def test_quickstart_refuses_bad_input_in_one_line_and_writes_nothing(argv, message, tmp_path, capsys):
    folder = tmp_path / "q"
    folder.mkdir()
    if "quickstart.json" in message:
        (folder / "quickstart.json").write_text("{}")  # the user's, or left by a job whose model was moved away
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(SystemExit) as stop:
        main(["quickstart", "--output-dir", str(folder), *argv])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("vanilla-transformer quickstart: error: ") and message in error[0]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_looping_translation_is_found_and_named_in_the_summary():
    assert repeated_phrase("Y Jehová Dios de los montes, y de su mujer, y de su mujer.") == "y de su"
    assert repeated_phrase("En el principio, Dios creó los cielos y la tierra.") is None
    assert repeated_phrase("los cielos y los cielos") is None  # two words twice is not a phrase of three
    summary = {"wall_minutes": 1.0, "device": "CPU", "precision": "bf16", "attention": "eager", "steps": 1, "parameters": 1e6, "split": "test", "scored_pairs": 1,
               "bleu": 1.0, "chrf": 2.0, "validation_perplexity": 3.0, "bleu_signature": "sig", "model_dir": "m",
               "model_card": "m/README.md", "attention_dir": "m/attention", "repeating": 1, "references_repeating": 0,
               "examples": [{"source": "s", "translation": "a b c a b c", "reference": "r", "repeats": "a b c"}]}
    assert "(the translation repeats itself: 'a b c' twice)" in format_summary(summary)
    assert "1 training steps in bf16 with eager attention, 1.0M parameters." in format_summary(summary)
    assert "repeating a phrase of 3 words: 1 of 1 translations (0 of the references)" in format_summary(summary)
