"""The batches of a run (training/batches.py): at most `max_tokens` a side, every pair once, seeded and resumable,
padded to a few shapes, prefetched in the sampler's order; the batch plan; the loss of a padded batch (criterion.py)."""

import datasets
import numpy as np
import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.modeling.modeling_vanilla_transformer import LabelSmoothedCrossEntropy
from vanilla_transformer.training.arguments import CPU_MAX_TOKENS, TrainArguments
from vanilla_transformer.training.batches import (
    IGNORE_INDEX,
    BatchPlan,
    PadCollator,
    PrefetchedBatches,
    TokenBatchSampler,
    bucket_shapes,
    size_batches,
)
from vanilla_transformer.training.task import TokenizedSplit


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
    from vanilla_transformer.training.batches import gpu_batch

    config = VanillaTransformerConfig.from_preset(preset, vocab_size=8000)
    parameters = {"base": 60_000_000, "big": 210_000_000}[preset]
    assert gpu_batch(memory, config, parameters, processes, 256, accumulation) == expected
    max_tokens, steps = expected
    assert max_tokens * steps * processes >= 25_000 or accumulation is not None
    with pytest.raises(ValueError, match="a batch of `max_length` \\(256\\) tokens does not fit the device's 1.0 GiB"):
        gpu_batch(GIB, config, parameters, 1, 256)


# The batch plan, which `set_up` returns beside the options as the user typed them.

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
