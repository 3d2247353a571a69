"""One model, many callers: threads decoding with one model each get what they decode alone, whatever
the interleaving; the model can be copied, pickled and saved while it decodes; an empty source, and a config
too large for this machine's memory, are refused in one line before any work.

Real threads on one real (tiny, trained) model; the worst interleaving is forced with threading.Event."""

import copy
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from vanilla_transformer import (
    VanillaTransformerConfig,
    VanillaTransformerForConditionalGeneration,
)
from vanilla_transformer.onednn_decoding import OnednnDecoding, current_packed_weights

SENTENCES = ["In the beginning God created the heavens and the earth.", "Jesus wept.", "And God said, Let there be light."]
# Each caller: its options, and the autocast dtype it decodes under (None: float32). Greedy without scores and
# beam search run in our loops, which pack the weights of several rows; autocast packs nothing.
CALLERS = {
    "greedy": (dict(num_beams=1), None),
    # the paper's ranking, our loop (which packs weights) whatever the model's own settings
    "beam 4": (dict(num_beams=4, length_penalty_style="gnmt", return_dict_in_generate=True, output_scores=True), None),
    "greedy, bf16 autocast": (dict(num_beams=1, return_dict_in_generate=True, output_scores=True), torch.bfloat16),
}
TIMEOUT = 300  # seconds a paused thread waits before the test gives up on it


@pytest.fixture(scope="module")
def own_model(hub_tiny_model):
    """A model of its own with the trained weights: the session's is also exported, traced and wrapped by
    other tests in the same process, which may leave their attributes on it."""
    trained, tokenizer = hub_tiny_model
    model = type(trained)(trained.config).eval()
    model.load_state_dict(trained.state_dict())
    model.generation_config = trained.generation_config
    return model, tokenizer


@pytest.fixture
def shared(own_model, monkeypatch):
    """The model, a batch of three sentences, and oneDNN asked for in decoding (which kernel is faster depends on
    the machine), so that each search over several rows packs its weights."""
    model, tokenizer = own_model
    monkeypatch.setattr(model, "decoding_context", OnednnDecoding())
    return model, tokenizer(SENTENCES, return_tensors="pt", padding=True)


def decode(model, batch, caller, **extra):
    """The caller's output as plain tensors: the tokens and, where asked for, each step's scores."""
    options, dtype = CALLERS[caller]
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model.generate(**batch, max_new_tokens=10, **options, **extra)
    return (out,) if isinstance(out, torch.Tensor) else (out.sequences, *out.scores)


def assert_same(got, expected, caller):
    """The same tokens, and scores equal to within what a thread pool shared with another caller can change in the
    products' summation order (another caller's weights would move them by far more: bf16 against fp32)."""
    assert len(got) == len(expected) and torch.equal(got[0], expected[0]), f"{caller}: not its solo tokens"
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got[1:], expected[1:])), \
        f"{caller}: not its solo scores"


class Threads:
    """Threads whose exceptions reach the test."""

    def __init__(self):
        self.threads, self.errors, self.results = [], [], {}

    def start(self, key, function, *args, **kwargs):
        def run():
            try:
                self.results[key] = function(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 (re-raised in the test's thread by join)
                self.errors.append(err)

        self.threads.append(threading.Thread(target=run, name=str(key), daemon=True))
        self.threads[-1].start()
        return self.threads[-1]

    def join(self):
        for thread in self.threads:
            thread.join(TIMEOUT)
            assert not thread.is_alive(), f"thread {thread.name} did not finish"
        if self.errors:
            raise self.errors[0]
        return self.results


def test_threads_sharing_one_model_decode_what_each_decodes_alone(shared):
    """Greedy, beam 4 and bf16 autocast callers, two of each at once, with threads switched every 10 µs."""
    model, batch = shared
    solo = {caller: decode(model, batch, caller) for caller in CALLERS}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = Threads()
        for round_ in range(2):
            for caller in CALLERS:
                threads.start((caller, round_), decode, model, batch, caller)
        results = threads.join()
    finally:
        sys.setswitchinterval(interval)
    for (caller, _), got in results.items():
        assert_same(got, solo[caller], caller)


def test_a_caller_paused_inside_a_linear_map_while_another_decodes_whole_keeps_its_own_numbers(shared):
    """The worst interleaving, forced: A (bf16 autocast) pauses inside the output projection of its first step;
    B (float32, beam 4, weights packed) starts, and pauses inside its search with its weights packed; A decodes
    whole meanwhile; then B finishes, and C (greedy, packed) runs whole while B is paused again."""
    model, batch = shared
    solo = {caller: decode(model, batch, caller) for caller in CALLERS}
    a_inside, b_packed, a_done, b_paused_again, c_done = (threading.Event() for _ in range(5))

    def pause_a(module, args):  # a forward pre-hook: inside the linear map's call, before its product
        if threading.current_thread().name == "a" and not a_inside.is_set():
            a_inside.set()
            assert b_packed.wait(TIMEOUT)

    steps = []

    def pause_b(input_ids, scores):  # a logits processor: inside B's search loop, its weights packed
        steps.append(len(steps))
        if len(steps) == 1:
            assert current_packed_weights(), "B's search packs its weights"
            b_packed.set()
            assert a_done.wait(TIMEOUT)
        elif len(steps) == 2:
            b_paused_again.set()
            assert c_done.wait(TIMEOUT)
        return scores

    handle = model.get_output_embeddings().register_forward_pre_hook(pause_a)
    try:
        threads = Threads()
        threads.start("a", lambda: (decode(model, batch, "greedy, bf16 autocast"), a_done.set())[0])
        assert a_inside.wait(TIMEOUT)
        threads.start("b", decode, model, batch, "beam 4", logits_processor=[pause_b])
        assert b_paused_again.wait(TIMEOUT)
        threads.start("c", lambda: (decode(model, batch, "greedy"), c_done.set())[0])
        results = threads.join()
    finally:
        handle.remove()
    assert_same(results["a"], solo["greedy, bf16 autocast"], "a")
    assert_same(results["b"], solo["beam 4"], "b")
    assert_same(results["c"], solo["greedy"], "c")
    assert not current_packed_weights()  # nothing left packed in the test's own thread


def test_the_model_is_copied_pickled_and_saved_while_it_decodes(shared):
    """deepcopy, pickle and torch.save, called inside a search loop whose weights are packed: no opaque tensor
    on the model, and the copy decodes what the model decodes."""
    model, batch = shared
    solo = decode(model, batch, "greedy")
    made = {}

    def copy_now(input_ids, scores):
        if not made:
            assert current_packed_weights(), "the search packs its weights"
            made["copy"] = copy.deepcopy(model)
            made["pickle"] = pickle.dumps(model)
            torch.save(model, buffer := io.BytesIO())
            made["saved"] = buffer.getvalue()
        return scores

    assert_same(decode(model, batch, "greedy", logits_processor=[copy_now]), solo, "greedy")
    assert made["pickle"] and made["saved"]
    assert_same(decode(made["copy"], batch, "greedy"), solo, "the copy")
    assert_same(decode(pickle.loads(made["pickle"]), batch, "greedy"), solo, "the pickled model")  # our own bytes


@pytest.mark.parametrize("shape", [(1, 0), (0, 4)])
def test_an_empty_source_is_refused_in_one_line(hub_tiny_model, shape):
    model, _ = hub_tiny_model
    empty = torch.zeros(shape, dtype=torch.long)
    for call in (lambda: model.generate(input_ids=empty), lambda: model.generate(empty, num_beams=4),
                 lambda: model(input_ids=empty, decoder_input_ids=torch.zeros(shape[0], 1, dtype=torch.long)),
                 lambda: model.generate(inputs_embeds=torch.zeros(*shape, model.config.d_model))):
        with pytest.raises(ValueError, match=r"^The source is empty \(shape \(\d, \d(, 64)?\)\): give at least one"):
            call()


OVERSIZED = {
    "vocab_size": dict(vocab_size=2**31 - 1),  # 2**31 - 1 rows of the embedding: 550 GB in float32
    "d_model": dict(d_model=2**31 - 2, num_heads=1),  # each field within its bound (even, for §3.5), d_model² past any memory
}


def _saved_with(folder, tmp_path, **changes):
    copied = shutil.copytree(folder, tmp_path / "model")
    config = json.loads((copied / "config.json").read_text())
    (copied / "config.json").write_text(json.dumps({**config, **changes}))
    return copied


@pytest.mark.parametrize("fields", OVERSIZED)
def test_a_config_too_large_for_this_machine_is_refused_before_anything_is_built(fields, hub_tiny_folder, tmp_path):
    """Direct construction, from_pretrained and the config file a resumed training run reads: one ValueError
    naming the fields and the bytes, before any tensor (the product of the fields, not each alone)."""
    folder = _saved_with(hub_tiny_folder, tmp_path, **OVERSIZED[fields])
    config = VanillaTransformerConfig.from_json_file(folder / "config.json")  # each field alone is in bounds
    message = r"^a model of vocab_size=\d+, d_model=\d+, .* needs [\d,]+ bytes .*; this machine has [\d,]+ bytes"
    for build in (lambda: VanillaTransformerForConditionalGeneration(config),
                  lambda: VanillaTransformerForConditionalGeneration.from_pretrained(folder)):
        with pytest.raises(ValueError, match=message) as refused:
            build()
        assert f"{fields}={OVERSIZED[fields][fields]}" in str(refused.value) and "\n" not in str(refused.value)


def test_translate_refuses_a_config_too_large_for_its_weights_and_this_machine_in_one_line(hub_tiny_folder, tmp_path):
    # The weights' headers are read before the config's model is built: its d_model contradicts them first.
    folder = _saved_with(hub_tiny_folder, tmp_path, **OVERSIZED["d_model"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "translate", "--model", str(folder),
                             "Jesus wept."], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode != 0 and not result.stdout
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"config.json does not fit the weights in {folder}" in result.stderr and f"{2**31 - 2}]" in result.stderr
    assert "Traceback" not in result.stderr
