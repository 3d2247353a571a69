"""The model's speed-up (fast_modeling.py) is chosen when the model is built, gives the
plain path's numbers, and `fast_paths=False` builds the plain paper path; nothing is swapped afterwards but the
packed linear maps' forward, while one of our searches packs them."""

import inspect
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling import fast_modeling as fast
from vanilla_transformer.modeling.attention import MultiHeadAttention
from vanilla_transformer.modeling.fast_modeling import FusedMultiHeadAttention
from vanilla_transformer.modeling.modeling_vanilla_transformer import LabelSmoothedCrossEntropy
from vanilla_transformer.modeling.saving import CODE_FILES

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not an installed package
from benchmarks.kernels import count_kernels  # noqa: E402

VOCAB = 40


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, **overrides))


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
        VanillaTransformerConfig.from_preset("tiny", fast_paths="yes")


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


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_closed_form_cross_entropy_launches_seven_kernels_a_block_and_one_block_off_the_cpu(epsilon, monkeypatch):
    # Proves: the blocks of rows (a CPU's cache) cost the same few kernels each, the loss is summed once, and a
    # device other than the CPU (here "meta", as a GPU) takes logits of more than a CPU block in one.
    logits, labels = logits_and_labels()
    logits = logits.detach().bfloat16().requires_grad_()

    def counted(rows):
        monkeypatch.setattr(fast, "BLOCK_BYTES", rows * 4 * VOCAB)
        logits.grad = None
        return count_kernels(lambda: fast.ClosedFormCrossEntropy()(logits, labels, epsilon)[0].backward())

    whole, by_row = counted(15), counted(1)
    # cast to fp32, log-softmax, gather, [mean,] exp, the target's scatter, the write back ([- ε/V and] cast)
    per_block = 7 if epsilon else 6
    assert by_row.total - whole.total == 14 * per_block + 1 + bool(epsilon)  # and the blocks' sums joined
    assert log_softmaxes(whole) == 1 and log_softmaxes(by_row) == 15
    assert whole.total <= (22 if epsilon else 18)
    monkeypatch.setattr(fast, "BLOCK_BYTES", 8 * 2**20)
    meta = torch.empty(4096, 1024, device="meta", dtype=torch.bfloat16, requires_grad=True)  # 16 MiB in fp32
    counts = count_kernels(lambda: fast.ClosedFormCrossEntropy()(meta, torch.zeros(4096, dtype=torch.long,
                                                                                    device="meta"), epsilon)[0].backward())
    assert log_softmaxes(counts) == 1


def log_softmaxes(counts) -> int:
    return counts["aten._log_softmax"] + counts["aten.log_softmax"]  # the latter: called with out=, one kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_closed_form_cross_entropy_s_backward_is_one_product_of_the_gradient_by_a_column_in_place(dtype):
    # Proves: backward scales the (N, V) gradient by an (N, 1) column in one kernel with one broadcast operand,
    # which a CPU vectorises (addcmul(-ε/V·scale, grad, scale) has two, and a CPU runs it element by element), in
    # place (no fresh (N, V) tensor); a second backward through the same graph is refused, not given wrong numbers.
    logits, labels = logits_and_labels()
    logits = logits.detach().to(dtype).requires_grad_()
    loss = fast.ClosedFormCrossEntropy()(logits * 1, labels, 0.1)[0]
    counts = count_kernels(lambda: loss.backward(retain_graph=True))
    assert counts == {"aten.ones_like": 1, "aten.mul": 2, "aten.mul_": 1}  # seed; x 1's; the column; its product
    with pytest.raises(RuntimeError):  # autograd's refusal; its wording is torch's
        loss.backward()


def plain_and_fused(**overrides):
    fused = make_model(fast_paths=True, dropout=0.0, label_smoothing=0.1, **overrides).train()
    plain = make_model(fast_paths=False, dropout=0.0, label_smoothing=0.1, **overrides).train()
    plain.load_state_dict(fused.state_dict())
    return fused, plain


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_fused_attention_trains_as_the_plain_attention_under_the_same_parameter_names(autocast):
    fused, plain = plain_and_fused()
    layer = fused.model.decoder.layers[0]
    assert type(layer.self_attn) is type(layer.cross_attn) is FusedMultiHeadAttention
    assert type(plain.model.decoder.layers[0].self_attn) is MultiHeadAttention
    assert list(fused.state_dict()) == list(plain.state_dict())  # q_proj, k_proj, v_proj: checkpoints, PEFT, export
    results = []
    for model in (fused, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch()).loss
        loss.backward()
        results.append((loss, {name: p.grad for name, p in model.named_parameters()}))
    (loss, grads), (plain_loss, plain_grads) = results
    tolerance = dict(rtol=2e-2, atol=2e-3) if autocast else {}
    torch.testing.assert_close(loss, plain_loss, **tolerance)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], **tolerance, msg=name)
    with torch.no_grad():  # decoding's products stay one per projection (oneDNN may pack each)
        counts = count_kernels(lambda: fused(**batch()))
    assert counts["aten.cat"] == 0


def test_fused_attention_makes_one_product_of_q_k_v_and_one_of_the_cross_attention_s_k_v():
    # Proves the count: tiny has 4 self-attentions and 2 attentions over the encoder output; each fused
    # projection saves its products forward (addmm) and backward (mm for the input's and the weight's gradient).
    counts = {}
    for model, name in zip(plain_and_fused(), ("fused", "plain")):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            counts[name] = count_kernels(lambda: model(**batch()).loss.backward())
    fused, plain = counts["fused"], counts["plain"]
    saved_products = 4 * 2 + 2 * 1  # Q, K, V -> one; K, V -> one
    assert plain["aten.addmm"] - fused["aten.addmm"] == saved_products
    assert plain["aten.mm"] - fused["aten.mm"] == 2 * saved_products
    assert fused.casts < plain.casts and fused.total < plain.total


def test_fused_attention_leaves_peft_s_lora_layers_to_run_their_own_forward():
    from peft import LoraConfig, TaskType, get_peft_model

    outputs = []
    for model in plain_and_fused():
        config = LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                            init_lora_weights=False)  # random adapters: they change the output
        torch.manual_seed(3)
        lora = get_peft_model(model, config)
        outputs.append(lora(**batch()).loss)
        outputs[-1].backward()
        assert all(p.grad is not None for name, p in lora.named_parameters() if "lora_" in name)
    torch.testing.assert_close(outputs[0], outputs[1])


def test_the_papers_attention_file_holds_no_speed_up():
    """The fused twin lives in fast_modeling.py; attention.py, the paper's §3.2, imports no fast_* file."""
    import vanilla_transformer.modeling.attention as attention

    source = Path(attention.__file__).read_text()
    assert FusedMultiHeadAttention.__module__ == fast.__name__
    assert "FusedMultiHeadAttention" not in vars(attention) and "fast_" not in source.split('"""', 2)[2]


def test_the_model_is_built_of_plain_linear_maps_and_the_files_that_ship_hold_no_onednn_op():
    """The model's linear maps are nn.Linear with the switch on or off; no file a saved folder ships names a oneDNN
    op or the package's oneDNN decoding (onednn_decoding.py, tested in tests/test_onednn_decoding.py)."""
    for switch in (True, False):
        model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=40, fast_paths=switch))
        assert {type(module) for module in model.modules() if isinstance(module, torch.nn.Linear)} == {torch.nn.Linear}
    modeling = Path(fast.__file__).parent
    for name in CODE_FILES:
        text = (modeling / name).read_text(encoding="utf-8")
        assert not any(word in text for word in ("mkldnn", "PackedLinear", "packed_weights")), name
