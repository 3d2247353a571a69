"""The benchmark's MFU: the FLOPs it counts per training step, and the rated peaks it divides by; the matmul
rate it measures on the step's own products."""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not an installed package
from benchmarks.mfu import model_matmul_rate, rated_peak_tflops, step_products, training_flops  # noqa: E402


def test_training_flops_are_torchs_count_of_a_forward_and_backward_with_attention():
    # Proves: the count from shapes (weights and attention's two products in the three attentions, forward
    # and backward) is the number torch's FLOP counter finds in a real step on the explicit attention path,
    # where the products are visible (the fused kernel hides them from the counter on a CPU).
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=500, pad_token_id=0, bos_token_id=1,
                                                  eos_token_id=2, dropout=0.0, encoder_layers=2, decoder_layers=3)
    model = VanillaTransformerForConditionalGeneration(config)
    model.config._attn_implementation = "eager"
    batch = {"input_ids": torch.randint(3, 500, (4, 13)), "attention_mask": torch.ones(4, 13, dtype=torch.long),
             "labels": torch.randint(3, 500, (4, 9))}
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    counts = counter.get_flop_counts()["Global"]
    assert torch.ops.aten.bmm in counts  # attention was counted by torch too
    assert training_flops(config, batch) == counter.get_total_flops()
    # The products whose rate the benchmark measures are the step's weight products, each as often as torch counts
    # it: forward and the two gradient products, so 3 × 2 FLOPs per multiply-add.
    products = step_products(config, batch)
    weight_flops = sum(6 * count * tokens * inputs * outputs for count, tokens, inputs, outputs in products)
    assert weight_flops == counts[torch.ops.aten.mm] + counts.get(torch.ops.aten.addmm, 0)


def test_matmul_rate_is_measured_in_the_precision_asked():
    # Proves: the rate comes back as FLOP/s (finite, positive) in fp32 and bf16, and the output projection's product
    # is among those timed when the batch has target tokens.
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=300, pad_token_id=0, bos_token_id=1,
                                                  eos_token_id=2)
    batch = {"attention_mask": torch.ones(2, 7, dtype=torch.long), "labels": torch.full((2, 5), 4)}
    products = step_products(config, batch)
    assert (1, 10, config.d_model, 300) in products
    for dtype in (torch.float32, torch.bfloat16):
        assert 1e6 < model_matmul_rate(products, "cpu", dtype, repeats=2) < 1e15


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H200", "tf32", 494.7),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA L4", "fp32", 30.3), ("NVIDIA L40S", "bf16", 362.1),
    ("NVIDIA A10", "bf16", 125.0), ("Tesla V100-SXM2-16GB", "bf16", None), ("Some Future GPU", "bf16", None),
])
def test_rated_peaks_are_found_by_the_name_torch_reports(name, precision, peak):
    assert rated_peak_tflops(name, precision) == peak
