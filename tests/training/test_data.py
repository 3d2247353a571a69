from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.tokenizer import train_tokenizer
from vanilla_transformer.training.arguments import CPU_MAX_TOKENS, TrainArguments
from vanilla_transformer.training.data import (
    PadCollator,
    PrefetchedBatches,
    TokenBatchSampler,
    TokenizedSplit,
    bucket_shapes,
    encode_texts,
    tokenize_pairs,
)
from vanilla_transformer.modeling.modeling_vanilla_transformer import LabelSmoothedCrossEntropy
from vanilla_transformer.training.data import IGNORE_INDEX
from vanilla_transformer.training.task import BatchPlan, size_batches


@pytest.fixture(scope="module")
def tokenizer():
    words = ["in the beginning", "god created", "the heaven and the earth", "en el principio", "creó dios"]
    return train_tokenizer(words * 20, vocab_size=300)


def pairs(rows):
    return datasets.Dataset.from_list([{"translation": {"en": en, "es": es}} for en, es in rows])


def test_tokenize_drops_empty_and_long_pairs_and_counts_them(tokenizer):
    data = pairs([("in the beginning", "en el principio"), ("", "creó"), ("god", "   "[:0]),
                  ("the heaven and the earth " * 20, "creó")])
    split = tokenize_pairs(data, tokenizer, "en", "es", max_length=16)
    assert (len(split.dataset), split.total, split.empty, split.too_long) == (1, 4, 2, 1)
    row = split.dataset[0]
    assert row["input_ids"][-1] == tokenizer.eos_token_id and row["labels"][-1] == tokenizer.eos_token_id
    assert row["length"] == max(len(row["input_ids"]), len(row["labels"]))
    assert "1 of 4 pairs kept; 2 dropped with an empty or blank side, 1 dropped" in split.describe("train", 16, False)

    cut = tokenize_pairs(data, tokenizer, "en", "es", max_length=16, truncate=True, keep_references=True)
    assert (len(cut.dataset), cut.too_long) == (2, 1)
    assert len(cut.dataset[1]["input_ids"]) == 16 and cut.dataset[1]["input_ids"][-1] == tokenizer.eos_token_id
    assert cut.dataset[1]["reference"] == "creó"
    # The lengths batches are built from are those of the kept rows (read through Arrow, past the selection).
    assert cut.lengths.tolist() == [len(cut.dataset[0]["labels"]), 16] and split.lengths.tolist() == [row["length"]]


def test_pairs_with_a_side_of_white_space_only_are_dropped_and_counted(tokenizer):
    blank = ["   ", "\t", "\n", "\u3000 \u00a0"]  # spaces, a tab, a line end, an ideographic and a no-break space
    data = pairs([("in the beginning", "en el principio"), *((text, "creó") for text in blank), ("god", " \t ")])
    split = tokenize_pairs(data, tokenizer, "en", "es", max_length=16, keep_references=True)
    assert (len(split.dataset), split.total, split.empty) == (1, 6, 5)
    assert split.dataset[0]["reference"] == "en el principio"
    assert "1 of 6 pairs kept; 5 dropped with an empty or blank side" in split.describe("train", 16, False)


def test_pairs_that_tokenise_to_nothing_are_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="no pairs left in the train split.*2 dropped with an empty or blank side"):
        tokenize_pairs(pairs([("", "x"), ("y", "")]), tokenizer, "en", "es", 16, name="train")


def test_collator_pads_sources_and_ignores_padded_labels():
    batch = PadCollator(0)({"input_ids": [[5, 2], [5, 6, 7, 2]], "labels": [[9, 9, 2], [8, 2]]})
    assert batch["input_ids"].tolist() == [[5, 2, 0, 0], [5, 6, 7, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[9, 9, 2], [8, 2, IGNORE_INDEX]]


def test_loss_is_a_sum_over_non_padding_tokens():
    import torch

    logits = torch.randn(2, 3, 11)
    labels = torch.tensor([[1, 2, IGNORE_INDEX], [3, IGNORE_INDEX, IGNORE_INDEX]])
    loss, nll = LabelSmoothedCrossEntropy()(logits, labels, 0.0)  # the model's loss, which training asks for
    expected = -sum(logits[b, t].log_softmax(-1)[labels[b, t]] for b, t in ((0, 0), (0, 1), (1, 0)))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5) and nll.item() == pytest.approx(loss.item())
    smoothed, _ = LabelSmoothedCrossEntropy()(logits, labels, 0.1)
    uniform = -sum(logits[b, t].log_softmax(-1).mean() for b, t in ((0, 0), (0, 1), (1, 0)))
    assert smoothed.item() == pytest.approx(0.9 * expected.item() + 0.1 * uniform.item(), rel=1e-5)


LENGTHS = np.random.default_rng(0).integers(2, 60, size=500)


def test_batches_hold_at_most_max_tokens_and_cover_every_pair_once():
    sampler = TokenBatchSampler(LENGTHS, max_tokens=200, seed=1)
    batches = list(sampler)
    assert all(len(b) * LENGTHS[b].max() <= 200 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(500))
    # Similar lengths together: a batch's padding is far below that of random batches.
    spread = np.mean([LENGTHS[b].max() - LENGTHS[b].min() for b in batches if len(b) > 1])
    assert spread < 5


def test_order_is_seeded_changes_per_epoch_and_resumes_mid_epoch():
    a, b = TokenBatchSampler(LENGTHS, 200, seed=1), TokenBatchSampler(LENGTHS, 200, seed=1)
    assert list(a) == list(b)
    assert list(a) != list(TokenBatchSampler(LENGTHS, 200, seed=2))
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    whole = list(a)
    b.set_epoch(1, start=5)
    assert list(b) == whole[5:] and len(b) == len(whole) - 5


def test_processes_share_out_the_batches_one_process_would_accumulate():
    one = TokenBatchSampler(LENGTHS, 200, seed=3, num_replicas=2, rank=0).global_batches(0)
    ranks = [list(TokenBatchSampler(LENGTHS, 200, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) and len(one) % 2 == 0
    interleaved = [batch for pair in zip(*ranks) for batch in pair]
    assert interleaved == [b.tolist() for b in one]


def test_evaluation_batches_cover_everything_across_processes():
    ranks = [list(TokenBatchSampler(LENGTHS, 200, shuffle=False, num_replicas=3, rank=r)) for r in range(3)]
    assert sorted(i for r in ranks for b in r for i in b) == list(range(500))


def test_sampler_refuses_a_budget_below_the_longest_pair():
    with pytest.raises(ValueError, match="max_tokens.*longest sequence"):
        TokenBatchSampler(LENGTHS, max_tokens=10)


def test_bucket_lengths_waste_the_least_padding_of_any_choice():
    lengths = [3, 3, 5, 9, 9, 10, 40]
    # 3 lengths: 40 must be one; of the pairs of others, (5, 10) pads 2 + 1 + 1 = 4 tokens, the least.
    assert bucket_shapes(lengths, 400, 3) == [(3, 5), (3, 10), (1, 40)]  # as many rows as there are pairs
    assert bucket_shapes(lengths, 400, 1) == [(7, 40)]
    assert bucket_shapes(lengths, 400, 16) == [(2, 3), (1, 5), (2, 9), (1, 10), (1, 40)]  # one per length
    # Rows: the fewest batches within max_tokens, as alike as can be: 7 pairs of 40 tokens, at most 3 a batch, are
    # 3 batches of 3 rows; at most 5 a batch, 2 batches of 4.
    assert bucket_shapes([40] * 7, 120, 2) == [(3, 40)] and bucket_shapes([40] * 7, 200, 2) == [(4, 40)]
    with pytest.raises(ValueError, match="max_tokens.*longest sequence"):
        bucket_shapes(lengths, 30, 4)


def test_bucketed_batches_take_few_shapes_cover_every_pair_once_and_resume():
    shapes = bucket_shapes(LENGTHS, 200, 4)
    sampler = TokenBatchSampler(LENGTHS, 200, seed=1, shapes=shapes)
    collate = PadCollator(0, shapes)
    seen = set()
    for batch in sampler:
        rows = [[1] * LENGTHS[i] for i in batch]
        padded = collate({"input_ids": rows, "labels": rows})
        seen.add(tuple(padded["input_ids"].shape))
        assert padded["labels"].shape == padded["input_ids"].shape
        assert padded["input_ids"].numel() <= 200
    assert len(seen) == 4 and seen <= set(shapes)
    assert sorted(i for b in sampler for i in b) == list(range(500))
    whole = list(sampler)
    sampler.set_epoch(0, start=3)
    assert list(sampler) == whole[3:]
    # The padding they waste, beside that of the batches cut to their longest pair.
    plain = TokenBatchSampler(LENGTHS, 200, seed=1).padding()
    assert 0 < plain < sampler.padding() < 0.5
    with pytest.raises(ValueError, match="bucket shapes are for training batches"):
        TokenBatchSampler(LENGTHS, 200, shuffle=False, shapes=shapes)


def test_the_rows_and_columns_a_bucket_adds_change_no_loss():
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
    from vanilla_transformer.training.criterion import batch_loss

    torch.manual_seed(0)
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=50, pad_token_id=1, eos_token_id=2,
                                                  bos_token_id=0, label_smoothing=0.1, dropout=0.0)
    model = VanillaTransformerForConditionalGeneration(config)
    columns = {"input_ids": [[5, 6, 7, 2], [8, 2]], "labels": [[9, 10, 2], [11, 12, 13, 14, 2]]}
    plain = PadCollator(1)(columns)
    bucketed = PadCollator(1, [(2, 4), (6, 9)])(columns)
    assert bucketed["input_ids"].shape == (6, 9) and bucketed["attention_mask"][2:, 0].tolist() == [1] * 4
    loss, nll = batch_loss(model, plain)
    padded_loss, padded_nll = batch_loss(model, bucketed)
    assert torch.allclose(padded_loss, loss, rtol=1e-5) and torch.allclose(padded_nll, nll, rtol=1e-5)
    # ... nor any gradient: the padding rows are finite and contribute nothing.
    grads = [torch.autograd.grad(batch_loss(model, b)[0], model.parameters(), allow_unused=True) for b in (plain, bucketed)]
    for g, h in zip(*grads):
        assert (g is None and h is None) or torch.allclose(g, h, rtol=1e-4, atol=1e-6)



def test_tokenising_with_several_processes_gives_the_same_split_and_a_later_load_reuses_its_cache(
        tmp_path, write_synthetic_task, monkeypatch):
    """`num_proc` workers tokenise a file-backed split into the map cache with the tokenizer just trained (as a
    first run does); the same files and that tokenizer loaded from its folder (as a resumed or repeated run loads
    them) read it back: no new cache file, the same rows. Other options, or another tokenizer, tokenise anew."""
    from transformers import AutoTokenizer

    from vanilla_transformer.corpora import load_translation_dataset

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    data = write_synthetic_task(tmp_path / "data", n_train=600, n_eval=4)
    trained = train_tokenizer([" ".join(chr(c) for c in range(97, 109))] * 10, vocab_size=300, output_dir=tmp_path / "tok")
    other = train_tokenizer([" ".join(chr(c) for c in range(97, 109))] * 10, vocab_size=270, output_dir=tmp_path / "tok2")

    def tokenise(num_proc, tokenizer=None, max_length=16):
        train = load_translation_dataset(str(data))["train"]
        cache = Path(train.cache_files[0]["filename"]).parent
        before = set(cache.glob("cache-*.arrow"))
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(tmp_path / "tok")
        split = tokenize_pairs(train, tokenizer, "src", "tgt", max_length, num_proc=num_proc)
        return len(set(cache.glob("cache-*.arrow")) - before), split

    (new_first, first), (new_again, again), (_, one_process) = tokenise(2, trained), tokenise(2), tokenise(None)
    assert new_first == 2  # one cache file per worker
    assert new_again == 0
    assert first.dataset["length"][:] == again.dataset["length"][:] == one_process.dataset["length"][:]
    assert first.dataset["labels"][:] == one_process.dataset["labels"][:] and first.total == 600
    assert tokenise(2, max_length=12)[0] == 2 and tokenise(2, other)[0] == 2


def test_tokenization_workers_scale_with_the_corpus(monkeypatch):
    from vanilla_transformer.training import data as data_module

    monkeypatch.delenv(data_module.NUM_PROC_ENV, raising=False)
    monkeypatch.setattr(data_module.os, "sched_getaffinity", lambda _: set(range(4)), raising=False)
    assert data_module.tokenization_workers(1000) is None
    assert data_module.tokenization_workers(3 * data_module.PAIRS_PER_WORKER) == 3
    assert data_module.tokenization_workers(100 * data_module.PAIRS_PER_WORKER) == 4
    monkeypatch.setenv(data_module.NUM_PROC_ENV, "2")
    assert data_module.tokenization_workers(10) == 2
    monkeypatch.setenv(data_module.NUM_PROC_ENV, "two")
    with pytest.raises(ValueError, match="VANILLA_TRANSFORMER_NUM_PROC must be a whole number.*'two'"):
        data_module.tokenization_workers(10)


def test_encoding_through_the_rust_tokenizer_gives_transformers_ids():
    tokenizer = train_tokenizer(["the cat sat on the mat", "el gato se sentó"] * 20, vocab_size=300)
    texts = ["the cat sat", "", "  el gato — ¿se sentó?  ", "ünïcödé 語"]
    assert encode_texts(tokenizer, texts) == tokenizer(texts)["input_ids"]
    tokenizer.backend_tokenizer.enable_truncation(2)  # a backend that cuts on its own: transformers' call decides
    assert encode_texts(tokenizer, texts) == tokenizer(texts)["input_ids"]


def prefetch_split(n: int = 40) -> TokenizedSplit:
    rng = np.random.default_rng(0)
    sources = [list(range(3, 3 + int(k))) for k in rng.integers(1, 9, n)]
    targets = [list(range(5, 5 + int(k))) for k in rng.integers(1, 9, n)]
    rows = {"input_ids": sources, "labels": targets, "length": [max(len(s), len(t)) for s, t in zip(sources, targets)]}
    return TokenizedSplit(datasets.Dataset.from_dict(rows), n, 0, 0)


def test_prefetched_batches_are_the_samplers_batches_in_its_order_with_their_target_tokens():
    # Proves: the background thread changes when batches are made, not which or in what order: the same
    # padded tensors as collating the sampler's batches one by one (a resumed epoch's skip included), each
    # with its target-token count made on the host.
    split, collate = prefetch_split(), PadCollator(0)
    sampler = TokenBatchSampler(split.lengths, 24, seed=5)
    sampler.set_epoch(1, start=2)
    expected = [collate(split.dataset[indices]) for indices in sampler]
    assert len(expected) > 4
    with PrefetchedBatches(split, sampler, collate, "cpu", ahead=2) as batches:
        got = list(batches)
    assert len(got) == len(expected)
    for (batch, tokens), want in zip(got, expected):
        assert batch.keys() == want.keys() and all(torch.equal(batch[k], want[k]) for k in want)
        assert tokens == int((want["labels"] != IGNORE_INDEX).sum())


def test_prefetched_batches_raise_the_threads_error_and_stop_when_left_early():
    split = prefetch_split()

    def broken(columns):
        raise ValueError("a bad row")

    with pytest.raises(ValueError, match="a bad row"), PrefetchedBatches(split, [[0], [1]], broken, "cpu") as batches:
        next(batches)
    batches = PrefetchedBatches(split, [[i] for i in range(len(split.dataset))], PadCollator(0), "cpu", ahead=1)
    next(batches)
    batches.close()  # the thread, blocked on a full queue, ends
    assert not batches._thread.is_alive()


GIB = 2**30


@pytest.mark.parametrize(("preset", "memory", "processes", "accumulation", "expected"), [
    ("base", 141 * GIB, 1, None, (25_000, 1)),  # an H200 holds the paper's batch at once
    ("base", 141 * GIB, 8, None, (3125, 1)),  # ... shared out over 8 processes
    ("big", 24 * GIB, 1, None, (8334, 3)),  # a 24 GB card accumulates 3 batches of a third
    # What fits 24 GiB: (0.8 * 24 GiB - 20 * 210M) / (2 * 796,416 bytes a token) = 10306 tokens.
    ("big", 24 * GIB, 1, 2, (10306, 2)),  # asked for 2 batches: the largest that fits, below the paper's step
    ("big", 16 * GIB, 1, None, (5000, 5)),
])
def test_a_gpus_batch_is_the_papers_step_within_its_memory(preset, memory, processes, accumulation, expected):
    from vanilla_transformer import VanillaTransformerConfig
    from vanilla_transformer.training.task import gpu_batch

    config = VanillaTransformerConfig.from_preset(preset, vocab_size=8000)
    parameters = {"base": 60_000_000, "big": 210_000_000}[preset]
    assert gpu_batch(memory, config, parameters, processes, 256, accumulation) == expected
    max_tokens, steps = expected
    assert max_tokens * steps * processes >= 25_000 or accumulation is not None
    with pytest.raises(ValueError, match="a batch of `max_length` \\(256\\) tokens does not fit the device's 1.0 GiB"):
        gpu_batch(GIB, config, parameters, 1, 256)


# The batch plan, which `set_up` returns beside the options as the user typed them (task.py).

@pytest.mark.parametrize(("typed", "planned"), [
    ({}, (CPU_MAX_TOKENS, 1)),
    ({"max_tokens": 512}, (512, 1)),
    ({"gradient_accumulation_steps": 3}, (CPU_MAX_TOKENS, 3)),
], ids=["nothing typed", "max_tokens", "gradient_accumulation_steps"])
def test_the_batch_plan_is_returned_and_the_options_stay_as_typed(tmp_path, typed, planned):
    args = TrainArguments(output_dir=str(tmp_path), **typed)
    assert size_batches(args, Accelerator(cpu=True), model=None) == BatchPlan(*planned)
    assert (args.max_tokens, args.gradient_accumulation_steps) == (typed.get("max_tokens"),
                                                                   typed.get("gradient_accumulation_steps"))
