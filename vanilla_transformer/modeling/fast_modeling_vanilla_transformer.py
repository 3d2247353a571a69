"""The model's speed-ups: drop-ins for three plain pieces of modeling_vanilla_transformer.py that give
the same numbers with less work. None of them changes what the model computes (tests/test_fast_paths.py
compares each with the piece it replaces); benchmarks/ and docs/benchmarks.md say what each saves.

    plain (modeling_vanilla_transformer.py)      drop-in (here)
    nn.Dropout (§5.4)                            CPUDropout: float32 uniform draws, a 1-byte mask
    SinusoidalEncoding (§3.5)                    SinusoidTable: the formula's rows, computed once
    LabelSmoothedCrossEntropy (§5.4)             ClosedFormCrossEntropy: the gradient made in forward

`install(model)` puts them in place of the plain modules; the model calls it once, at the end of its
construction. Each drop-in decides at every call, from `config.fast_paths` (default True), whether it
runs or hands over to the plain module's forward: `model.config.fast_paths = False` runs the plain
paper path everywhere without rebuilding the model. They also hand over wherever they do not apply
(other devices, evaluation, a compiled graph).

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only torch
and the modeling file beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from .modeling_vanilla_transformer import LabelSmoothedCrossEntropy, SinusoidalEncoding, sinusoidal_encoding


def enabled(config) -> bool:
    """The one switch: `config.fast_paths`."""
    return config.fast_paths


class CPUDropout(nn.Dropout):
    """§5.4's dropout on a CPU. torch draws a float Bernoulli per element and keeps that float mask for
    backward; comparing float32 uniform draws with p gives the same distribution faster and keeps a
    1-byte mask. Other devices run torch's fused kernel."""

    def __init__(self, p: float, config):
        super().__init__(p)
        self.config = config

    def forward(self, x):
        if enabled(self.config) and self.training and 0.0 < self.p < 1.0 and x.device.type == "cpu":
            return cpu_dropout(x, self.p)
        return super().forward(x)


def cpu_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    keep = torch.rand(x.shape, dtype=torch.float32, device=x.device) >= p  # bool: 1 byte per element
    return x * keep * (1.0 / (1.0 - p))


class SinusoidTable(SinusoidalEncoding):
    """§3.5's sinusoids read from a table of the first positions, made on first use and doubled when
    outgrown (as Marian keeps its sinusoids): decoding asks for one position per step. The table is no
    weight and is not saved. A static cache's length is a tensor and a compiled graph keeps no table:
    those compute the formula."""

    def __init__(self, d_model: int, table_size: int, config):
        super().__init__(d_model)
        self.table_size, self.config = table_size, config
        self.table = None  # (positions, d_model)

    def forward(self, past_length, length: int, device) -> torch.Tensor:
        if not enabled(self.config) or not isinstance(past_length, int) or torch.compiler.is_compiling():
            return super().forward(past_length, length, device)
        return sinusoid_rows(self, past_length, past_length + length, device)


def sinusoid_rows(module: SinusoidTable, start: int, end: int, device) -> torch.Tensor:
    table = module.table
    if table is None or table.size(0) < end or table.device != device:
        size = max(end, module.table_size if table is None else 2 * table.size(0))
        table = module.table = sinusoidal_encoding(torch.arange(size, device=device), module.d_model)
    return table[start:end]


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Cross-entropy against the smoothed target q = (1 - ε)·onehot(y) + ε/V (§5.4), with its gradient in
    closed form: ∂loss/∂logits = softmax(logits) - q.

    torch's cross-entropy keeps the log-probabilities for backward, where it fills a zero tensor of the
    logits' size and runs softmax's backward over both. Here the gradient is made in the forward pass
    from the log-probabilities it already holds, and backward only scales it: the same numbers with one
    (N, V) tensor fewer, and one log-softmax for both the smoothed loss and the NLL that training logs.
    """

    @staticmethod
    def forward(ctx, logits, labels, epsilon):
        log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # (N, V)
        ignored = labels == -100
        target = labels.masked_fill(ignored, 0).unsqueeze(1)  # (N, 1)
        nll = -log_probs.gather(1, target).squeeze(1).masked_fill(ignored, 0.0)  # (N,)
        loss = nll
        if epsilon:
            loss = (1.0 - epsilon) * nll - epsilon * log_probs.mean(dim=-1).masked_fill(ignored, 0.0)
        if ctx.needs_input_grad[0]:
            grad = log_probs.exp_()  # softmax, in place
            if epsilon:
                grad.sub_(epsilon / logits.size(-1))
            grad.scatter_add_(1, target, grad.new_full(target.shape, epsilon - 1.0))
            # Ignored tokens get no gradient: their rows are zeroed in backward's one pass.
            ctx.save_for_backward(grad.to(logits.dtype), (~ignored).unsqueeze(1).to(logits.dtype))
        nll = nll.sum()
        ctx.mark_non_differentiable(nll)
        return loss.sum(), nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        grad, kept = ctx.saved_tensors  # (N, V), (N, 1)
        return grad * (kept * grad_loss), None, None


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, epsilon: float = 0.0):
    """§5.4: the label-smoothed cross-entropy summed over the tokens whose label is not -100, and the plain
    negative log-likelihood summed over them (no gradient; perplexity is made from it). `logits` (..., V),
    `labels` (...). The same numbers as `F.cross_entropy(..., label_smoothing=epsilon, reduction="sum")`."""
    return _SmoothedCrossEntropy.apply(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), epsilon)


class ClosedFormCrossEntropy(LabelSmoothedCrossEntropy):
    """The model's loss (the mean over target tokens) from `smoothed_cross_entropy`."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, logits, labels, epsilon):
        if not enabled(self.config):
            return super().forward(logits, labels, epsilon)
        summed, _ = smoothed_cross_entropy(logits, labels, epsilon)
        return summed / (labels != -100).sum()


def install(model) -> None:
    """Replace the plain modules of `model` by their drop-ins (once; a replaced module is left alone)."""
    config = model.config
    drop_ins = {
        nn.Dropout: lambda plain: CPUDropout(plain.p, config),
        SinusoidalEncoding: lambda plain: SinusoidTable(plain.d_model, config.max_position_embeddings, config),
        LabelSmoothedCrossEntropy: lambda plain: ClosedFormCrossEntropy(config),
    }
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in drop_ins:
                setattr(parent, name, drop_ins[type(child)](child))


__all__ = [
    "CPUDropout",
    "ClosedFormCrossEntropy",
    "SinusoidTable",
    "enabled",
    "install",
    "smoothed_cross_entropy",
]
