"""Shared test helpers.

`run_without_package` runs Python code in a fresh process in which `vanilla_transformer` cannot be
imported (as on a user's machine that only has a saved folder), offline, and returns its stdout.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

# One thread, for the suite and the commands it runs, here and in the processes it starts (--threads' default
# reads OMP_NUM_THREADS).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

_BLOCK_PACKAGE = "import sys; sys.modules['vanilla_transformer'] = None  # any import of the package now fails\n"


def run_without_package(code: str, cwd=None, timeout: int = 300) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_PACKAGE + textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        stdin=subprocess.DEVNULL,  # as in a notebook or a service: nothing can answer a question
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


@pytest.fixture(name="run_without_package", scope="session")
def run_without_package_fixture():
    return run_without_package


# --- the pipeline, attention maps, Hub folder: one tiny trained model for those tests ---

HUB_EXAMPLE = "In the beginning God created the heavens and the earth."


@pytest.fixture(name="hub_example", scope="session")
def hub_example_fixture():
    """The sentence whose attention the Hub folder's card shows (a fixture: test modules cannot import
    `conftest`, since tests/training has a conftest of its own)."""
    return HUB_EXAMPLE


@pytest.fixture(scope="session")
def tiny_corpus():
    """A 600-token tokenizer learnt on 3,000 en-es training pairs, and those of the pairs under 80 characters."""
    from vanilla_transformer.corpora import load_translation_dataset, text_pairs
    from vanilla_transformer.tokenizer import train_tokenizer

    train = load_translation_dataset("bible-en-es")["train"].select(range(3000))
    sources, targets = text_pairs(train, "en", "es")
    tokenizer = train_tokenizer(sources + targets, vocab_size=600)
    return tokenizer, [(s, t) for s, t in zip(sources, targets) if len(s) < 80 and len(t) < 80]


@pytest.fixture(scope="session")
def train_tiny(tiny_corpus):
    """config overrides -> a tiny model (d_model 64, 2+2 layers, 4 heads) trained for a few seconds on
    real Bible verses, and its tokenizer: it translates badly but emits real, varied tokens. It trains in fp32
    with eager attention on any CPU, and is handed back on its configured attention."""
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    tokenizer, pairs = tiny_corpus

    def train(steps: int = 60, **overrides):
        torch.manual_seed(0)
        config = VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), dropout=0.0, **overrides)
        model = VanillaTransformerForConditionalGeneration(config).to(torch.float32)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        # The same model on every machine: fp32 and the paper's explicit attention, whatever the CPU would choose.
        configured = model.config._attn_implementation
        model.set_attn_implementation("eager")
        model.train()
        for step in range(steps):
            batch = pairs[(step * 32) % len(pairs) :][:32]
            inputs = tokenizer([s for s, _ in batch], padding=True, return_tensors="pt")
            labels = tokenizer([t for _, t in batch], padding=True, return_tensors="pt")["input_ids"]
            labels[labels == tokenizer.pad_token_id] = -100
            loss = model(**inputs, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.set_attn_implementation(configured)
        return model.eval(), tokenizer

    return train


@pytest.fixture(scope="session")
def hub_tiny_model(train_tiny):
    """The tiny model of `train_tiny` with the paper's settings (post-norm, sinusoidal positions) and decoding (§6.1,
    as training saves it): the same whether or not a test saved it before (`save_for_hub` gives it those)."""
    from vanilla_transformer.modeling.generation import paper_generation_config

    model, tokenizer = train_tiny()
    model.generation_config = paper_generation_config(model.config)
    return model, tokenizer


@pytest.fixture(scope="session")
def hub_tiny_folder(hub_tiny_model, tmp_path_factory):
    """The tiny model saved as a complete Hub folder (weights, code, tokenizer, pipeline, card, image)."""
    from vanilla_transformer.hub import save_for_hub

    model, tokenizer = hub_tiny_model
    results = {"split": "test", "bleu": 1.23, "chrf": 12.34, "sacrebleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"}
    return save_for_hub(
        model,
        tokenizer,
        tmp_path_factory.mktemp("hub") / "tiny-en-es",
        results=results,
        dataset="bible-en-es",
        hyperparameters={"steps": 60, "batch_size": 32, "learning_rate": 3e-3},
        example=HUB_EXAMPLE,
    )


# --- the attention explorer, the web app ---


@pytest.fixture(scope="session")
def synthetic_record():
    """Makes an AttentionRecord of random (softmax) weights over made-up tokens, as long as wanted, without
    translating: `synthetic_record(source_tokens, target_tokens, layers=3, heads=4)` (the small model's shape).
    With `neurons=True` it holds the neuron view of a random model of that shape (64 dimensions a head)."""
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
    from vanilla_transformer.visualize.attention_maps import AttentionRecord
    from vanilla_transformer.visualize.neuron_view import neuron_tensors

    def make(source: int, target: int, layers: int = 3, heads: int = 4, neurons: bool = False) -> AttentionRecord:
        g = torch.Generator().manual_seed(0)

        def weights(queries, keys, causal=False):
            scores = torch.randn(layers, heads, queries, keys, generator=g) * 3
            if causal:
                scores = scores.masked_fill(torch.ones(queries, keys, dtype=torch.bool).triu(1), float("-inf"))
            return scores.softmax(-1)

        source_ids, target_ids = [*range(10, 9 + source), 2], [0, *range(10, 9 + target), 2]
        tokens = {0: "<pad>", 2: "</s>"}
        pieces = lambda ids: [tokens.get(i, f" w{i}") for i in ids]  # noqa: E731
        if neurons:
            torch.manual_seed(0)
            config = VanillaTransformerConfig(vocab_size=64, d_model=64 * heads, num_heads=heads, d_ff=64,
                                              encoder_layers=layers, decoder_layers=layers)
            ids = lambda length: torch.randint(3, 64, (1, length), generator=g)  # noqa: E731
            neurons = neuron_tensors(VanillaTransformerForConditionalGeneration(config), ids(source), None, ids(target))
        return AttentionRecord(
            source="".join(pieces(source_ids[:-1])).strip(), translation="".join(pieces(target_ids[1:-1])).strip(),
            source_ids=source_ids, target_ids=target_ids, source_tokens=pieces(source_ids), target_tokens=pieces(target_ids),
            source_pieces=pieces(source_ids), target_pieces=pieces(target_ids),
            encoder_attention=weights(source, source), decoder_attention=weights(target, target, causal=True),
            cross_attention=weights(target, source), special_ids=[0, 1, 2, 3], model="synthetic", settings={"beam size": "4"},
            neurons=neurons or None,
        )

    return make


@pytest.fixture(scope="session")
def marian_folder(hub_tiny_model, tmp_path_factory):
    """A MarianMTModel folder (random weights, the tiny model's tokenizer.json): it loads and translates, and with
    transformers' default "sdpa" attention it returns no attention weights."""
    from transformers import MarianConfig, MarianMTModel

    _, tokenizer = hub_tiny_model
    folder = tmp_path_factory.mktemp("marian")
    marian = MarianMTModel(MarianConfig(
        vocab_size=len(tokenizer), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0, max_position_embeddings=64,
    ))
    marian.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Debian's Chromium, driven by Playwright: neither may download a browser of its own here. Without the
# background-networking flags Chromium's own connections are refused by a closed network.
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="session")
def chromium():
    """A headless Chromium (the system's, or $CHROMIUM) with a fresh profile; where there is none, a skip that
    says so. CI installs one (.ci/run) and sets CI=true, and there a missing browser fails the tests instead."""
    import shutil

    path = os.environ.get("CHROMIUM") or next(
        filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"))), None
    )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "the browser tests need Playwright: pip install -e '.[test]'"
    else:
        reason = None if path else "no Chromium found: the browser tests need one (apt-get install chromium, as root)"
    if reason:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(f"{reason}; CI must run them", pytrace=False)
        pytest.skip(reason)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(autouse=True)
def fresh_mixed_precision():
    """Accelerate fixes one mixed precision per process, at its first Accelerator; a test, like each run of
    the command line, starts without one (a run's default precision depends on the machine)."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
