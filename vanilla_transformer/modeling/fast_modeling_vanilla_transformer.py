"""The model's speed-up: §5.4's label-smoothed cross-entropy with its gradient in closed form, the same
numbers as `LabelSmoothedCrossEntropy` (modeling_vanilla_transformer.py) with less memory and time.
The model is built with it unless `config.fast_paths` is False (`loss_class`); tests/test_fast_paths.py
compares the two, and benchmarks/ says what it saves.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only torch
and the modeling file beside it.
"""

from __future__ import annotations

import torch

from .modeling_vanilla_transformer import LabelSmoothedCrossEntropy


# Rows of logits turned into fp32 log-probabilities at a time: a few MiB, which the allocator reuses from one
# block of rows to the next and the cache holds, where the whole (N, V) fp32 tensor is fresh memory at every step.
BLOCK_BYTES = 8 * 2**20


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Cross-entropy against the smoothed target q = (1 - ε)·onehot(y) + ε/V (§5.4), with its gradient in
    closed form: ∂loss/∂logits = softmax(logits) - q.

    Autograd keeps the log-probabilities for backward, where it fills a zero tensor of the logits' size
    for the gather and runs softmax's backward over both. Here the gradient is made in the forward pass
    from the log-probabilities it already holds, a block of rows at a time, and backward only scales it:
    the same numbers with no (N, V) tensor but the gradient.
    """

    @staticmethod
    def forward(ctx, logits, labels, epsilon):
        ignored = labels == -100
        target = labels.masked_fill(ignored, 0).unsqueeze(1)  # (N, 1)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        in_place = grad is not None and grad.dtype == torch.float32
        rows = max(1, BLOCK_BYTES // (4 * logits.size(-1)))
        nll, loss = [], []
        for start in range(0, logits.size(0), rows):
            block = slice(start, start + rows)
            # fp32 logits' gradient is made in place from their log-probabilities; other dtypes' is copied
            log_probs = torch.log_softmax(logits[block], dim=-1, dtype=torch.float32, out=grad[block] if in_place else None)
            nll.append(-log_probs.gather(1, target[block]).squeeze(1))
            loss.append((1.0 - epsilon) * nll[-1] - epsilon * log_probs.mean(dim=-1) if epsilon else nll[-1])
            if grad is not None:  # softmax - q, in fp32
                softmax = log_probs.exp_()
                if epsilon:
                    softmax.sub_(epsilon / logits.size(-1))
                softmax.scatter_add_(1, target[block], softmax.new_full(target[block].shape, epsilon - 1.0))
                if not in_place:
                    grad[block] = softmax
        nll, loss = torch.cat(nll).masked_fill(ignored, 0.0), torch.cat(loss).masked_fill(ignored, 0.0)
        if grad is not None:  # ignored tokens get no gradient: their rows are zeroed in backward's one pass
            ctx.save_for_backward(grad, (~ignored).unsqueeze(1).to(logits.dtype))
        nll = nll.sum()
        ctx.mark_non_differentiable(nll)
        return loss.sum(), nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        grad, kept = ctx.saved_tensors  # (N, V), (N, 1)
        return grad * (kept * grad_loss), None, None


def loss_class(config):
    """The model's loss, chosen once when it is built: §5.4's `LabelSmoothedCrossEntropy`, or with
    `config.fast_paths` its twin below (the same numbers with less memory and time)."""
    return ClosedFormCrossEntropy if config.fast_paths else LabelSmoothedCrossEntropy


class ClosedFormCrossEntropy(LabelSmoothedCrossEntropy):
    """`LabelSmoothedCrossEntropy` (the smoothed loss and the NLL, each summed over the target tokens whose
    label is not -100) from one log-softmax, with the gradient in closed form."""

    def forward(self, logits, labels, epsilon: float):
        return _SmoothedCrossEntropy.apply(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), epsilon)


__all__ = ["ClosedFormCrossEntropy", "loss_class"]
