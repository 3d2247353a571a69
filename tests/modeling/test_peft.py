"""PEFT on the model: LoRA, IA3, prompt tuning and prefix tuning each train, save, reload, decode with their
adapter and (where the method allows) merge back into the weights."""

import copy

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]
METHODS = {
    "lora": lambda: LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=4, lora_alpha=8, target_modules=ATTENTION),
    # IA3 rescales the keys, the values and the feed-forward's inner activations (fc2's input).
    "ia3": lambda: IA3Config(
        task_type=TaskType.SEQ_2_SEQ_LM, target_modules=["k_proj", "v_proj", "fc2"], feedforward_modules=["fc2"]
    ),
    "prompt": lambda: PromptTuningConfig(task_type=TaskType.SEQ_2_SEQ_LM, num_virtual_tokens=4),
    "prefix": lambda: PrefixTuningConfig(task_type=TaskType.SEQ_2_SEQ_LM, num_virtual_tokens=4),
}
MERGEABLE = {"lora", "ia3"}


@pytest.fixture(scope="module")
def batch(tiny_corpus):
    """Eight real en-es pairs, labels padded with -100."""
    tokenizer, pairs = tiny_corpus
    pairs = pairs[:8]
    inputs = tokenizer([s for s, _ in pairs], padding=True, return_tensors="pt")
    labels = tokenizer([t for _, t in pairs], padding=True, return_tensors="pt")["input_ids"]
    labels[labels == tokenizer.pad_token_id] = -100
    return {**inputs, "labels": labels}


def eval_logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("method", list(METHODS))
def test_peft_method_trains_saves_reloads_and_merges(method, hub_tiny_model, batch, tmp_path):
    base, _ = hub_tiny_model
    torch.manual_seed(0)
    model = get_peft_model(copy.deepcopy(base), METHODS[method]())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and sum(p.numel() for p in trainable) < sum(p.numel() for p in base.parameters()) / 10

    # Training mode, as Seq2SeqTrainer runs it: the adapter must reach the loss (a gradient) and lower it.
    model.train()
    optimizer = torch.optim.Adam(trainable, lr=0.3 if method == "prompt" else 3e-2)  # prompts learn slowly
    losses = []
    for _ in range(6):
        loss = model(**batch).loss
        assert loss.requires_grad, f"{method}: the loss does not depend on the adapter in training mode"
        optimizer.zero_grad()
        loss.backward()
        # Every adapter weight is reached (LoRA's A has a zero gradient until B, zero at first, moves).
        assert all(p.grad is not None for p in trainable) and any(p.grad.abs().sum() > 0 for p in trainable)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses

    # The adapter changes what the model computes, and the base model itself is untouched.
    trained = eval_logits(model, batch)
    assert not torch.allclose(trained, eval_logits(base, batch), atol=1e-3)

    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    torch.testing.assert_close(eval_logits(reloaded, batch), trained, atol=1e-5, rtol=1e-5)

    # It decodes with its adapter as its forward scores: greedy search's tokens are the forward's argmax step by step
    # (prefix tuning's prefix reaches transformers' loop as `past_key_values` beside its `cache`); beam search runs.
    inputs = {name: batch[name] for name in ("input_ids", "attention_mask")}
    with torch.no_grad():
        greedy = reloaded.generate(**inputs, num_beams=1, max_new_tokens=5, min_new_tokens=5)
        assert torch.equal(greedy, _greedy_by_forward(reloaded, inputs, 5, base.config))
        assert reloaded.generate(**inputs, num_beams=4, max_new_tokens=5).size(0) == inputs["input_ids"].size(0)

    if method in MERGEABLE:
        merged = reloaded.merge_and_unload()
        assert type(merged) is type(base) and not any("lora" in n or "ia3" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(eval_logits(merged, batch), trained, atol=1e-4, rtol=1e-4)


def _greedy_by_forward(model, inputs, steps: int, config) -> torch.Tensor:
    """Greedy search by hand: the whole forward on the tokens so far, its argmax appended, </s> held back."""
    decoded = torch.full((inputs["input_ids"].size(0), 1), config.decoder_start_token_id)
    for _ in range(steps):
        logits = model(**inputs, decoder_input_ids=decoded).logits[:, -1]
        logits[:, config.eos_token_id] = -float("inf")
        decoded = torch.cat([decoded, logits.argmax(-1, keepdim=True)], dim=1)
    return decoded
