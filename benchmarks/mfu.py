"""Model FLOPs utilisation (MFU): the FLOPs a training step needs, counted from the model's shapes and the
batch, per second, over the GPU's rated peak; the measured matrix-multiply rate goes beside it.

`training_flops` counts multiply-adds (2 FLOPs each) forward and twice as many backward (3 × forward),
for every real (non-padding) token: each weight matrix once per token it acts on (the encoder's on source
tokens; the decoder's on target tokens, but for the cross-attention's key and value projections, which act
on source tokens), the output projection on target tokens, and attention's two products (QKᵀ and the
weighted sum of V: queries × keys × d_model multiply-adds each, per layer: source² in the encoder,
target² in the decoder's self-attention, counted whole although causal, as PaLM's MFU counts it, and
target × source in the cross-attention). Embedding lookups, softmax, normalisation and the optimiser are
not counted (a few percent at the base model's size).

`model_matmul_rate` measures the rate the device reaches on the step's own dense products (every weight
matrix's forward product and its two gradient products, the output projection's included), in the step's
precision: the rate a step made only of matrix products would run at, against which its share is read.
"""

from __future__ import annotations

import re
import statistics

import torch

__all__ = ["RATED_PEAK_TFLOPS", "matmul_tflops", "mfu", "model_matmul_rate", "rated_peak_tflops", "step_products",
           "training_flops"]

# Dense (no sparsity) peaks in TFLOP/s from NVIDIA's data sheets, by device name as torch reports it:
# bf16 tensor cores, TF32 tensor cores (fp32 matmuls with TF32 on), plain fp32. More specific names first.
RATED_PEAK_TFLOPS = [
    (r"H200 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM ("H100 80GB HBM3")
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"RTX A6000", {"bf16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    (r"RTX 4090", {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"V100", {"fp32": 15.7}),  # no bf16
    (r"\bT4\b", {"fp32": 8.1}),
]


def rated_peak_tflops(device_name: str, precision: str) -> float | None:
    """The rated dense peak of `device_name` in `precision` ("bf16", "tf32", "fp32"), or None when not listed."""
    for pattern, peaks in RATED_PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks.get(precision)
    return None


def training_flops(config, batch: dict) -> float:
    """FLOPs of one training step (forward and backward) of `config`'s model on `batch` (input_ids' attention
    mask, labels with -100 at padding), as the module docstring counts them."""
    source = batch["attention_mask"].sum(1).double().cpu()
    target = (batch["labels"] != -100).sum(1).double().cpu()
    d, d_ff = config.d_model, config.d_ff
    weights = (
        config.encoder_layers * (4 * d * d + 2 * d * d_ff) * source.sum()
        + config.decoder_layers * ((6 * d * d + 2 * d * d_ff) * target.sum() + 2 * d * d * source.sum())
        + config.vocab_size * d * target.sum()
    )
    attention = d * (
        config.encoder_layers * 2 * (source**2).sum()
        + config.decoder_layers * 2 * ((target**2).sum() + (source * target).sum())
    )
    return float(6 * (weights + attention))


def step_products(config, batch: dict) -> list[tuple[int, int, int, int]]:
    """The dense products of one forward pass of `config`'s model on `batch`, as (times per step, tokens, inputs,
    outputs) per shape of weight: tokens × inputs @ inputs × outputs, counted on real tokens as `training_flops`."""
    source = int(batch["attention_mask"].sum())
    target = int((batch["labels"] != -100).sum())
    d, d_ff = config.d_model, config.d_ff
    encoder, decoder = config.encoder_layers, config.decoder_layers
    products = [
        (4 * encoder + 2 * decoder, source, d, d),  # the encoder's attention, the cross-attention's keys and values
        (encoder, source, d, d_ff),
        (encoder, source, d_ff, d),
        (6 * decoder, target, d, d),  # the decoder's self-attention, the cross-attention's queries and output
        (decoder, target, d, d_ff),
        (decoder, target, d_ff, d),
        (1, target, d, config.vocab_size),  # the output projection
    ]
    return [product for product in products if product[0] and product[1]]


def model_matmul_rate(products, device: str, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of `products` (from `step_products`) in `dtype` on `device`, forward and backward: each shape's
    forward product (as nn.Linear computes it) and its gradients for the input and the weight, timed, the
    median of `repeats` runs; the total FLOPs of the step's products over their total time, each shape counted as
    often as the step runs it (so weighted by its FLOPs)."""
    from .common import Timer

    flops = seconds = 0.0
    for count, tokens, inputs, outputs in products:
        x = torch.randn(tokens, inputs, device=device, dtype=dtype)
        weight = torch.randn(outputs, inputs, device=device, dtype=dtype)
        grad = torch.randn(tokens, outputs, device=device, dtype=dtype)
        times = []
        for _ in range(repeats + 1):  # the first warms up
            with Timer(device) as timer:
                torch.nn.functional.linear(x, weight)
                grad @ weight
                grad.t() @ x
            times.append(timer.seconds)
        flops += count * 3 * 2 * tokens * inputs * outputs
        seconds += count * statistics.median(times[1:])
    return flops / seconds


def mfu(flops_per_second: float, peak_tflops: float | None) -> float | None:
    return None if not peak_tflops else flops_per_second / (peak_tflops * 1e12)


def matmul_tflops(device: str, dtype: torch.dtype = torch.bfloat16, n: int = 8192, repeats: int = 20) -> float:
    """The matrix-multiply rate this GPU reaches on n × n products in `dtype` (fp32: TF32 where it is on)."""
    from .common import Timer

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    with Timer(device) as timer:
        for _ in range(repeats):
            a @ b
    return 2 * n**3 * repeats / timer.seconds / 1e12
