"""The model's speed-ups (fast_modeling_vanilla_transformer.py) give the plain path's numbers, and
`config.fast_paths = False` runs none of them."""

import pytest
import torch
import torch.nn.functional as F

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling import fast_modeling_vanilla_transformer as fast
from vanilla_transformer.modeling.modeling_vanilla_transformer import sinusoidal_encoding
from vanilla_transformer.training.loss import label_smoothed_loss

VOCAB = 40


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.tiny(vocab_size=VOCAB, **overrides))


def batch():
    g = torch.Generator().manual_seed(0)
    input_ids, labels = torch.randint(3, VOCAB, (2, 9), generator=g), torch.randint(3, VOCAB, (2, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:], labels[1, 5:] = 0, -100
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def logits_and_labels():
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, VOCAB) * 4).requires_grad_()
    labels = torch.randint(0, VOCAB, (3, 5))
    labels[0, 3:] = labels[2, 1:] = -100
    return logits, labels


def test_the_model_uses_the_drop_ins_by_default_and_configs_without_the_switch_get_it():
    model = make_model()
    kinds = {type(module) for module in model.modules()}
    assert {fast.CPUDropout, fast.SinusoidTable, fast.ClosedFormCrossEntropy} <= kinds
    assert torch.nn.Dropout not in kinds  # every plain one replaced, in one place
    assert VanillaTransformerConfig.from_dict({"vocab_size": VOCAB}).fast_paths is True
    with pytest.raises(ValueError, match="`fast_paths` must be true or false"):
        VanillaTransformerConfig.tiny(fast_paths="yes")


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_closed_form_cross_entropy_and_its_gradient_are_torchs(epsilon):
    logits, labels = logits_and_labels()
    expected = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), label_smoothing=epsilon, reduction="sum")
    (expected_grad,) = torch.autograd.grad(expected * 0.5, logits)
    loss, nll = fast.smoothed_cross_entropy(logits, labels, epsilon)
    (grad,) = torch.autograd.grad(loss * 0.5, logits)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert grad[0, 3:].abs().max() == 0 and grad[2, 1:].abs().max() == 0  # ignored tokens get none
    torch.testing.assert_close(nll, F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="sum"))
    assert not nll.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(fast.smoothed_cross_entropy(logits, labels, epsilon)[0], expected)
    # Half-precision logits: computed in fp32, the gradient comes back in the logits' dtype.
    (half_grad,) = torch.autograd.grad(fast.smoothed_cross_entropy(logits.bfloat16(), labels, epsilon)[0] * 0.5, logits)
    torch.testing.assert_close(half_grad, expected_grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_training_loss_fast_and_plain_agree(epsilon):
    logits, labels = logits_and_labels()
    results = []
    for switch in (True, False):
        loss, nll = label_smoothed_loss(logits, labels, epsilon, fast=switch)
        results.append((loss, nll, torch.autograd.grad(loss, logits)[0]))
        assert not nll.requires_grad
    for fast_value, plain_value in zip(*results):
        torch.testing.assert_close(fast_value, plain_value)


def test_the_model_s_loss_and_gradients_are_the_same_on_both_paths():
    """Dropout off: the closed-form loss against F.cross_entropy(..., label_smoothing=ε), through the model."""
    results = []
    for switch in (True, False):
        model = make_model(dropout=0.0, label_smoothing=0.1).train()
        model.config.fast_paths = switch
        loss = model(**batch()).loss
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_sinusoids_from_the_table_are_the_formula_s_bit_for_bit():
    embeddings = make_model(max_position_embeddings=8).model.decoder.embeddings
    table = embeddings.sinusoids
    assert table.table is None
    for past_length, length in [(0, 5), (3, 1), (7, 1), (6, 9), (40, 2)]:
        positions = torch.arange(length) + past_length
        assert torch.equal(table(past_length, length, positions.device), sinusoidal_encoding(positions, 64))
    assert table.table.size(0) == 42  # 8 at first, then twice that, then the 42 asked for
    assert not any("sinusoid" in name for name in make_model().state_dict())  # no weight, not saved
    model = make_model().eval()
    inputs = {k: v for k, v in batch().items() if k != "labels"}
    inputs["decoder_input_ids"] = batch()["labels"].clamp(min=0)
    on = model(**inputs).logits
    model.config.fast_paths = False
    assert torch.equal(model(**inputs).logits, on)


def test_cpu_dropout_zeroes_p_of_the_elements_and_scales_the_rest_as_torch_s():
    config = VanillaTransformerConfig.tiny(vocab_size=VOCAB)
    x = torch.randn(400, 500, requires_grad=True)
    for dropout in (fast.CPUDropout(0.25, config).train(), torch.nn.Dropout(0.25).train()):
        y = dropout(x)
        kept = y != 0
        assert abs(kept.float().mean().item() - 0.75) < 0.005
        torch.testing.assert_close(y[kept], x[kept] / 0.75)
        (grad,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(grad, kept.float() / 0.75)  # the same mask in backward
        assert torch.equal(dropout.eval()(x), x)  # the identity in evaluation
        assert not torch.equal(dropout.train()(x), y)  # a new mask every call
    assert torch.equal(fast.CPUDropout(0.0, config).train()(x), x)


def test_fast_paths_false_runs_none_of_the_fast_code_and_true_runs_all_of_it(monkeypatch):
    calls = []
    for name in ("cpu_dropout", "sinusoid_rows", "smoothed_cross_entropy"):
        real = getattr(fast, name)
        monkeypatch.setattr(fast, name, lambda *args, _real=real, _name=name: calls.append(_name) or _real(*args))
    model = make_model(label_smoothing=0.1)
    for switch, expected in ((False, set()), (True, {"cpu_dropout", "sinusoid_rows", "smoothed_cross_entropy"})):
        calls.clear()
        model.config.fast_paths = switch  # read at every call: no rebuilding
        model.train()(**batch()).loss.backward()
        model.eval().generate(batch()["input_ids"], max_new_tokens=3)
        assert set(calls) == expected
        calls.clear()
        label_smoothed_loss(torch.randn(2, 3, VOCAB), torch.ones(2, 3, dtype=torch.long), fast=switch)
        assert calls == (["smoothed_cross_entropy"] if switch else [])
