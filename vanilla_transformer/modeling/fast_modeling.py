"""The model's speed-ups, chosen when it is built (modeling_vanilla_transformer.py's `attention_class` and its
criterion) unless `config.fast_paths` is False:

- §5.4's label-smoothed cross-entropy with its gradient in closed form (`ClosedFormCrossEntropy`), the same numbers as
  `LabelSmoothedCrossEntropy` (modeling_vanilla_transformer.py) with less memory and time;
- attention's projections of one input as one product while training (`FusedMultiHeadAttention`, attention.py's
  `MultiHeadAttention` with `fused_linear`).

tests/modeling/test_fast_modeling.py compares them with the plain path, and
benchmarks/ says what they save.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only torch and
attention.py beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import MultiHeadAttention

# Rows of logits turned into fp32 log-probabilities at a time, on a CPU: a few MiB, which the allocator reuses from
# one block of rows to the next and the cache holds, where the whole (N, V) fp32 tensor is fresh memory at every step.
BLOCK_BYTES = 8 * 2**20
# Elsewhere (a GPU's caching allocator reuses its memory) every block is a handful of kernel launches: the whole
# tensor at once, up to this size.
DEVICE_BLOCK_BYTES = 2 * 2**30


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Cross-entropy against the smoothed target q = (1 - ε)·onehot(y) + ε/V (§5.4), with its gradient in
    closed form: ∂loss/∂logits = softmax(logits) - q.

    Autograd keeps the log-probabilities for backward, where it fills a zero tensor of the logits' size
    for the gather and runs softmax's backward over both. Here the gradient is made in the forward pass
    from the log-probabilities it already holds, a block of rows at a time, and backward only scales it:
    the same numbers with no (N, V) tensor but the gradient. Whatever the rows, each block is the same few
    kernels (softmax, gather, mean, exp, the target's scatter, the write of softmax - q) and the loss is summed
    once.
    """

    @staticmethod
    def forward(ctx, logits, labels, epsilon):
        ctx.set_materialize_grads(False)  # no zero tensor made for the NLL, which has no gradient
        ignored = labels == -100
        target = labels.masked_fill(ignored, 0).unsqueeze(1)  # (N, 1)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        fp32 = logits.dtype == torch.float32
        in_place = grad is not None and fp32
        block_bytes = BLOCK_BYTES if logits.device.type == "cpu" else DEVICE_BLOCK_BYTES
        rows = max(1, block_bytes // (4 * logits.size(-1)))
        # -(1 - ε) at each row's target, added to the softmax: made once, a slice of it for every block
        one_hot = None if grad is None else logits.new_full((min(rows, logits.size(0)), 1), epsilon - 1.0,
                                                            dtype=torch.float32)
        # The log-probabilities go into the gradient (fp32 logits': made in place from them) or one buffer, other
        # dtypes' blocks are made fp32 in another: tensors made once a call whatever the blocks, since a CPU's
        # allocator gives fresh memory fresh pages.
        shape = (min(rows, logits.size(0)), logits.size(-1))
        fp32_out = None if in_place else logits.new_empty(shape, dtype=torch.float32)
        fp32_block = None if fp32 else logits.new_empty(shape, dtype=torch.float32)
        picked, means = [], []  # log p(y) and the mean log-probability of each row, (rows, 1) per block
        for start in range(0, logits.size(0), rows):
            block = slice(start, start + rows)
            size = logits[block].size(0)
            rows_fp32 = logits[block] if fp32 else fp32_block[:size].copy_(logits[block])
            log_probs = torch.log_softmax(rows_fp32, dim=-1, out=grad[block] if in_place else fp32_out[:size])
            picked.append(log_probs.gather(1, target[block]))
            if epsilon:
                means.append(log_probs.mean(dim=-1, keepdim=True))
            if grad is not None:  # softmax - q in fp32, written in the gradient's dtype
                softmax = log_probs.exp_().scatter_add_(1, target[block], one_hot[: log_probs.size(0)])
                if epsilon:  # the ε/V of every entry, subtracted in the pass that writes the block
                    torch.sub(softmax, epsilon / logits.size(-1), out=grad[block])
                elif not in_place:
                    grad[block] = softmax
        ignored = ignored.unsqueeze(1)  # (N, 1)
        picked = _joined(picked).masked_fill_(ignored, 0.0).sum()  # the sum of log p(y) over the kept tokens
        nll = -picked
        # -Σ_v q(v) log p(v) = -(1 - ε)·log p(y) - ε·mean_v log p(v), summed over the kept tokens
        loss = picked * (epsilon - 1.0)
        if epsilon:
            loss.sub_(_joined(means).masked_fill_(ignored, 0.0).sum(), alpha=epsilon)
        if grad is not None:
            ctx.save_for_backward(grad, (~ignored).to(logits.dtype))
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        grad, kept = ctx.saved_tensors  # (N, V), (N, 1)
        # In place: no fresh (N, V) tensor a step (a CPU's allocator gives one fresh pages). One (N, 1) operand
        # broadcast: a CPU vectorises an elementwise kernel with at most one, and runs one with two (as
        # addcmul(-ε/V·scale, grad, scale) would be) element by element. A second backward (retain_graph) is
        # refused by autograd, which sees the saved gradient changed.
        return grad.mul_(kept * grad_loss), None, None  # ignored tokens' rows are zeroed in this one pass


def _joined(blocks: list) -> torch.Tensor:
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


class ClosedFormCrossEntropy(nn.Module):
    """`LabelSmoothedCrossEntropy`'s twin (the smoothed loss and the NLL, each summed over the target tokens
    whose label is not -100) from one log-softmax, with the gradient in closed form."""

    def forward(self, logits, labels, epsilon: float):
        return _SmoothedCrossEntropy.apply(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), epsilon)


def fused_linear(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """Each of `linears` (nn.Linear of the same input width) applied to `x`, as one product with their weights and
    biases concatenated: one matrix product forward and two backward instead of one and two for each, and under
    autocast one cast of the concatenation instead of one per weight. The parameters stay the modules' own (the
    concatenation is made at every call, a copy of the weights), so their names, and what loads and saves them,
    do not change. Modules of another class (PEFT's LoRA layers, quantized ones) each run their own forward."""
    if any(type(linear) is not nn.Linear or linear.bias is None for linear in linears):
        return tuple(linear(x) for linear in linears)
    weight = torch.cat([linear.weight for linear in linears])
    bias = torch.cat([linear.bias for linear in linears])
    return torch.nn.functional.linear(x, weight, bias).split([linear.out_features for linear in linears], dim=-1)


class FusedMultiHeadAttention(MultiHeadAttention):
    """MultiHeadAttention (the same parameters, names and numbers) whose projections of one input are one product
    while gradients are on (`fused_linear`): W^Q, W^K and W^V of self-attention, W^K and W^V of
    attention over the encoder output. Fewer, larger products and casts per training step; decoding keeps one
    product per projection, which the package's oneDNN decoding can run on packed weights. Chosen when a layer is built,
    with `config.fast_paths`."""

    def projections(self, hidden_states, source):
        if source is None or not torch.is_grad_enabled():
            return super().projections(hidden_states, source)
        if source is hidden_states:
            return tuple(map(self._split_heads, fused_linear(hidden_states, (self.q_proj, self.k_proj, self.v_proj))))
        return self._heads(self.q_proj, hidden_states), *map(self._split_heads, fused_linear(source, (self.k_proj, self.v_proj)))


__all__ = ["ClosedFormCrossEntropy", "FusedMultiHeadAttention", "fused_linear"]
