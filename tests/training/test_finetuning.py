"""Optimisation control and fine-tuning through the real `train` command: --lr, Adam's options and weight
decay, freezing, --lora, --preset small, and the tokenizer a run trains or is given."""

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from vanilla_transformer.cli import main
from vanilla_transformer.modeling.configuration_vanilla_transformer import (
    PRESETS,
    VanillaTransformerConfig,
)
from vanilla_transformer.modeling.modeling_vanilla_transformer import (
    VanillaTransformerForConditionalGeneration,
)
from vanilla_transformer.quickstart import PRESET_SETTINGS, training_arguments
from vanilla_transformer.tokenizer import save_tokenizer_files, train_tokenizer
from vanilla_transformer.training.checkpoints import latest_checkpoint
from vanilla_transformer.training.schedule import make_optimizer

# Short runs: a few steps, two test sentences translated at the end.
SHORT = ["--warmup-steps", "4", "--test-samples", "2"]


def _train(data, out, small_run, *extra):
    main(["train", "--dataset", str(data), "--output-dir", str(out), *small_run, *SHORT, *extra])
    return out


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, write_synthetic_task, small_run_options):
    """A tiny model trained for two steps, and its data: what the fine-tuning tests start from."""
    root = tmp_path_factory.mktemp("pretrained")
    data = write_synthetic_task(root / "data", n_train=300, n_eval=12, reverse=True)
    return _train(data, root / "model", list(small_run_options), "--max-steps", "2"), data


@pytest.mark.parametrize("schedule", ["noam", "linear", "cosine"])
def test_lr_is_the_peak_of_every_schedule(tmp_path, small_task, small_run, schedule, caplog):
    # Stopped one step before the peak: the optimiser holds the rate of the next step, the end of the warm-up.
    with caplog.at_level(logging.INFO):
        out = _train(small_task, tmp_path / "run", small_run, "--lr", "2e-3", "--lr-schedule", schedule,
                     "--max-steps", "3", "--save-steps", "3")
    assert "peak 2.00e-03 at step 4" in caplog.text
    optimizer = torch.load(latest_checkpoint(out / "checkpoints") / "optimizer.bin", weights_only=True)
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(2e-3)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--lr", "2e-4", "--lr-scale", "0.5"], "`lr` and `lr_scale` both set the peak learning rate: give one of them."),
        (["--lr", "0"], "--lr must be a positive number; got 0.0"),
        (["--adam-beta2", "1"], "--adam-beta2 must be a number in [0, 1); got 1.0"),
        (["--adam-epsilon", "nan"], "--adam-epsilon must be a positive number; got nan"),
        (["--weight-decay", "-0.1"], "--weight-decay must be a non-negative number; got -0.1"),
        (["--lora-rank", "0"], "--lora-rank must be a positive integer; got 0"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be a number in [0, 1); got 1.0"),
        (["--lora-rank", "4", "--lora-target-modules", "q_proj,,v_proj"], "`lora_target_modules` must be layer names"),
        (["--lora-rank", "4", "--freeze-encoder"], "`lora_rank` already trains the adapters alone"),
        (["--tokenizer-model", "wordpiece"], "invalid choice: 'wordpiece'"),
        (["--model-name-or-path", "saved", "--preset", "small"],  # once ignored: the saved model's architecture trained
         "`preset` 'small' builds a new model, and `model_name_or_path` fine-tunes a saved one with its own architecture"),
    ],
)
def test_bad_optimisation_options_are_one_line_errors(tmp_path, small_task, small_run, capsys, extra, expected):
    err = _usage_error(capsys, ["train", "--dataset", str(small_task), "--output-dir", str(tmp_path / "out"),
                                *small_run, "--max-steps", "2", *extra])
    assert expected in err
    assert err.count("\n") == 1 or "invalid choice" in expected  # argparse's own errors come after its usage line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_model_folder_missing_or_without_its_tokenizer_is_refused_before_any_data_is_read(
        tmp_path, small_task, small_run, pretrained, capsys, caplog):
    saved, _ = pretrained
    bare = shutil.copytree(saved, tmp_path / "bare", ignore=shutil.ignore_patterns("tokenizer.json", "checkpoints"))
    for folder, expected in [
        (tmp_path / "nothing", f"`model_name_or_path`: no saved model folder at {tmp_path / 'nothing'}"),
        (bare, f"`model_name_or_path` {bare} holds no tokenizer.json: give the `tokenizer` the model was trained with"),
    ]:
        with caplog.at_level(logging.INFO):
            err = _usage_error(capsys, ["train", "--dataset", str(small_task), "--output-dir", str(tmp_path / "out"),
                                        *small_run, "--max-steps", "2", "--model-name-or-path", str(folder)])
        assert expected in err and err.count("\n") == 1
        assert "tokenizer on the train split" not in caplog.text  # no new tokenizer: its ids would not be the model's
        assert not (tmp_path / "out").exists()


def test_lora_without_peft_installed_is_a_one_line_hint(tmp_path, small_task, small_run):
    blocked = "import sys; sys.modules['peft'] = None  # as if it were not installed\n"
    argv = ["train", "--dataset", str(small_task), "--output-dir", str(tmp_path / "out"), *small_run, "--lora-rank", "4"]
    code = blocked + f"from vanilla_transformer.cli import main; main({argv!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "`lora_rank` needs the peft package: pip install 'vanilla-transformer[peft]'" in result.stderr
    assert not (tmp_path / "out").exists()


def test_weight_decay_shrinks_weights_but_not_biases_and_layer_norms():
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=50))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = make_optimizer(model, weight_decay=0.1)
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: what moves a weight is the decay alone
    optimizer.step()
    norms = {name for name, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)}
    for name, p in model.named_parameters():
        undecayed = name.endswith("bias") or name.rsplit(".", 1)[0] in norms
        expected = before[name] if undecayed else before[name] * (1 - 0.5 * 0.1)
        torch.testing.assert_close(p.detach(), expected, msg=name)
    assert type(make_optimizer(model)) is torch.optim.Adam  # the paper's, without decay


def test_adam_options_reach_the_optimiser():
    model = torch.nn.Linear(2, 2)
    group = make_optimizer(model, betas=(0.8, 0.9), eps=1e-6).param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.9), 1e-6, 0)


@pytest.mark.parametrize("frozen", ["encoder", "embeddings"])
def test_frozen_weights_stay_bit_identical(tmp_path, pretrained, small_run, frozen, caplog):
    model, data = pretrained
    with caplog.at_level(logging.INFO):
        out = _train(data, tmp_path / "tuned", small_run, "--model-name-or-path", str(model), "--max-steps", "3",
                     f"--freeze-{frozen}", "--weight-decay", "0.01")
    assert f"frozen: the {frozen}" in caplog.text
    before, after = (load_file(str(folder / "model.safetensors")) for folder in (model, out))
    is_frozen = {
        # The token embeddings are the decoder's and the output layer's too: freezing the encoder leaves them.
        "encoder": lambda name: name.startswith("model.encoder.") and "embed_tokens" not in name,
        "embeddings": lambda name: "embed" in name or name == "model.shared.weight",
    }[frozen]
    frozen_names = [name for name in before if is_frozen(name)]
    assert frozen_names
    for name in before:
        assert torch.equal(before[name], after[name]) == is_frozen(name), name


@pytest.mark.slow
def test_lora_trains_and_saves_a_plain_model_that_loads_in_a_fresh_process(tmp_path, pretrained, small_run, caplog,
                                                                             run_without_package, monkeypatch):
    model, data = pretrained
    monkeypatch.chdir(model.parent)  # the base model named as typed, relative to here
    lora = ["--model-name-or-path", model.name, "--lora-rank", "4", "--lr", "1e-2", "--save-steps", "2"]
    out = _train(data, tmp_path / "lora", small_run, *lora, "--max-steps", "2")
    with caplog.at_level(logging.INFO):  # resumed with the adapters, and the last two checkpoints averaged
        _train(data, out, small_run, *lora, "--max-steps", "4", "--average-last", "2", "--resume")
    assert "LoRA rank 4, alpha 16.0 on q_proj, k_proj, v_proj, out_proj" in caplog.text
    assert "the average of checkpoint-00000002, checkpoint-00000004" in caplog.text
    tied = [record.getMessage() for record in caplog.records
            if record.levelno >= logging.WARNING and ("embed_tokens" in record.getMessage() or "lm_head" in record.getMessage())]
    assert not tied  # the tied embeddings are saved once: no warning names them
    assert not list(out.glob("adapter_*"))  # merged: no adapter files, no PEFT needed to load it
    # ... and the adapter kept beside it, which PEFT loads on the base model to the merged model's logits.
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["README.md", "adapter_config.json",
                                                                   "adapter_model.safetensors"]
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(model.resolve())  # found from any directory
    from peft import PeftModel

    inputs = {"input_ids": torch.tensor([[5, 6, 7, 2]]), "decoder_input_ids": torch.tensor([[2, 8, 9]])}
    base = VanillaTransformerForConditionalGeneration.from_pretrained(model).eval()
    merged = VanillaTransformerForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        before = base(**inputs).logits
        adapted = PeftModel.from_pretrained(base, out / "adapter").eval()  # the adapters go into `base`
        torch.testing.assert_close(adapted(**inputs).logits, merged(**inputs).logits, rtol=1e-5, atol=1e-5)
    assert (before - merged(**inputs).logits).abs().max() > 1e-3  # the adapter changed something
    before, after = (load_file(str(folder / "model.safetensors")) for folder in (model, out))
    assert before.keys() == after.keys()  # the plain model's weights, none of PEFT's names
    for name in before:  # only the attention projections changed; their biases are not adapted
        adapted = name.endswith("_proj.weight")
        assert torch.equal(before[name], after[name]) != adapted, name
    translated = run_without_package(f"""
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        ids = model.generate(**tokenizer(["a b c"], return_tensors="pt"), max_new_tokens=8)
        print(type(model).__name__, len(ids[0]), repr(tokenizer.decode(ids[0], skip_special_tokens=True)))
    """)
    assert translated.startswith("VanillaTransformerForConditionalGeneration ")


def test_small_preset_is_the_quickstarts_model(tmp_path, small_task, small_run):
    assert training_arguments(tmp_path, 10, "small").preset == "small" and "config_overrides" not in PRESET_SETTINGS["small"]
    small_run[small_run.index("--config-overrides") + 1] = ""
    small_run[small_run.index("--preset") + 1] = "small"
    out = _train(small_task, tmp_path / "small", small_run, "--max-steps", "1")
    config = json.loads((out / "config.json").read_text())
    assert {name: config[name] for name in PRESETS["small"]} == PRESETS["small"]
    assert (config["d_model"], config["encoder_layers"], config["decoder_layers"]) == (192, 2, 4)


def test_a_tokenizer_without_end_of_sentence_is_refused(tmp_path, small_task, small_run, capsys):
    tokenizer = train_tokenizer(["a b c d e f g h i j k l"] * 20, vocab_size=300)
    tokenizer.backend_tokenizer.post_processor = None  # encodes without appending </s>
    save_tokenizer_files(tokenizer, tmp_path / "no-eos")
    assert AutoTokenizer.from_pretrained(tmp_path / "no-eos")("a b")["input_ids"][-1] != tokenizer.eos_token_id
    err = _usage_error(capsys, ["train", "--dataset", str(small_task), "--output-dir", str(tmp_path / "out"),
                                *small_run, "--max-steps", "2", "--tokenizer", str(tmp_path / "no-eos")])
    assert "Traceback" not in err and err.splitlines()[-1].startswith(  # after the data's progress bars: one line
        f"vanilla-transformer train: error: `tokenizer` {tmp_path / 'no-eos'}: the tokenizer does not append </s>")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_unigram_tokenizer_trains_and_resume_refuses_another(tmp_path, small_task, small_run, capsys):
    out = _train(small_task, tmp_path / "unigram", small_run, "--tokenizer-model", "unigram", "--max-steps", "2")
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "Unigram"
    assert json.loads((out / "checkpoints" / "tokenizer_options.json").read_text())["tokenizer_model"] == "unigram"
    assert json.loads((out / "results.json").read_text())["steps"] == 2
    # --resume alone takes the recorded options, the unigram tokenizer among them; another one typed is refused.
    err = _usage_error(capsys, ["train", "--dataset", str(small_task), "--output-dir", str(out), *small_run, *SHORT,
                                "--max-steps", "4", "--resume", "--tokenizer-model", "bpe"])
    assert "Traceback" not in err and "tokenizer_model 'unigram' -> 'bpe'" in err.splitlines()[-1]


@pytest.mark.slow
def test_the_lora_adapter_has_a_card_of_its_own_and_the_model_card_names_its_data(tmp_path, pretrained, small_run):
    # The adapter's README was PEFT's empty template naming a local base path; the card's `datasets:` metadata
    # held the data folder's absolute path.
    model, data = pretrained
    out = tmp_path / "lora"
    result = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "train", "--dataset", str(data),
                             "--output-dir", str(out), *small_run, *SHORT, "--model-name-or-path", str(model),
                             "--lora-rank", "2", "--lora-target-modules", "q_proj,v_proj", "--max-steps", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    card = (out / "adapter" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\n") and "base_model:" not in card  # a local base: no Hub id
    assert f"# LoRA adapter of {out.name}" in card and "rank 2, alpha 16" in card and "q_proj, v_proj" in card
    assert f"from_pretrained('{model.name}', trust_remote_code=True)" in card
    assert 'PeftModel.from_pretrained(base, "adapter")' in card
    assert str(tmp_path) not in card and "[More Information Needed]" not in card
    readme = (out / "README.md").read_text()
    metadata = readme.split("\n---\n", 1)[0]
    assert str(data) not in metadata and "datasets:" not in metadata
    assert f"Data: {data.name}." in readme
