"""Attention heat maps: one PNG per layer and kind, an overview, and bertviz's data layout."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import matplotlib.image
import pytest
import torch
from transformers import GenerationConfig

from vanilla_transformer.visualize.attention_maps import (
    AXIS_LABELS, BERTVIZ_NOTE, DECODER_ROWS, KINDS, bertviz_data, collect_attentions, decoding_settings, plot_layer,
    save_attention_maps,
)
from vanilla_transformer.modeling.generation import paper_generation_config
from vanilla_transformer.inference import load_model


@pytest.fixture(scope="module")
def record(hub_tiny_model, hub_example):
    model, tokenizer = hub_tiny_model
    return collect_attentions(model, tokenizer, hub_example, num_beams=1, max_new_tokens=12)


def test_weights_are_probabilities_over_the_right_tokens(record, hub_tiny_model):
    model, tokenizer = hub_tiny_model
    config = model.config
    source, target = len(record.encoder_tokens), len(record.decoder_tokens)
    assert record.encoder_tokens == tokenizer.convert_ids_to_tokens(tokenizer(record.source)["input_ids"])
    assert record.encoder_tokens[-1] == "</s>"
    # The decoder read the start token and all but the last output token (at most 12 were generated).
    assert record.decoder_tokens[0] == tokenizer.convert_ids_to_tokens(config.decoder_start_token_id)
    assert 2 <= target <= 12
    assert record.target_labels[0] == "<start>" and len(record.target_labels) == target
    assert record.encoder_attention.shape == (config.encoder_layers, config.num_heads, source, source)
    assert record.decoder_attention.shape == (config.decoder_layers, config.num_heads, target, target)
    assert record.cross_attention.shape == (config.decoder_layers, config.num_heads, target, source)
    for kind in KINDS:
        torch.testing.assert_close(record.weights(kind).sum(-1), torch.ones(record.weights(kind).shape[:-1]))
    assert torch.all(record.decoder_attention.triu(1) == 0)  # no peeking ahead (§3.2.3)
    # The heat map's target axis is what the decoder read: the translation minus its last token.
    read_so_far = tokenizer.decode(tokenizer.convert_tokens_to_ids(record.decoder_tokens[1:]), skip_special_tokens=True)
    assert record.translation.startswith(read_so_far)


@pytest.mark.slow
def test_one_png_per_layer_and_kind_plus_overview_and_bertviz_data(record, hub_tiny_model, tmp_path):
    model, _ = hub_tiny_model
    paths = save_attention_maps(record, tmp_path / "maps")
    names = sorted(p.name for p in paths)
    expected = [f"{kind}_layer{n}.png" for kind, layers in
                (("encoder", model.config.encoder_layers), ("decoder", model.config.decoder_layers), ("cross", model.config.decoder_layers))
                for n in range(1, layers + 1)]
    assert names == sorted(expected + ["overview.png", "bertviz.pt"])
    assert sorted(p.name for p in (tmp_path / "maps").iterdir()) == names  # no staging folder left behind
    for name in expected + ["overview.png"]:
        image = matplotlib.image.imread(tmp_path / "maps" / name)
        assert image.shape[0] > 300 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # drawn, not blank


def drawn(monkeypatch) -> dict:
    """{file name: (the figure's texts, the colour limits of its heat maps)}, read from each figure as it is saved."""
    import matplotlib.text

    from vanilla_transformer.visualize import attention_maps

    figures, save = {}, attention_maps._save

    def recording_save(fig, path):
        texts = {text.get_text() for text in fig.findobj(matplotlib.text.Text)}
        limits = {image.get_clim() for ax in fig.axes for image in ax.get_images()}
        figures[Path(path).name] = (texts, limits)
        return save(fig, path)

    monkeypatch.setattr(attention_maps, "_save", recording_save)
    return figures


def test_every_png_names_its_rows_and_columns_and_colours_every_layer_from_0_to_1(record, monkeypatch, tmp_path):
    """One convention for decoder rows (the token read), written on each picture, and one colour scale for every
    layer and file, so that a colour means the same weight in each."""
    figures = drawn(monkeypatch)
    save_attention_maps(record, tmp_path / "maps")
    assert len(figures) == 2 * 3 + 1
    for name, (texts, limits) in figures.items():
        kinds = KINDS if name == "overview.png" else [name.split("_")[0]]
        assert limits == {(0.0, 1.0)}, name
        assert any(DECODER_ROWS in text for text in texts) == any(kind != "encoder" for kind in kinds), name
        assert any("colours: 0 to 1, one scale for every layer" in text for text in texts), name
        assert {AXIS_LABELS[kind][0] for kind in kinds} <= texts, name
        if name != "overview.png":
            assert AXIS_LABELS[kinds[0]][1] in texts, name
    assert max(float(record.encoder_attention[layer].max()) for layer in range(2)) < 1  # the old per-layer scale differs


def test_a_layers_own_scale_is_an_option_that_says_so(record, monkeypatch, tmp_path):
    figures = drawn(monkeypatch)
    plot_layer(record, "cross", 0, tmp_path / "cross.png", vmax=None)
    texts, limits = figures["cross.png"]
    top = float(record.cross_attention[0].max())
    assert list(limits) == [(0.0, pytest.approx(top))] and any("this layer's largest weight" in text for text in texts)


@pytest.mark.slow
def test_the_attention_command_says_bertviz_needs_the_network_and_names_the_decoder_rows(hub_tiny_folder, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "vanilla_transformer.cli", "attention", "--model", str(hub_tiny_folder), "Jesus wept.",
         "--output-dir", str(tmp_path / "maps"), "--num-beams", "1", "--max-new-tokens", "6"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == BERTVIZ_NOTE and "from the network" in BERTVIZ_NOTE and DECODER_ROWS in BERTVIZ_NOTE
    assert (tmp_path / "maps" / "bertviz.pt").is_file()
    html = subprocess.run(
        [sys.executable, "-m", "vanilla_transformer.cli", "attention", "--model", str(hub_tiny_folder), "Jesus wept.",
         "--html", str(tmp_path / "page.html"), "--num-beams", "1", "--max-new-tokens", "6"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert html.returncode == 0 and BERTVIZ_NOTE not in html.stdout  # no bertviz data, no word on it


def test_bertviz_data_has_the_layout_bertviz_takes(record, tmp_path):
    """bertviz's model_view/head_view for encoder-decoder models take per-layer tuples of
    (batch=1, heads, queries, keys) tensors and token lists whose lengths match the axes."""
    path = tmp_path / "bertviz.pt"
    torch.save(bertviz_data(record), path)
    data = torch.load(path)
    assert set(data) == {"encoder_attention", "decoder_attention", "cross_attention", "encoder_tokens", "decoder_tokens"}
    source, target = len(data["encoder_tokens"]), len(data["decoder_tokens"])
    assert data["encoder_tokens"] == record.source_labels and data["decoder_tokens"] == record.target_labels  # readable
    for key, (queries, keys) in {"encoder_attention": (source, source), "decoder_attention": (target, target),
                                 "cross_attention": (target, source)}.items():
        assert isinstance(data[key], tuple)
        for layer in data[key]:
            assert torch.is_tensor(layer) and layer.dim() == 4
            assert layer.shape[0] == 1 and layer.shape[2:] == (queries, keys)
            # bertviz squeezes the batch and lists the weights: rows must be distributions
            torch.testing.assert_close(layer.squeeze(0).sum(-1), torch.ones(layer.shape[1], queries))


def test_bad_input(record, hub_tiny_model, tmp_path):
    model, tokenizer = hub_tiny_model
    with pytest.raises(ValueError, match="empty"):
        collect_attentions(model, tokenizer, "  ")
    with pytest.raises(TypeError, match="must be a string"):
        collect_attentions(model, tokenizer, ["a list"])
    with pytest.raises(ValueError, match="`kind` must be one of"):
        plot_layer(record, "self", 0, tmp_path / "x.png")
    with pytest.raises(ValueError, match="`layer` must be in 0..1"):
        plot_layer(record, "cross", 5, tmp_path / "x.png")
    old = tokenizer.model_max_length
    tokenizer.model_max_length = 8
    try:
        with pytest.raises(ValueError, match="at most 8"):
            collect_attentions(model, tokenizer, "And God said, Let there be light: and there was light.")
    finally:
        tokenizer.model_max_length = old


def test_a_marian_model_is_refused_before_it_translates(marian_folder):
    model, tokenizer = load_model(marian_folder, "cpu")
    model.generate = lambda *args, **kwargs: pytest.fail("it translated before finding out")
    with pytest.raises(ValueError, match=r"MarianMTModel, model_type 'marian'\) returned no attention weights with its 'sdpa'"):
        collect_attentions(model, tokenizer, "Jesus wept.")


def test_decoding_settings_say_what_the_translation_was_decoded_with(hub_tiny_model):
    config = hub_tiny_model[0].config
    paper = SimpleNamespace(generation_config=paper_generation_config(config))
    assert decoding_settings(paper) == {"beam size": "4", "length penalty": "0.6 (GNMT)", "longest output": "source length + 50 tokens"}
    assert decoding_settings(paper, num_beams=1, max_new_tokens=9) == {"beam size": "1 (greedy)", "longest output": "9 tokens"}
    plain = SimpleNamespace(generation_config=GenerationConfig(num_beams=3, max_new_tokens=40))
    assert decoding_settings(plain) == {
        "beam size": "3", "length penalty": "1 (transformers' |Y|^α)", "longest output": "source length + 50, at most 40 tokens",
    }


def test_plot_models_draws_one_panel_per_model_on_one_colour_scale(synthetic_record, tmp_path, monkeypatch):
    from vanilla_transformer.visualize import attention_maps

    records = {"scaled_dot": synthetic_record(9, 7), "location": synthetic_record(9, 11), "dot": synthetic_record(9, 5)}
    for record in records.values():
        record.source = "the same verse"
    scales = []
    draw = attention_maps._draw
    monkeypatch.setattr(attention_maps, "_draw", lambda ax, matrix, *args: scales.append(args[2]) or draw(ax, matrix, *args))
    path = attention_maps.plot_models(records, tmp_path / "models.png")
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 600 and image[..., :3].std() > 0.05
    largest = max(float(r.cross_attention[-1].mean(0).max()) for r in records.values())
    assert scales == [largest] * 3  # every panel: 0 to the largest mean weight of any panel
    records["dot"].source = "another verse"
    with pytest.raises(ValueError, match="different sentences"):
        attention_maps.plot_models(records, tmp_path / "bad.png")
    with pytest.raises(ValueError, match="empty"):
        attention_maps.plot_models({}, tmp_path / "bad.png")


@pytest.mark.slow
def test_attention_that_cannot_write_its_maps_leaves_no_folder_behind(hub_tiny_folder, tmp_path):
    """A full disk (here: a file-size limit, whose writes fail as a full disk's do) left an empty maps/ folder."""
    import os
    import resource
    import signal
    import subprocess
    import sys

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    maps = tmp_path / "maps"
    result = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "attention", "--model", str(hub_tiny_folder),
                             "--output-dir", str(maps), "--num-beams", "1", "Jesus wept."], capture_output=True,
                            text=True, timeout=300, preexec_fn=limited, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    # The machine's error (a limit on file size), not a usage error: status 1, as a full disk's.
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1].startswith("vanilla-transformer attention: error: ")
    assert not maps.exists()
