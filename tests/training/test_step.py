"""Direct unit tests of one optimiser step and of the evaluation loss, against hand computations.

`_optimizer_step` reads only a few fields of the run record (accelerator, model, optimiser,
scheduler, options, step); the tests give it those, built the way `_setup` builds them, in a
namespace instead of a whole `_Run` (which also holds data, tokenizer and samplers it never reads).
"""

import copy
import math
from types import SimpleNamespace

import datasets
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import (
    VanillaTransformerForConditionalGeneration,
    shift_tokens_right,
)
from vanilla_transformer.training.data import PadCollator, TokenizedSplit
from vanilla_transformer.training.loop import (
    TrainingArguments,
    _optimizer_step,
    _step_tokens_unless_out_of_time,
    evaluate,
)
from vanilla_transformer.training.loss import IGNORE_INDEX
from vanilla_transformer.training.schedule import make_optimizer, make_scheduler, noam_rate

PAD, VOCAB, D_MODEL, WARMUP, SMOOTHING = 0, 24, 32, 10, 0.1
# Four pairs of different lengths (ids 3.. are words, 2 is </s>): padding differs with how they are batched.
PAIRS = [
    ([5, 6, 7, 2], [8, 9, 2]),
    ([10, 11, 2], [12, 13, 14, 15, 2]),
    ([16, 17, 18, 19, 20, 2], [21, 2]),
    ([3, 4, 2], [22, 23, 5, 2]),
]


def tiny_model(fast_paths: bool = True) -> VanillaTransformerForConditionalGeneration:
    """No dropout: a step is a function of the weights and the batch alone. float64: Adam's first steps
    divide each gradient by its own size, which float32 rounding would make noisy for tiny gradients."""
    torch.manual_seed(0)
    config = VanillaTransformerConfig.from_preset(
        "tiny", vocab_size=VOCAB, d_model=D_MODEL, d_ff=64, num_heads=2, encoder_layers=1, decoder_layers=1,
        dropout=0.0, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, fast_paths=fast_paths,
    )
    return VanillaTransformerForConditionalGeneration(config).double()


def collate(pairs) -> dict:
    return PadCollator(PAD)({"input_ids": [s for s, _ in pairs], "labels": [t for _, t in pairs]})


def hand_loss(model, pairs, smoothing=SMOOTHING):
    """§5.4 by hand: label-smoothed cross-entropy summed over target tokens, and the plain NLL, with torch's function."""
    batch = collate(pairs)
    config = model.config
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
        decoder_input_ids=shift_tokens_right(batch["labels"], config.pad_token_id, config.decoder_start_token_id),
    ).logits.reshape(-1, VOCAB)
    labels = batch["labels"].reshape(-1)
    loss = F.cross_entropy(logits, labels, label_smoothing=smoothing, reduction="sum")
    nll = F.cross_entropy(logits.detach(), labels, reduction="sum")
    return loss, nll


def target_tokens(pairs) -> int:
    return sum(len(t) for _, t in pairs)


def hand_adam_steps(model, pairs, steps: int):
    """§5.3 by hand: Adam (β1 0.9, β2 0.98, ε 1e-9, bias-corrected) at the Noam rate of each step, on the
    loss summed over the step's target tokens and divided by their number. Returns each step's (loss, nll)."""
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2, eps, seen = 0.9, 0.98, 1e-9, []
    for t in range(1, steps + 1):
        model.zero_grad()
        loss, nll = hand_loss(model, pairs)
        (loss / target_tokens(pairs)).backward()
        seen.append((loss.item() / target_tokens(pairs), nll.item() / target_tokens(pairs)))
        lr = noam_rate(t, D_MODEL, WARMUP)
        with torch.no_grad():
            for p, m_i, v_i in zip(params, m, v):
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                m_i.mul_(b1).add_((1 - b1) * g)
                v_i.mul_(b2).add_((1 - b2) * g * g)
                p -= lr * (m_i / (1 - b1**t)) / ((v_i / (1 - b2**t)).sqrt() + eps)
    return seen


def make_run(tmp_path, model, **options):
    """What `_optimizer_step` reads of a run, built as `_setup` builds it (on the CPU, one process)."""
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    optimizer = make_optimizer(model, accelerator.device)
    scheduler = make_scheduler(optimizer, D_MODEL, WARMUP)
    model, optimizer = accelerator.prepare(model, optimizer)
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing=SMOOTHING, warmup_steps=WARMUP, **options)
    return SimpleNamespace(
        args=args, accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler, average=None,
        step=0, checkpoint_root=tmp_path / "checkpoints", started=0.0, elapsed=0.0, stop_requests=None, stop_signal=0,
    )


@pytest.mark.parametrize("split", [[4], [2, 2], [1, 3]], ids=["one batch", "two halves", "one and three"])
def test_two_steps_are_adams_steps_on_the_loss_per_target_token_of_the_whole_step(tmp_path, split):
    """However the step's pairs are cut into micro-batches (gradient accumulation), the update is Adam's
    on the smoothed loss summed over all the step's target tokens and divided by their number. (The plain
    loss: the fast one works in float32, whose rounding Adam's first steps magnify; test_fast_paths.py
    holds the two losses equal.)"""
    trained, by_hand = tiny_model(fast_paths=False), tiny_model(fast_paths=False)
    expected = hand_adam_steps(by_hand, PAIRS, steps=2)
    run = make_run(tmp_path, trained)
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    micro_batches = [collate(PAIRS[a:b]) for a, b in zip(bounds, bounds[1:])]
    gradients = []  # what the optimiser is handed, captured just before its update
    run.optimizer.optimizer.register_step_pre_hook(
        lambda *_: gradients.append({n: p.grad.clone() for n, p in trained.named_parameters() if p.grad is not None})
    )
    for step in range(2):
        total_tokens = _step_tokens_unless_out_of_time(run, micro_batches)
        assert total_tokens == target_tokens(PAIRS)
        loss, nll, lr = _optimizer_step(run, micro_batches, total_tokens)
        run.step += 1
        assert lr == pytest.approx(noam_rate(step + 1, D_MODEL, WARMUP), rel=1e-12)
        assert (loss, nll) == pytest.approx(expected[step], rel=1e-9)
        assert all(p.grad is None for p in trained.parameters())  # cleared for the next step
    # The first step's gradients are those of the loss per target token (Adam alone would hide a constant factor).
    fresh = tiny_model(fast_paths=False)
    loss, _ = hand_loss(fresh, PAIRS)
    (loss / target_tokens(PAIRS)).backward()
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(gradients[0][name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
    for (name, got), want in zip(trained.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9, msg=name)


def test_a_non_finite_loss_stops_before_the_weights_change(tmp_path):
    model = tiny_model()
    run = make_run(tmp_path, model)
    with torch.no_grad():
        model.lm_head.weight[5, 0] = math.inf  # tied with the embeddings: every logit row sees it
    before = copy.deepcopy(model.state_dict())
    batch = collate(PAIRS)
    with pytest.raises(FloatingPointError, match="step 1.*no checkpoint was written yet"):
        _optimizer_step(run, [batch], target_tokens(PAIRS))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], equal_nan=True, msg=name)
    assert all(p.grad is None for p in model.parameters())
    assert run.scheduler.last_epoch == 0  # the schedule did not move either


def split_of(pairs) -> TokenizedSplit:
    rows = {"input_ids": [s for s, _ in pairs], "labels": [t for _, t in pairs],
            "length": [max(len(s), len(t)) for s, t in pairs]}
    return TokenizedSplit(datasets.Dataset.from_dict(rows), len(pairs), 0, 0)


@pytest.mark.parametrize("fast_paths", [True, False], ids=["fast paths", "plain paths"])
def test_evaluation_loss_and_perplexity_are_per_target_token_over_the_whole_split(tmp_path, fast_paths):
    """Batched by tokens (here several batches), summed, then divided once: the numbers of the whole split."""
    model = tiny_model(fast_paths)
    model.train()
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing=SMOOTHING, max_tokens=12)
    metrics = evaluate(Accelerator(cpu=True, mixed_precision="no"), model, SimpleNamespace(pad_token_id=PAD),
                       split_of(PAIRS), args, translate_samples=0)
    assert model.training  # evaluation hands the model back in the mode it found it
    model.eval()
    with torch.no_grad():
        loss, nll = hand_loss(model, PAIRS)
    tokens, rel = target_tokens(PAIRS), 1e-6 if fast_paths else 1e-9  # the fast loss works in float32
    assert set(metrics) == {"loss", "nll", "perplexity"}  # no translations asked for: no BLEU
    assert metrics["loss"] == pytest.approx(loss.item() / tokens, rel=rel)
    assert metrics["nll"] == pytest.approx(nll.item() / tokens, rel=rel)
    assert metrics["perplexity"] == pytest.approx(math.exp(nll.item() / tokens), rel=rel)
