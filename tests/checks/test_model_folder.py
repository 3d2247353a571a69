"""The gate of a model folder: its config checked against its weights (each safetensors header read once), and every
field the package reads in the fields table, bounded, and listed in docs/folder-fields.md."""

import json
import re
from pathlib import Path

import pytest
import safetensors
from safetensors.torch import save_model

from vanilla_transformer.checks.folder_fields import (
    CONFIG_FILE,
    CTRANSLATE2_CONFIG,
    FIELDS,
    GENERATION_FILE,
    OPTIONS_FILE,
    TOKENIZER_CONFIG,
    Context,
    field_problems,
    fields_table,
)
from vanilla_transformer.modeling import configuration_vanilla_transformer as configuration
from vanilla_transformer.checks.model_folder import check_config_fits_weights
from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration


def test_each_weights_file_is_opened_once(tmp_path, monkeypatch):
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=64)
    config.save_pretrained(tmp_path)
    save_model(VanillaTransformerForConditionalGeneration(config), str(tmp_path / "model.safetensors"))
    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda path, *args, **kwargs: opened.append(path) or
                        real_open(path, *args, **kwargs))

    check_config_fits_weights(tmp_path, config)

    assert opened == [str(tmp_path / "model.safetensors")]


# --- the fields table: every field the package reads, checked, and listed in docs/folder-fields.md ---

PACKAGE = Path(__file__).parents[2] / "vanilla_transformer"
BOOKKEEPING = {"transformers_version", "_from_model_config", "architectures", "auto_map", "custom_pipelines", "dtype",
               "is_encoder_decoder"}  # written by transformers for itself; no decoding or building reads them from a folder


def test_the_docs_table_is_the_one_the_code_checks_against():
    assert (PACKAGE.parent / "docs" / "folder-fields.md").read_text() == fields_table(), \
        "regenerate: python -c \"from vanilla_transformer.checks.folder_fields import fields_table; print(fields_table(), end='')\" > docs/folder-fields.md"


def test_the_config_rows_are_the_fields_the_configuration_validates():
    validated = {*configuration.CHOICES, *configuration.SIZE_FIELDS, *configuration.PROBABILITIES, *configuration.FLAGS,
                 *configuration.TOKEN_IDS, *configuration.OPTIONAL_STRINGS, "layer_norm_eps", "model_type"}
    assert set(FIELDS[CONFIG_FILE]) == validated


def test_every_generation_setting_the_package_reads_is_in_the_table():
    source = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    read = set(re.findall(r'\bsetting\("(\w+)"', source)) | set(re.findall(r"generation_config\.(\w+)\b", source))
    read -= {"json", "to_dict", "to_json_file", "save_pretrained", "from_pretrained", "validate"}
    assert read <= set(FIELDS[GENERATION_FILE]), sorted(read - set(FIELDS[GENERATION_FILE]))


def test_every_field_a_saved_folder_and_its_export_hold_is_in_the_table(hub_tiny_model, tmp_path):
    from vanilla_transformer.export.ctranslate2 import export_ctranslate2
    from vanilla_transformer.hub import save_for_hub

    model, tokenizer = hub_tiny_model
    folder = save_for_hub(model, tokenizer, tmp_path / "model")
    for name in (CONFIG_FILE, GENERATION_FILE, TOKENIZER_CONFIG):
        assert set(json.loads((folder / name).read_text())) - BOOKKEEPING <= set(FIELDS[name]), name
    pytest.importorskip("ctranslate2")
    export = export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    assert set(json.loads((export / OPTIONS_FILE).read_text())) == set(FIELDS[OPTIONS_FILE])
    assert set(json.loads((export / "config.json").read_text())) <= set(FIELDS[CTRANSLATE2_CONFIG])


CONTEXT = Context(vocab_size=600, eos_token_ids=frozenset({2}))


@pytest.mark.parametrize("fields, expected", [
    ({"suppress_tokens": [2]}, "`suppress_tokens` must be a list without the end token (2), which ends a sentence; got [2]"),
    ({"begin_suppress_tokens": [7, 2]}, "`begin_suppress_tokens` must be a list without the end token (2)"),
    ({"suppress_tokens": list(range(5, 600)) * 2}, "`suppress_tokens` must be a list of at most 600 token ids"),
    ({"bad_words_ids": [[2]]}, "`bad_words_ids` must be lists of which none is the end token alone"),
    ({"max_length_offset": 10**9}, "`max_length_offset` must be an integer in 1..4096; got 1000000000"),
    ({"length_penalty_style": "evil"}, "`length_penalty_style` must be one of 'gnmt', 'transformers'; got 'evil'"),
    ({"eos_token_id": 600}, "`eos_token_id` must be a token id in 0..599, or a list of them; got 600"),
    ({"max_length": True}, "`max_length` must be an integer in 1..4096; got True"),
])
def test_decoding_defaults_out_of_bounds_are_named(fields, expected):
    assert any(problem.startswith(expected) for problem in field_problems(GENERATION_FILE, fields, CONTEXT)), \
        field_problems(GENERATION_FILE, fields, CONTEXT)


def test_the_saved_decoding_defaults_pass():
    saved = {"num_beams": 4, "length_penalty": 0.6, "length_penalty_style": "gnmt", "max_length_offset": 50,
             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "decoder_start_token_id": 0, "bad_words_ids": [[2, 5]]}
    assert field_problems(GENERATION_FILE, saved, CONTEXT) == []


def test_a_settings_file_past_its_bound_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    from vanilla_transformer.checks.files import read_json

    path = tmp_path / "config.json"
    path.write_text('{"model_type": "vanilla_transformer"' + " " * 2_000_000 + "}")
    monkeypatch.setattr(json, "loads", lambda *args, **kwargs: pytest.fail("parsed"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} is 2,000,037 bytes, more than such a file holds "
                                         r"\(at most 1,048,576\); it is not read$"):
        read_json(path, 1 << 20)


# --- loading: a model is built from a folder past the gate (`CheckedFolder.load`); `load_model` adds the tokenizer ---


def test_a_model_is_built_only_from_a_folder_past_the_gate(tmp_path, monkeypatch):
    from vanilla_transformer import inference
    from vanilla_transformer.checks import model_folder

    VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=64)).save_pretrained(tmp_path)
    checked = model_folder.check_model_folder(tmp_path, needs_tokenizer=False)
    assert isinstance(checked, model_folder.CheckedFolder)
    assert checked.folder == tmp_path and checked.config.d_model == 64 and not checked.adapter

    def gate(folder, **kwargs):
        raise ValueError(f"gate ran on {folder}")

    monkeypatch.setattr(inference, "check_model_folder", gate)
    with pytest.raises(ValueError, match="gate ran"):
        inference.load_model(tmp_path)
    model = checked.load(dropout=0.25)  # overrides still reach the config
    assert model.config.dropout == 0.25
    assert not any(hasattr(model_folder, name) for name in ("load_checked", "load_pretrained", "_load_weights"))
