"""save_for_hub writes a complete Hub folder that loads without the package; push_folder uploads it."""

import json
import re
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import ModelCard

from vanilla_transformer.hub import check_hub_folder, check_repo_id, push_folder, save_for_hub
from vanilla_transformer.model_card import card_repo_id

EXPECTED_FILES = {
    "README.md", "attention.png", "config.json", "configuration_vanilla_transformer.py", "generation_config.json",
    "model.safetensors", "modeling_vanilla_transformer.py", "pipeline_vanilla_transformer.py", "results.json",
    "tokenizer.json", "tokenizer_config.json",
}


def _non_code(names):
    """The model code may grow more files (the load test proves they are all there); the rest is fixed."""
    names = set(names)
    return {n for n in names if not n.endswith(".py")} | (EXPECTED_FILES & names)


def test_folder_is_complete(hub_tiny_folder):
    assert _non_code(p.name for p in hub_tiny_folder.iterdir()) == EXPECTED_FILES
    assert not [p for p in hub_tiny_folder.parent.iterdir() if p.name.startswith(".")]  # no staging left
    config = json.loads((hub_tiny_folder / "config.json").read_text())
    assert config["custom_pipelines"]["translation"]["impl"] == "pipeline_vanilla_transformer.TranslationPipeline"
    assert config["auto_map"]["AutoModelForSeq2SeqLM"].startswith("modeling_vanilla_transformer.")
    generation = json.loads((hub_tiny_folder / "generation_config.json").read_text())
    assert (generation["num_beams"], generation["length_penalty"], generation["length_penalty_style"]) == (4, 0.6, "gnmt")  # §6.1
    assert json.loads((hub_tiny_folder / "results.json").read_text())["bleu"] == 1.23
    check_hub_folder(hub_tiny_folder)


def test_card_metadata_parses_back_and_shows_the_results(hub_tiny_folder):
    card = ModelCard.load(hub_tiny_folder / "README.md")
    assert card.data.language == ["en", "es"] and card.data.library_name == "transformers"
    assert {(r.metric_type, r.metric_value) for r in card.data.eval_results} == {("bleu", 1.23), ("chrf", 12.34)}
    assert "![attention heat map](attention.png)" in card.text
    assert "| steps | 60 |" in card.text


@pytest.mark.slow
def test_folder_loads_and_translates_the_same_without_the_package(hub_tiny_folder, hub_tiny_model, run_without_package):
    model, tokenizer = hub_tiny_model
    sentence = "And God said, Let there be light: and there was light."
    expected = model.generate(**tokenizer([sentence], return_tensors="pt"), num_beams=2, max_new_tokens=10)[0].tolist()
    out = run_without_package(
        f"""
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(hub_tiny_folder)!r}, trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained({str(hub_tiny_folder)!r}, trust_remote_code=True)
        print(type(model).__module__.startswith("transformers_modules"))
        print(model.generate(**tokenizer([{sentence!r}], return_tensors="pt"), num_beams=2, max_new_tokens=10)[0].tolist())
        """
    )
    remote_code, ids = out.strip().splitlines()[-2:]
    assert remote_code == "True"
    assert ids == str(expected)


def test_existing_folder_keeps_other_files_and_loses_stale_weights(hub_tiny_model, tmp_path):
    model, tokenizer = hub_tiny_model
    folder = tmp_path / "run"
    (folder / "checkpoint-100").mkdir(parents=True)
    (folder / "checkpoint-100" / "optimizer.pt").write_bytes(b"x")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (folder / "README.md").write_text("old card")
    save_for_hub(model, tokenizer, folder)
    names = {p.name for p in folder.iterdir()}
    assert "checkpoint-100" in names and "model-00001-of-00002.safetensors" not in names
    assert (EXPECTED_FILES - {"attention.png"}) <= names  # no example sentence: no image
    assert (folder / "README.md").read_text() != "old card"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_save_that_fails_before_its_config_lands_leaves_the_old_models_weights(hub_tiny_model, tmp_path,
                                                                                  monkeypatch):
    from vanilla_transformer import staging
    from vanilla_transformer.hub import save_model_files

    model, tokenizer = hub_tiny_model
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"old shard")  # the old model, sharded
    real_move = staging._move

    def fail_at_config(source, destination):
        if Path(destination).name == "config.json":
            raise OSError("the disk went away")
        real_move(source, destination)

    monkeypatch.setattr(staging, "_move", fail_at_config)
    with pytest.raises(OSError, match="the disk went away"):
        save_model_files(model, tokenizer, folder)
    assert (folder / "model-00001-of-00002.safetensors").read_bytes() == b"old shard"  # removed only after the config
    monkeypatch.setattr(staging, "_move", real_move)
    save_model_files(model, tokenizer, folder)
    assert not (folder / "model-00001-of-00002.safetensors").exists()


def test_save_refuses_bad_arguments_and_writes_nothing(hub_tiny_model, tmp_path):
    model, tokenizer = hub_tiny_model
    with pytest.raises(ValueError, match="`repo_id` must look like"):
        save_for_hub(model, tokenizer, tmp_path / "a", repo_id="no-namespace")
    with pytest.raises(TypeError, match="`results` must be a dict"):
        save_for_hub(model, tokenizer, tmp_path / "b", results=[1.0])
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="output_dir"):
        save_for_hub(model, tokenizer, tmp_path / "file")
    with pytest.raises(ValueError, match="empty"):  # the example sentence is checked while staging
        save_for_hub(model, tokenizer, tmp_path / "c", example=" ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("repo_id", ["name-only", "a/b/c", "/name", "user/", "user/na me", "user/a--b", "user/a..b", 42, None])
def test_repo_id_of_the_wrong_form_is_refused(repo_id):
    with pytest.raises(ValueError, match="`repo_id` must look like 'user-or-org/model-name'"):
        check_repo_id(repo_id)


@pytest.mark.slow
def test_card_usage_snippets_run_verbatim_against_the_folder(hub_tiny_folder, run_without_package):
    """What a visitor pastes: the card's Python blocks as written, with the repository id standing for the
    folder that from_pretrained would download."""
    card = ModelCard.load(hub_tiny_folder / "README.md")
    repo_id = card_repo_id(card)
    assert repo_id == "your-name/tiny-en-es"
    blocks = re.findall(r"^```python\n(.*?)^```", card.text, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 2
    code = "\n".join(blocks).replace(repr(repo_id), repr(str(hub_tiny_folder)))
    assert repo_id not in code
    out = run_without_package(code + "\nprint(translate(['In the beginning.'])[0]['translation_text'] != '')\n")
    assert out.strip().splitlines()[-1] == "True"


def test_push_uploads_the_folder_to_the_repo(hub_tiny_folder, tmp_path, monkeypatch):
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "tiny-en-es")
    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(("create", repo_id, kw)) or f"https://huggingface.co/{repo_id}")
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.append(("upload", kw, (folder / "README.md").read_text())))
    url = push_folder(folder, "someone/tiny-en-es", token="hf_test", private=True)
    assert url == "https://huggingface.co/someone/tiny-en-es"
    (create, repo_id, create_kw), (upload, upload_kw, uploaded_card) = calls
    assert (create, repo_id, create_kw["private"], create_kw["token"], create_kw["exist_ok"]) == ("create", "someone/tiny-en-es", True, "hf_test", True)
    assert upload == "upload"
    assert upload_kw["repo_id"] == "someone/tiny-en-es" and upload_kw["folder_path"] == str(folder)
    assert upload_kw["token"] == "hf_test" and upload_kw["repo_type"] == "model"
    assert "your-name/" not in uploaded_card and "from_pretrained('someone/tiny-en-es'" in uploaded_card


def test_push_writes_the_repo_id_into_the_card_before_upload(hub_tiny_folder, tmp_path, monkeypatch):
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "quickstart")
    uploaded = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: f"https://huggingface.co/{repo_id}")
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: uploaded.append(ModelCard.load(folder / "README.md")))
    push_folder(folder, "alice/x", token="hf_test")
    (card,) = uploaded
    assert card_repo_id(card) == "alice/x" and "your-name" not in card.content
    assert "vanilla-transformer translate --model alice/x " in card.text and card.text.startswith("\n# x\n")
    assert card.data.model_name == "x" and {r.metric_type for r in card.data.eval_results} == {"bleu", "chrf"}
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.fixture
def no_upload(monkeypatch):
    """Any attempt to reach the Hub fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Hub was called")

    monkeypatch.setattr(huggingface_hub, "create_repo", refuse)
    monkeypatch.setattr(huggingface_hub, "upload_folder", refuse)


@pytest.mark.parametrize("missing, message", [
    ("model.safetensors", "weights"), ("tokenizer.json", "tokenizer"), ("config.json", "config.json"),
    ("modeling_vanilla_transformer.py", "modeling_vanilla_transformer.py"),
    ("pipeline_vanilla_transformer.py", "pipeline_vanilla_transformer.py"),
])
def test_incomplete_folder_is_not_uploaded(hub_tiny_folder, tmp_path, no_upload, missing, message):
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "copy")
    (folder / missing).unlink()
    with pytest.raises(ValueError, match=f"not a complete model folder; missing: .*{message}"):
        push_folder(folder, "someone/tiny", token="hf_test")


def test_push_refuses_bad_repo_id_missing_folder_and_missing_token(hub_tiny_folder, tmp_path, no_upload, monkeypatch):
    with pytest.raises(ValueError, match="`repo_id` must look like"):
        push_folder(hub_tiny_folder, "tiny", token="hf_test")
    with pytest.raises(FileNotFoundError, match="`folder` is not a folder"):
        push_folder(tmp_path / "nowhere", "someone/tiny", token="hf_test")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ValueError, match="No Hugging Face token"):
        push_folder(hub_tiny_folder, "someone/tiny")
