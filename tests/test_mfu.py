"""The benchmark's MFU (issue #47): the FLOPs it counts per training step, and the rated peaks it divides by."""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not an installed package
from benchmarks.mfu import rated_peak_tflops, training_flops  # noqa: E402


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


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H200", "tf32", 494.7),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA L4", "fp32", 30.3), ("NVIDIA L40S", "bf16", 362.1),
    ("NVIDIA A10", "bf16", 125.0), ("Tesla V100-SXM2-16GB", "bf16", None), ("Some Future GPU", "bf16", None),
])
def test_rated_peaks_are_found_by_the_name_torch_reports(name, precision, peak):
    assert rated_peak_tflops(name, precision) == peak
