"""Direct unit tests of one optimiser step and of the evaluation loss, against hand computations.

`train_step` reads the model and what trains it (`Components` without the data, tokenizer and
sampler it never reads), the step's number and a `Budget` with no limits, built the way `set_up`
builds them.
"""

import copy
import math
import signal
from types import SimpleNamespace

import datasets
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import (
    VanillaTransformerForConditionalGeneration,
    shift_tokens_right,
)
from vanilla_transformer.training.arguments import TrainArguments
from vanilla_transformer.training.budget import Budget
from vanilla_transformer.training.batches import IGNORE_INDEX, PadCollator
from vanilla_transformer.training.task import TokenizedSplit
from vanilla_transformer.training.evaluation import evaluate
from vanilla_transformer.training.run_state import RunState
from vanilla_transformer.training.setup import Components, prepare
from vanilla_transformer.training.step import next_rate, train_step
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
        label_smoothing=SMOOTHING,  # the model's own loss is the run's: `train` sets it from its argument
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


def make_run(tmp_path, model, mixed_precision="no"):
    """What `train_step` reads of a run, built as `set_up` builds it (on the CPU, one process): the components,
    the checkpointed state and a budget without limits."""
    AcceleratorState._reset_state(reset_partial_state=True)  # one precision per process otherwise
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    optimizer = make_optimizer(model, accelerator.device)
    scheduler = make_scheduler(optimizer, D_MODEL, WARMUP)
    model, optimizer = prepare(accelerator, model, optimizer)
    state = RunState()
    components = Components(accelerator, model, optimizer, scheduler, tmp_path / "checkpoints",
                            TrainArguments(output_dir=str(tmp_path)))
    return SimpleNamespace(components=components, state=state, budget=Budget(state=state))


def one_step(run, micro_batches):
    """A step as `train` takes it (each micro-batch with its target tokens, counted on the host), then the
    losses read as logging reads them: (the step's target tokens, loss, NLL per token, learning rate)."""
    counted = [(b, int((b["labels"] != IGNORE_INDEX).sum())) for b in micro_batches]
    done = train_step(run.components, counted, run.state.step, run.budget)
    run.budget.add_step(done.tokens, done.elapsed_seconds, done.stop_signal)
    next_rate(run.components, done)
    run.state.count_step(len(micro_batches), done.tokens)
    return (done.tokens, *run.components.losses.read(run.state.step), done.lr)


@pytest.mark.parametrize("split", [[4], [2, 2], [1, 3]], ids=["one batch", "two halves", "one and three"])
def test_two_steps_are_adams_steps_on_the_loss_per_target_token_of_the_whole_step(tmp_path, split):
    """However the step's pairs are cut into micro-batches (gradient accumulation), the update is Adam's
    on the smoothed loss summed over all the step's target tokens and divided by their number. (The plain
    loss: the fast one works in float32, whose rounding Adam's first steps magnify;
    tests/modeling/test_fast_modeling.py holds the two losses equal.)"""
    trained, by_hand = tiny_model(fast_paths=False), tiny_model(fast_paths=False)
    expected = hand_adam_steps(by_hand, PAIRS, steps=2)
    run = make_run(tmp_path, trained)
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    micro_batches = [collate(PAIRS[a:b]) for a, b in zip(bounds, bounds[1:])]
    gradients = []  # what the optimiser is handed, captured just before its update
    run.components.optimizer.optimizer.register_step_pre_hook(
        lambda *_: gradients.append({n: p.grad.clone() for n, p in trained.named_parameters() if p.grad is not None})
    )
    for step in range(2):
        total_tokens, loss, nll, lr = one_step(run, micro_batches)
        assert total_tokens == target_tokens(PAIRS)
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


def test_a_step_returns_its_counts_and_leaves_the_budget_and_the_next_rate_to_the_loop(tmp_path):
    # Proves: the step writes nothing of the budget; it returns the step's tokens, the main process's clock and its
    # stop signal, which the loop adds to the budget (and the step to the state) before `next_rate`, since a schedule
    # over the budget reads them.
    run = make_run(tmp_path, tiny_model())
    run.budget.stop_requests.signum = signal.SIGTERM  # a stop asked of this process during the step
    done = train_step(run.components, [(collate(PAIRS), target_tokens(PAIRS))], 0, run.budget)
    assert (done.tokens, done.stop_signal, done.updated) == (target_tokens(PAIRS), signal.SIGTERM, True)
    assert done.lr == pytest.approx(noam_rate(1, D_MODEL, WARMUP), rel=1e-12) and done.elapsed_seconds >= 0
    assert (run.budget.elapsed_seconds, run.budget.stop_signal, run.budget.part_tokens) == (0.0, 0, 0)
    assert run.components.scheduler.get_last_lr()[0] == pytest.approx(noam_rate(1, D_MODEL, WARMUP), rel=1e-12)
    next_rate(run.components, done)
    assert run.components.scheduler.get_last_lr()[0] == pytest.approx(noam_rate(2, D_MODEL, WARMUP), rel=1e-12)


def test_a_non_finite_step_leaves_the_weights_and_the_next_read_stops_the_run(tmp_path):
    # The step is skipped on the device (fused Adam's found_inf), without the host waiting for it; reading
    # the losses, as logging and every checkpoint do, raises, naming the step.
    model = tiny_model()
    run = make_run(tmp_path, model)
    with torch.no_grad():
        model.lm_head.weight[5, 0] = math.inf  # tied with the embeddings: every logit row sees it
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(FloatingPointError, match="became nan at step 1; that step left the weights.*no checkpoint was written yet"):
        one_step(run, [collate(PAIRS)])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], equal_nan=True, msg=name)
    assert all(state["step"] == 0 for state in run.components.optimizer.optimizer.state.values())  # Adam's count did not move


def split_of(pairs) -> TokenizedSplit:
    rows = {"input_ids": [s for s, _ in pairs], "labels": [t for _, t in pairs],
            "length": [max(len(s), len(t)) for s, t in pairs]}
    return TokenizedSplit(datasets.Dataset.from_dict(rows), len(pairs), 0, 0)


@pytest.mark.parametrize("fast_paths", [True, False], ids=["fast paths", "plain paths"])
def test_evaluation_loss_and_perplexity_are_per_target_token_over_the_whole_split(tmp_path, fast_paths):
    """Batched by tokens (here several batches), summed, then divided once: the numbers of the whole split."""
    model = tiny_model(fast_paths)
    model.train()
    args = TrainArguments(output_dir=str(tmp_path), label_smoothing=SMOOTHING, max_tokens=12)
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


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one state per process: the next test's Accelerator must not inherit this one's bf16."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_a_bf16_step_evaluation_and_decoding_run_under_autocast_with_no_fp32_copy_of_the_logits(tmp_path, fresh_accelerator_state):
    # Proves: in a bf16 run the logits reach the loss as the model made them, in bf16 (Accelerate's wrapper
    # of `forward` copied them to fp32: 4 bytes more per logit), in training and in evaluation, and decoding
    # runs under the same autocast (its output projection computes in bf16).
    model = tiny_model().float()
    run = make_run(tmp_path, model, mixed_precision="bf16")
    outputs, projections = [], []
    model.register_forward_hook(lambda module, args, output: outputs.append(output.logits.dtype))
    model.lm_head.register_forward_hook(lambda module, args, output: projections.append(output.dtype))
    one_step(run, [collate(PAIRS)])
    assert outputs == [torch.bfloat16]
    split = split_of(PAIRS)
    split.dataset = split.dataset.add_column("reference", ["a b"] * len(PAIRS))
    decode = SimpleNamespace(pad_token_id=PAD, batch_decode=lambda ids, skip_special_tokens: ["a b"] * len(ids))
    outputs.clear(), projections.clear()
    metrics = evaluate(run.components.accelerator, run.components.model, decode, split, TrainArguments(
        output_dir=str(tmp_path), max_tokens=64, num_beams=2), translate_samples=len(PAIRS))
    assert metrics["translated"] == len(PAIRS)
    assert outputs and set(outputs) == {torch.bfloat16}
    assert len(projections) > len(outputs) and set(projections) == {torch.bfloat16}  # decoding steps too
