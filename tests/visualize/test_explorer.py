"""The attention explorer page: its data, its size, and bad input (tests/visualize/test_browser.py opens it in a browser)."""

import base64
import json
import re

import pytest
import torch

from vanilla_transformer.visualize.attention_maps import KINDS, collect_attentions
from vanilla_transformer.cli import main
from vanilla_transformer.visualize.explorer import (
    MAX_BYTES,
    NEURON_BYTES,
    explorer_data,
    explorer_html,
    explorer_record,
    save_explorer,
)
from vanilla_transformer.visualize.neuron_view import neuron_tensors

SENTENCE = "Jesús wept; ¿why? In the beginning God created the heavens and the earth."


@pytest.fixture(scope="module")
def record(hub_tiny_model):
    model, tokenizer = hub_tiny_model
    return collect_attentions(model, tokenizer, SENTENCE, num_beams=2, max_new_tokens=14)


def _unpack(packed):
    values = torch.frombuffer(bytearray(base64.b64decode(packed["values"])), dtype=torch.uint8).float() / 255
    shape = (packed["layers"], packed["heads"], packed["queries"])
    if packed["keep"] is None:
        return values.view(*shape, packed["keys"])
    indices = torch.frombuffer(bytearray(base64.b64decode(packed["indices"])), dtype=torch.int16).long()
    dense = torch.zeros(*shape, packed["keys"])
    return dense.scatter_(-1, indices.view(*shape, -1), values.view(*shape, -1))


def test_the_explorers_record_adds_the_neuron_view_that_collect_attentions_leaves_out(hub_tiny_model, record):
    model, tokenizer = hub_tiny_model
    assert record.neurons is None  # the maps, the model card and the API's weights compute no neuron view
    full = explorer_record(model, tokenizer, SENTENCE, num_beams=2, max_new_tokens=14)
    assert full.target_ids == record.target_ids and full.translation == record.translation
    source, output = torch.tensor([record.source_ids]), torch.tensor([record.target_ids])
    expected = neuron_tensors(model, source, None, output[:, :-1])
    for kind, numbers in expected.kinds.items():
        torch.testing.assert_close(full.neurons.kinds[kind].scores, numbers.scores)
    assert explorer_data(full)["neurons"]["kept"] > 0 and explorer_data(record)["neurons"] is None


def test_the_page_holds_every_weight_to_1_in_510_and_loads_nothing(record):
    page = explorer_html(record)
    data = explorer_data(record)
    for kind, packed in data["weights"].items():
        assert packed["keep"] is None
        torch.testing.assert_close(_unpack(packed), record.weights(kind), atol=0.5 / 255 + 1e-6, rtol=0)
    assert data["source"]["pieces"] == record.source_pieces and data["target"]["ids"] == record.target_ids
    assert data["settings"]["beam size"] == "2" and data["settings"]["longest output"] == "14 tokens"
    # One file: no address, no external script, style or font; the policy forbids any request.
    assert "default-src 'none'" in page
    assert not re.search(r"https?://|//cdn|<link|\bsrc=|@import|url\(", page.replace('"http://www.w3.org/2000/svg"', ""))
    embedded = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1))
    assert embedded["sentence"] == SENTENCE


def test_a_normal_sentence_on_the_base_model_makes_a_page_of_about_1_4_mb(record, synthetic_record):
    """Base model: 6 + 6 layers, 8 heads; 20 source and 22 target tokens. The weights take 110 KB, the neuron
    view of every head and token (q and k of 64 dimensions, scores and weights, in float16) the rest."""
    assert 100_000 < len(explorer_html(synthetic_record(20, 22, layers=6, heads=8)).encode()) < 200_000
    base = synthetic_record(20, 22, layers=6, heads=8, neurons=True)
    neurons = explorer_data(base)["neurons"]
    assert neurons["kept"] == neurons["of"] == 3 * 6 * 8
    assert [info["queries"] for info in neurons["kinds"].values()] == [20, 22, 22]  # encoder, decoder, cross
    assert 1_200_000 < len(explorer_html(base).encode()) < 1_600_000
    assert len(explorer_html(record).encode()) < 250_000  # the tiny model (2 + 2 layers, 4 heads) on 30-odd tokens


def test_a_1000_token_sentence_keeps_each_querys_strongest_keys(synthetic_record):
    """The small model's shape (3 + 3 layers, 4 heads): 36M weights would be 48 MB of page, and the neuron view of
    every head and token 300 MB."""
    record = synthetic_record(1000, 1000, neurons=True)
    page = explorer_html(record)
    assert len(page.encode()) < (MAX_BYTES + NEURON_BYTES) * 4 / 3 + 100_000  # about 5.4 MB, as without the neuron view
    data = explorer_data(record)
    keep = data["weights"]["cross"]["keep"]
    assert 20 <= keep <= 30
    # the neuron view keeps the first 8 query tokens of each kind, and the heads that fit, layer by layer
    neurons = data["neurons"]
    assert [info["queries"] for info in neurons["kinds"].values()] == [8, 8, 8]
    assert 4 <= neurons["kept"] < neurons["of"] == 36
    kept = sorted((int(key.split(",")[0]), int(key.split(",")[1]), kind) for kind, info in neurons["kinds"].items() for key in info["heads"])
    assert kept == sorted((layer, head, kind) for layer in range(3) for head in range(4) for kind in KINDS)[:neurons["kept"]]
    for kind, packed in data["weights"].items():
        assert packed["keep"] == keep
        kept = _unpack(packed)
        strongest = record.weights(kind).topk(keep, dim=-1).values
        torch.testing.assert_close(kept.topk(keep, dim=-1).values, strongest, atol=0.5 / 255 + 1e-6, rtol=0)
        assert packed["kept_weight"] == pytest.approx(float(strongest.sum(-1).mean()), abs=1e-3)


def test_save_explorer_refuses_bad_paths_and_leaves_nothing_half_written(record, tmp_path, monkeypatch):
    assert save_explorer(record, tmp_path / "out" / "explorer.html").read_text(encoding="utf-8") == explorer_html(record)
    with pytest.raises(ValueError, match=r"`path` must name an \.html file"):
        save_explorer(record, tmp_path / "explorer.png")
    with pytest.raises(ValueError, match="`path` is a folder"):
        save_explorer(record, tmp_path / "out")
    with pytest.raises(TypeError, match="`record` must be an AttentionRecord"):
        explorer_html({"cross_attention": record.cross_attention})

    def broken_write(self, *args, **kwargs):
        self.open("w").write("<html>half")
        raise OSError("disk full")

    monkeypatch.setattr("pathlib.Path.write_text", broken_write)
    with pytest.raises(OSError, match="disk full"):
        save_explorer(record, tmp_path / "out" / "explorer.html")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["explorer.html"]  # the old page, whole


def test_the_attention_command_writes_only_the_page_with_html(hub_tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["attention", "--model", str(hub_tiny_folder), "Jesus wept.", "--html", "explorer.html", "--num-beams", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["explorer.html"]  # no attention/ folder of PNGs
    assert "explorer.html" in capsys.readouterr().out
    page = (tmp_path / "explorer.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="data">(.*?)</script>', page, re.S).group(1))
    assert data["model"] == str(hub_tiny_folder) and data["sentence"] == "Jesus wept."
    assert data["settings"] == {"beam size": "1 (greedy)", "longest output": "source length + 50 tokens"}  # §6.1


@pytest.mark.parametrize("argv, message", [
    (["attention", "--model", "{folder}", ""], "`text` is empty"),
    (["attention", "--model", "{folder}", "x", "--html", "{tmp}/explorer.png"], r"`--html` must name an \.html file"),
    (["attention", "--model", "{folder}", "x", "--html", "{tmp}"], "`--html` is a folder"),
    (["attention", "--model", "{folder}", "x", "--html", "{tmp}/e.html", "--num-beams", "0"], "--num-beams must be a positive integer"),
    (["attention", "--model", "{marian}", "x", "--html", "{tmp}/e.html"], "returned no attention weights"),
    (["serve", "--model", "{marian}"], "returned no attention weights"),
    (["serve", "--model", "{folder}", "--port", "70000"], "--port must be in 1..65535"),
])
def test_bad_input_is_a_usage_error_and_writes_nothing(argv, message, hub_tiny_folder, marian_folder, tmp_path, capsys):
    paths = {"folder": hub_tiny_folder, "marian": marian_folder, "tmp": tmp_path}
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(**paths) for arg in argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert re.search(message, error), error
    assert list(tmp_path.iterdir()) == []
