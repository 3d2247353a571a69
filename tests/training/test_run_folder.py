"""Nothing a user made is deleted or written over by a training run: with a file of the user's at any path a run
writes in its output folder (a plain run and a LoRA fine-tune), `train` refuses in one line, or leaves the file as
it was. Each case drives the real command in a process of its own."""

import subprocess
from pathlib import Path

import pytest

from commands import run_cli
from conftest import SMALL_RUN

NOTES = "the user's notes\n"


def _train(data, out, *options) -> subprocess.CompletedProcess:
    return run_cli("train", "--dataset", data, "--output-dir", out, *SMALL_RUN, "--max-steps", 2, "--save-steps", 1,
                   *options, timeout=600)


def _written(folder: Path) -> list[str]:
    """Every path a run left in `folder` and in its sub-folders, relative to it (a checkpoint counts as one)."""
    paths = [path.relative_to(folder) for path in folder.rglob("*")]
    return sorted(str(path) for path in paths if len(path.parts) <= 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, write_synthetic_task):
    """The data, and the paths a plain run and a LoRA fine-tune of its model write, each with its options."""
    root = tmp_path_factory.mktemp("user-files")
    data = write_synthetic_task(root / "data", n_train=300, n_eval=12, reverse=True)
    base = _train(data, root / "base")
    assert base.returncode == 0, base.stderr[-2000:]
    lora_options = ("--model-name-or-path", str(root / "base"), "--lora-rank", "2")
    lora = _train(data, root / "lora", *lora_options)
    assert lora.returncode == 0, lora.stderr[-2000:]
    assert (root / "lora" / "adapter" / "adapter_config.json").is_file()
    return data, {(): _written(root / "base"), lora_options: _written(root / "lora")}


@pytest.mark.slow
def test_every_path_a_run_writes_is_refused_or_left_as_the_user_made_it(runs, tmp_path):
    # A LoRA run deleted a user's adapter/ with the notes in it and said nothing; a plain run wrote over the code
    # files, generation_config.json and the log, and removed a user's pytorch_model.bin.
    data, written = runs
    cases = [(options, path) for options, paths in written.items() for path in paths
             if options or path not in written[()] or options == ()]
    cases = list({path: (options, path) for options, path in reversed(cases)}.values())  # a path once, plain first
    cases += [((), "pytorch_model.bin"), ((), "model-00001-of-00002.safetensors")]  # other layouts, swept at the end
    outcomes = {}
    for number, (options, path) in enumerate(cases):
        out = tmp_path / f"out{number}"
        user_file = out / path if not written_is_folder(written, options, path) else out / path / "MY_NOTES.txt"
        user_file.parent.mkdir(parents=True, exist_ok=True)
        user_file.write_text(NOTES)
        result = _train(data, out, *options)
        refused = result.returncode == 2 and result.stderr.splitlines()[-1].startswith("vanilla-transformer train: error: ")
        assert refused or result.returncode == 0, (path, result.stderr[-2000:])
        assert "Traceback" not in result.stderr, (path, result.stderr[-2000:])
        assert user_file.is_file() and user_file.read_text() == NOTES, (path, "changed", result.stderr[-2000:])
        outcomes[path] = "refused" if refused else "left as it was"
    assert "adapter" in outcomes and outcomes["adapter"] == "refused"


def written_is_folder(written, options, path) -> bool:
    """Whether `path` is a folder a run writes (a file of the user's goes inside it)."""
    return any(other.startswith(path + "/") for other in written[options])


def test_saving_the_adapter_again_keeps_a_file_a_user_put_in_adapter_and_says_so(tmp_path):
    # A resumed LoRA run replaces its earlier adapter whole: a file a user added there meanwhile is not deleted.
    from peft import LoraConfig, get_peft_model

    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
    from vanilla_transformer.training.finetuning import save_adapter

    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=300))
    model = get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=4, target_modules=["q_proj", "v_proj"]))
    folder = save_adapter(model, tmp_path, None)
    assert save_adapter(model, tmp_path, None) == folder  # this run's own adapter is replaced
    (folder / "MY_ADAPTER_NOTES.txt").write_text("notes")
    written = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(ValueError, match=r"adapter holds MY_ADAPTER_NOTES.txt, which no run wrote there; move them out"):
        save_adapter(model, tmp_path, None)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == written
