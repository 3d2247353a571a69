"""The model's speed-up (fast_modeling_vanilla_transformer.py) is chosen when the model is built, gives the
plain path's numbers, and `fast_paths=False` builds the plain paper path; nothing is swapped afterwards."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling import fast_modeling_vanilla_transformer as fast
from vanilla_transformer.modeling.modeling_vanilla_transformer import LabelSmoothedCrossEntropy

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


@pytest.mark.parametrize("overrides", [{}, {"attention_score": "location", "local_attention": "local-p"}])
def test_a_model_is_made_of_the_modeling_files_classes_and_torch_s_and_the_switch_is_read_at_construction(overrides):
    for switch, loss in ((True, fast.ClosedFormCrossEntropy), (False, LabelSmoothedCrossEntropy)):
        model = make_model(fast_paths=switch, **overrides)
        assert type(model.criterion) is loss
        for module in model.modules():
            home = inspect.getmodule(type(module)).__name__
            assert home.startswith(("vanilla_transformer.modeling.", "torch.nn.modules.")), (type(module), home)
        printed = repr(model)
        assert "Dropout(" in printed and "CPUDropout" not in printed and "SinusoidTable" not in printed
    with pytest.raises(ValueError, match="`fast_paths` must be true or false"):
        VanillaTransformerConfig.tiny(fast_paths="yes")


@pytest.mark.parametrize("block_rows", [None, 1, 5], ids=["one block", "row by row", "blocks of 5 rows"])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_closed_form_cross_entropy_and_its_gradient_are_the_plain_loss_s_and_torch_s(epsilon, block_rows, monkeypatch):
    if block_rows is not None:  # the blocks of rows the fast loss works through, as with a large vocabulary
        monkeypatch.setattr(fast, "BLOCK_BYTES", block_rows * 4 * VOCAB)
    logits, labels = logits_and_labels()
    expected = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), label_smoothing=epsilon, reduction="sum")
    (expected_grad,) = torch.autograd.grad(expected * 0.5, logits)
    expected_nll = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="sum")
    for criterion in (fast.ClosedFormCrossEntropy(), LabelSmoothedCrossEntropy()):
        loss, nll = criterion(logits, labels, epsilon)
        (grad,) = torch.autograd.grad(loss * 0.5, logits)
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(grad, expected_grad)
        assert grad[0, 3:].abs().max() == 0 and grad[2, 1:].abs().max() == 0  # ignored tokens get none
        torch.testing.assert_close(nll, expected_nll)
        assert not nll.requires_grad
        # Half-precision logits: computed in fp32, the gradient comes back in the logits' dtype.
        (half_grad,) = torch.autograd.grad(criterion(logits.bfloat16(), labels, epsilon)[0] * 0.5, logits)
        torch.testing.assert_close(half_grad, expected_grad, atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        torch.testing.assert_close(fast.ClosedFormCrossEntropy()(logits, labels, epsilon)[0], expected)


def test_fast_paths_true_and_false_train_to_the_same_weights_for_the_same_seed():
    """20 SGD steps with dropout and label smoothing: the same random stream, the same numbers. (Adam would turn
    the rounding differences of near-zero gradients into whole steps: it divides by their size.)"""
    weights = []
    for switch in (True, False):
        model = make_model(fast_paths=switch, label_smoothing=0.1).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(1)
        for _ in range(20):
            model(**batch()).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-4, atol=1e-5)
    assert not torch.equal(weights[0], torch.cat([p.detach().flatten() for p in make_model().parameters()]))


def test_the_loss_is_per_target_token_or_per_num_items_in_batch_and_the_nll_beside_it():
    model = make_model(label_smoothing=0.1, dropout=0.0).eval()
    out = model(**batch())
    tokens = (batch()["labels"] != -100).sum()
    logits = out.logits.detach()
    plain_loss, plain_nll = LabelSmoothedCrossEntropy()(logits, batch()["labels"], 0.1)
    torch.testing.assert_close(out.loss, plain_loss / tokens)
    torch.testing.assert_close(out.nll, plain_nll / tokens)
    summed = model(**batch(), num_items_in_batch=1)
    torch.testing.assert_close(summed.loss, plain_loss)
    assert not torch.allclose(summed.nll, summed.loss)  # no smoothing in the NLL
