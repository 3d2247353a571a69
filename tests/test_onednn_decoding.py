"""The model's `onednn_decoding` is chosen when the package loads a model, from a timing of both kernels on its own
decoder shapes, and never where our loops could not use oneDNN."""

from __future__ import annotations

import time

import pytest
import torch

from vanilla_transformer import onednn_decoding
from vanilla_transformer.onednn_decoding import choose_onednn_decoding, onednn_is_faster
from vanilla_transformer.modeling import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

pytestmark = pytest.mark.skipif(not onednn_decoding.ONEDNN_LINEAR, reason="torch without oneDNN's packed linear")


def _model(**overrides):
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=64, **overrides)
    return VanillaTransformerForConditionalGeneration(config).eval()


def _slowed(kernel):
    def slow(*args):
        time.sleep(0.002)
        return kernel(*args)
    return slow


@pytest.mark.parametrize("slow_one, onednn_faster", [("onednn_linear", False), ("F", True)])
def test_the_faster_kernel_is_timed_on_the_shapes(monkeypatch, slow_one, onednn_faster):
    if slow_one == "F":
        monkeypatch.setattr(onednn_decoding.F, "linear", _slowed(torch.nn.functional.linear))
    else:
        monkeypatch.setattr(onednn_decoding, "onednn_linear", _slowed(onednn_decoding.onednn_linear))
    assert onednn_is_faster([(16, 32), (32, 64)], rows=4) is onednn_faster


@pytest.mark.parametrize("faster", [True, False])
def test_the_model_is_given_what_the_timing_says_for_its_decoder_shapes(monkeypatch, faster):
    timed = []
    monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes: timed.extend(shapes) or faster)
    model = _model()
    assert model.onednn_decoding is False  # built, not loaded by the package: torch's own kernel
    d_model, d_ff, vocab = model.config.d_model, model.config.d_ff, model.config.vocab_size
    shapes = {(d_model, d_model), (d_model, d_ff), (d_ff, d_model), (d_model, vocab)}
    chosen = choose_onednn_decoding(model)
    assert chosen == model.onednn_decoding == (shapes if faster else False)
    assert set(timed) == shapes and len(timed) == len(shapes)  # each shape timed once, on its own


def test_only_the_shapes_timed_faster_are_packed(monkeypatch):
    """oneDNN wins the output projection and loses the narrow products (as on a CPU where MKL wins those): our
    loops pack the projection alone."""
    from vanilla_transformer.modeling import fast_generation

    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=96)  # the projection's shape its own
    model = VanillaTransformerForConditionalGeneration(config).eval()
    head = model.get_output_embeddings()
    wide = (head.in_features, head.out_features)
    monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes: shapes == [wide])
    assert choose_onednn_decoding(model) == {wide}
    packed = [m for m in (*model.get_decoder().modules(), head)
              if isinstance(m, onednn_decoding.PackableLinear) and fast_generation.worth_packing(model, m, rows=4)]
    assert packed == [head]


@pytest.mark.parametrize("unusable", ["fast_paths", "bf16", "mkldnn"])
def test_nothing_is_timed_where_our_loops_cannot_use_onednn(monkeypatch, unusable):
    monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes: pytest.fail("timed"))
    model = _model(fast_paths=unusable != "fast_paths")
    if unusable == "bf16":
        model = model.to(torch.bfloat16)
    if unusable == "mkldnn":
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert choose_onednn_decoding(model) is False and model.onednn_decoding is False


@pytest.mark.slow
def test_a_model_loaded_by_the_package_decodes_on_the_kernel_timed_faster(hub_tiny_folder, monkeypatch):
    from vanilla_transformer.inference import load_model

    for faster in (True, False):
        monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes, faster=faster: faster)
        model, _ = load_model(hub_tiny_folder, "cpu")
        assert bool(model.onednn_decoding) is faster


def test_another_model_is_left_as_it_is(monkeypatch):
    from transformers import MarianConfig, MarianMTModel

    monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes: pytest.fail("timed"))
    config = MarianConfig(vocab_size=64, pad_token_id=0, decoder_start_token_id=0, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    marian = MarianMTModel(config)
    assert choose_onednn_decoding(marian) is False and not hasattr(marian, "onednn_decoding")


def test_onednn_is_chosen_only_where_timed_faster_by_the_margin(monkeypatch):
    """The two kernels are timed in turn, oneDNN must win by MARGIN, and the global random stream is not drawn
    from. A clock of its own: each kernel's call moves it on by that kernel's duration."""
    clock, durations = [0.0], {}

    def timed(name, kernel):
        def run(*args):
            clock[0] += durations[name]
            return kernel(*args)
        return run

    monkeypatch.setattr(onednn_decoding.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(onednn_decoding.F, "linear", timed("torch", torch.nn.functional.linear))
    monkeypatch.setattr(onednn_decoding, "onednn_linear", timed("onednn", onednn_decoding.onednn_linear))
    for torch_s, onednn_s, faster in ((10.0, 5.0, True), (10.0, 9.8, False), (10.0, 12.0, False)):
        durations.update(torch=torch_s, onednn=onednn_s)
        assert onednn_is_faster([(8, 16)], rows=3) is faster
    state = torch.random.get_rng_state()
    onednn_is_faster([(8, 16)], rows=3)
    assert torch.equal(torch.random.get_rng_state(), state)
