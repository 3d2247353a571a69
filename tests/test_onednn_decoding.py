"""Decoding on oneDNN (onednn_decoding.py, the package's): chosen when the package loads a model, from a timing of
both kernels on its own decoder shapes, and never where our loops could not use oneDNN; the packed products give
nn.Linear's numbers, only inside a call of our loops, in the calling thread alone; a saved folder's files hold none
of it."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

from vanilla_transformer import onednn_decoding
from vanilla_transformer.modeling import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling import search as loops
from vanilla_transformer.onednn_decoding import (
    OnednnDecoding,
    PackedLinear,
    choose_onednn_decoding,
    current_packed_weights,
    onednn_is_faster,
    pack_weight,
    packed_weights,
)

pytestmark = pytest.mark.skipif(not onednn_decoding.ONEDNN_LINEAR, reason="torch without oneDNN's packed linear")

SENTENCES = ["Jesus wept.", "In the beginning God created the heavens and the earth.", "Amen."]


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
    assert model.decoding_context is None  # built, not loaded by the package: torch's own kernel
    d_model, d_ff, vocab = model.config.d_model, model.config.d_ff, model.config.vocab_size
    shapes = {(d_model, d_model), (d_model, d_ff), (d_ff, d_model), (d_model, vocab)}
    chosen = choose_onednn_decoding(model)
    assert chosen is model.decoding_context
    assert (chosen.shapes if faster else chosen) == (shapes if faster else None)
    assert set(timed) == shapes and len(timed) == len(shapes)  # each shape timed once, on its own


def test_only_the_shapes_timed_faster_are_packed(monkeypatch):
    """oneDNN wins the output projection and loses the narrow products (as on a CPU where MKL wins those): our
    loops pack the projection alone."""
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=96)  # the projection's shape its own
    model = VanillaTransformerForConditionalGeneration(config).eval()
    head = model.get_output_embeddings()
    wide = (head.in_features, head.out_features)
    monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes: shapes == [wide])
    assert choose_onednn_decoding(model).shapes == {wide}
    packed = [m for m in (*model.get_decoder().modules(), head)
              if type(m) is torch.nn.Linear and model.decoding_context.worth_packing(model, m, rows=4)]
    assert packed == [head]


@pytest.mark.parametrize("unusable", ["fast_paths", "bf16", "mkldnn"])
def test_nothing_is_timed_where_our_loops_cannot_use_onednn(monkeypatch, unusable):
    monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes: pytest.fail("timed"))
    model = _model(fast_paths=unusable != "fast_paths")
    if unusable == "bf16":
        model = model.to(torch.bfloat16)
    if unusable == "mkldnn":
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert choose_onednn_decoding(model) is None and model.decoding_context is None


@pytest.mark.slow
def test_a_model_loaded_by_the_package_decodes_on_the_kernel_timed_faster(hub_tiny_folder, monkeypatch):
    from vanilla_transformer.inference import load_model

    for faster in (True, False):
        monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes, faster=faster: faster)
        model, _ = load_model(hub_tiny_folder, "cpu")
        assert (model.decoding_context is not None) is faster


def test_another_model_is_left_as_it_is(monkeypatch):
    from transformers import MarianConfig, MarianMTModel

    monkeypatch.setattr(onednn_decoding, "onednn_is_faster", lambda shapes: pytest.fail("timed"))
    config = MarianConfig(vocab_size=64, pad_token_id=0, decoder_start_token_id=0, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    marian = MarianMTModel(config)
    assert choose_onednn_decoding(marian) is None and not hasattr(marian, "decoding_context")


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


# A call of our loops: what it packs, and what it decodes.


@pytest.fixture(scope="module")
def model_and_batch(hub_tiny_model):
    model, tokenizer = hub_tiny_model
    return model, tokenizer(SENTENCES, return_tensors="pt", padding=True)


def _linear_maps(model) -> list:
    return [module for module in model.modules() if type(module) in (torch.nn.Linear, PackedLinear)]


@pytest.fixture
def packed_counts(monkeypatch):
    """For each call of our loops: how many of the model's linear maps it ran on packed weights."""
    seen = []
    context = loops.call_context

    @contextlib.contextmanager
    def spy(model, rows):
        with context(model, rows):
            seen.append(sum(module in current_packed_weights() for module in _linear_maps(model)))
            yield

    monkeypatch.setattr(loops, "call_context", spy)
    return seen


@pytest.fixture
def onednn_faster(monkeypatch):
    """oneDNN asked for in decoding, every shape (which kernel is faster depends on the machine)."""
    monkeypatch.setattr(VanillaTransformerForConditionalGeneration, "decoding_context", OnednnDecoding())


def test_a_packed_linear_map_gives_the_numbers_of_nn_linear():
    """A linear map on oneDNN with its weight packed: nn.Linear's numbers, each row independent of the others
    (rows leave the batch); nn.Linear itself with gradients on and when not packed."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(24, 40), torch.randn(40, 24)
    expected = F.linear(x, linear.weight, linear.bias)
    with torch.no_grad(), packed_weights({linear: pack_weight(linear.weight)}):
        with torch.profiler.profile() as profile:
            packed = linear(x)
        assert "mkldnn::_linear_pointwise" in {event.key for event in profile.key_averages()}
        torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
        for rows in (1, 3, 17):
            assert torch.equal(linear(x[:rows]), packed[:rows])
        torch.testing.assert_close(linear(x[:5, None]), expected[:5, None], rtol=1e-5, atol=1e-5)  # (B, 1, d)
        with torch.enable_grad():
            assert linear(x).grad_fn is not None  # with gradients: nn.Linear's own product
    with torch.no_grad():
        assert torch.equal(linear(x), expected)


def test_packing_makes_a_map_a_packed_linear_for_the_calls_that_pack_it_alone():
    """`packed_weights` makes the map a PackedLinear while a call (or several) packs it, and nn.Linear again after
    the last; the product is nn.Linear's, and a copy made meanwhile is a plain nn.Linear."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(24, 40), torch.randn(8, 24)
    expected = F.linear(x, linear.weight, linear.bias)
    with torch.no_grad(), packed_weights({linear: pack_weight(linear.weight)}):
        assert type(linear) is PackedLinear
        with packed_weights({linear: pack_weight(linear.weight)}):  # a second caller of a shared model
            torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
        assert type(linear) is PackedLinear  # the first still packs it
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
        assert type(copy.deepcopy(linear)) is torch.nn.Linear
    assert type(linear) is torch.nn.Linear and not onednn_decoding._PACKING
    with torch.no_grad():
        assert torch.equal(linear(x), expected)


class NoLookUp:
    """Stands in for the packed weights' context variable: any read of it fails."""

    def get(self):
        raise AssertionError("the packed weights were looked up")

    set = reset = get


def test_training_never_looks_up_packed_weights(monkeypatch):
    """Outside a call that packs them, the linear maps are nn.Linear: a training step, forward and backward, never
    reads the packed weights' context, whatever the model's decoding_context."""
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=64))
    model.decoding_context = OnednnDecoding()
    assert {type(module) for module in _linear_maps(model)} == {torch.nn.Linear}
    monkeypatch.setattr(onednn_decoding, "_PACKED", NoLookUp())
    batch = {"input_ids": torch.randint(4, 64, (2, 5)), "labels": torch.randint(4, 64, (2, 4))}
    model.train()(**batch).loss.backward()
    with torch.no_grad():  # evaluation, and transformers' own loops, alike
        model.eval()(**batch)


@pytest.mark.parametrize("mode", ["greedy", "beam, GNMT"])
def test_generate_packs_the_decoder_and_the_projection_and_decodes_what_the_plain_path_decodes(
    model_and_batch, mode, monkeypatch, packed_counts, onednn_faster
):
    model, batch = model_and_batch
    # Greedy search asked for per-step scores runs in transformers' loop, which packs nothing.
    options = dict(num_beams=1) if mode == "greedy" else dict(
        num_beams=4, length_penalty_style="gnmt", length_penalty=0.6, return_dict_in_generate=True, output_scores=True)
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.mkldnn, "enabled", False)  # torch's own switch
        plain = model.generate(**batch, **options)
    assert packed_counts == [0]
    packed = model.generate(**batch, **options)
    # Every linear map of the decoder (4 per attention, 2 in the FFN) and the output projection.
    assert packed_counts[1:] == [len(model.model.decoder.layers) * 10 + 1]
    assert not current_packed_weights()  # only while the loop runs
    assert {type(module) for module in _linear_maps(model)} == {torch.nn.Linear}
    if mode == "greedy":
        assert torch.equal(packed, plain)
        return
    assert torch.equal(packed.sequences, plain.sequences)
    for a, b in zip(packed.scores, plain.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_search_that_fails_leaves_nothing_packed(model_and_batch, onednn_faster):
    model, batch = model_and_batch

    def fail(input_ids, scores):
        assert any(module in current_packed_weights() for module in _linear_maps(model))
        raise RuntimeError("a processor failed")

    with pytest.raises(RuntimeError, match="a processor failed"):
        model.generate(**batch, num_beams=1, logits_processor=[fail])
    assert not current_packed_weights()
    assert {type(module) for module in _linear_maps(model)} == {torch.nn.Linear}


def test_what_is_worth_packing(model_and_batch, monkeypatch, packed_counts, onednn_faster):
    """One of the shapes asked for, more than one row, oneDNN on, no autocast, float32 weights of the CPU, and the
    switch on."""
    model, batch = model_and_batch
    lm_head, every = model.get_output_embeddings(), model.decoding_context
    assert every.worth_packing(model, lm_head, rows=2)
    assert not every.worth_packing(model, lm_head, rows=1)  # one sentence: not worth packing
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast runs the product in its own dtype
        assert not every.worth_packing(model, lm_head, rows=2)
    assert not every.worth_packing(model, torch.nn.Linear(4, 4, dtype=torch.bfloat16), rows=2)
    assert not every.worth_packing(model, torch.nn.Linear(4, 4, device="meta"), rows=2)  # offloaded
    with monkeypatch.context() as patch:
        patch.setattr(model.config, "fast_paths", False, raising=False)  # ours
        assert not every.worth_packing(model, lm_head, rows=2)
    assert not OnednnDecoding([(1, 2)]).worth_packing(model, lm_head, rows=2)  # not one of its shapes
    one = {name: value[:1] for name, value in batch.items()}
    model.generate(**one, num_beams=1)
    model.generate(**one, num_beams=2, length_penalty_style="gnmt")  # two rows: packed
    assert packed_counts[0] == 0 and packed_counts[1] > 0


@pytest.mark.slow
def test_generate_times_no_kernel_and_packs_only_where_asked():
    """Which kernel decodes is the model's `decoding_context`, set before `generate` (torch's own by default), not
    timed inside it: in a fresh process a default model packs no weight, not even to time a kernel, and the same
    model given oneDNN decoding packs them and decodes the same tokens."""
    code = textwrap.dedent("""
        import torch
        from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
        from vanilla_transformer import onednn_decoding

        packed = []
        pack_weight = onednn_decoding.pack_weight
        onednn_decoding.pack_weight = lambda weight: packed.append(weight.shape) or pack_weight(weight)
        torch.manual_seed(0)
        model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=40)).eval()
        source = torch.randint(4, 40, (3, 6), generator=torch.Generator().manual_seed(0))
        outputs = [model.generate(source, num_beams=beams, max_new_tokens=5) for beams in (1, 4)]
        print(len(packed))
        model.decoding_context = onednn_decoding.OnednnDecoding()
        same = [torch.equal(model.generate(source, num_beams=beams, max_new_tokens=5), out)
                for beams, out in zip((1, 4), outputs)]
        print(len(packed) > 0, all(same))
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True", "True"]

