"""The GPU tests: mixed precision, padding in fp16, the fused attention kernels, fused Adam,
`generate` against the CPU's (equal, or equally scored where kernels break a near-tie), the synchronisations
of a training step, and the training command (bf16 by default, beam-search evaluation) on a CUDA device. `make test-gpu` runs them (with the compiled
static-cache test of tests/modeling/test_search.py); without CUDA they are skipped.

To exercise their logic where there is no GPU, point them at another device:

    VANILLA_TRANSFORMER_TEST_GPU_DEVICE=cpu python -m pytest tests/gpu/test_gpu.py

Every test then runs on that device, except the assertions that only hold on CUDA (the names of the
attention kernels), which skip with a reason. A CPU run proves the tests work, not that the GPU does.
"""

import copy
import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForSeq2SeqLM

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.corpora import load_translation_dataset
from vanilla_transformer.training.schedule import make_optimizer, make_scheduler

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package
from benchmarks.common import SDPA_KERNELS  # noqa: E402  (the profiler's op names of the attention kernels)

DEVICE = os.environ.get("VANILLA_TRANSFORMER_TEST_GPU_DEVICE", "cuda")
DEVICE_TYPE = torch.device(DEVICE).type
pytestmark = pytest.mark.skipif(
    DEVICE_TYPE == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (or VANILLA_TRANSFORMER_TEST_GPU_DEVICE=cpu to run the tests' logic on the CPU)",
)

VOCAB, PAD = 96, 0
# A source (S = 11) longer than the target (T = 7): the profiler tells the three attentions apart by shape.
SOURCE_LENGTH, TARGET_LENGTH = 11, 7


def make_model(**overrides):
    """The tiny preset with the base model's head size (Dh = 64, what the fused kernels are built for),
    no dropout (two runs see the same numbers) and the training script's label smoothing."""
    torch.manual_seed(0)
    config = VanillaTransformerConfig.from_preset("tiny", 
        vocab_size=VOCAB, d_model=128, num_heads=2, d_ff=256, dropout=0.0, label_smoothing=0.1, **overrides
    )
    return VanillaTransformerForConditionalGeneration(config).to(DEVICE).train()


def make_batch():
    """Four random pairs as training sees them: sources right-padded (mask 0), label padding -100."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (4, SOURCE_LENGTH), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = attention_mask[3, 9:] = 0
    input_ids[attention_mask == 0] = PAD
    labels = torch.randint(3, VOCAB, (4, TARGET_LENGTH), generator=g)
    labels[2, 4:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def on_device(batch):
    return {name: tensor.to(DEVICE) for name, tensor in batch.items()}


def autocast(dtype):
    return nullcontext() if dtype == torch.float32 else torch.autocast(DEVICE_TYPE, dtype=dtype)


def loss_and_gradient(model, batch, dtype):
    """One training step's forward and backward under autocast in `dtype`: the loss and every gradient,
    flat. fp16 scales the loss by 2**16 first, GradScaler's initial scale (what Accelerate's first fp16
    step does), so that small gradients do not underflow in fp16."""
    model.zero_grad(set_to_none=True)
    with autocast(dtype):
        loss = model(**batch).loss
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    (loss * scale).backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]) / scale


# Relative differences from fp32 allowed in bf16 and fp16. Most of the gradient's difference is not rounding
# but ReLU (§3.3): a unit whose input is near 0 is off in one precision and on in the other. The bounds leave
# several times the spread seen on the CPU (VANILLA_TRANSFORMER_TEST_GPU_DEVICE=cpu); a real fault (a mask
# lost, a gradient that under- or overflows) moves the gradient by its own size, the loss by whole percents.
TOLERANCES = {
    torch.bfloat16: dict(loss=2e-3, norm=2e-2, gradient=0.15),
    torch.float16: dict(loss=1e-3, norm=1e-2, gradient=0.05),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_mixed_precision_training_step_matches_fp32(dtype):
    # Proves: autocast in bf16/fp16 computes the same loss, gradient norm and gradient as fp32 on the same
    # batch and weights, to the precision of the type.
    model, batch = make_model(), on_device(make_batch())
    loss, gradient = loss_and_gradient(model, batch, torch.float32)
    mixed_loss, mixed_gradient = loss_and_gradient(model, batch, dtype)
    assert torch.isfinite(mixed_gradient).all()
    tolerance = TOLERANCES[dtype]
    assert abs(mixed_loss - loss) / loss < tolerance["loss"], (mixed_loss, loss)
    norm, mixed_norm = gradient.norm().item(), mixed_gradient.norm().item()
    assert abs(mixed_norm - norm) / norm < tolerance["norm"], (mixed_norm, norm)
    distance = ((mixed_gradient - gradient).norm() / gradient.norm()).item()
    assert distance < tolerance["gradient"], distance


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("precision", ["autocast", "half"])
def test_fully_padded_rows_stay_finite_in_fp16(attention, precision):
    # Proves: a source that is all padding (every key masked in its encoder self-attention and in the
    # cross-attention) and a decoder input that is all padding (every key masked in its self-attention)
    # give finite logits, loss and gradients in fp16, on the fused kernel and on the explicit path, in
    # autocast (mixed-precision training) and with fp16 weights (`model.half()`).
    model = make_model()
    model.config._attn_implementation = attention
    if precision == "half":
        model.half()
    batch = make_batch()
    batch["input_ids"][0], batch["attention_mask"][0] = PAD, 0
    batch["decoder_attention_mask"] = torch.ones_like(batch["labels"])
    batch["decoder_attention_mask"][1] = 0
    batch["labels"][1] = -100  # a target that is all padding has no loss
    with autocast(torch.float16) if precision == "autocast" else nullcontext():
        output = model(**on_device(batch))
    assert torch.isfinite(output.logits).all() and torch.isfinite(output.loss)
    output.loss.backward()
    for name, parameter in model.named_parameters():
        assert torch.isfinite(parameter.grad).all(), name


def test_causal_self_attention_runs_on_a_fused_kernel_in_bf16_training():
    # Proves: in a bf16 training forward and backward, the decoder's causal self-attention (the only
    # attention whose queries and keys are both the T target positions) ran a flash, memory-efficient or
    # cuDNN kernel, not the math fallback; read from the profiler's op names and input shapes, not assumed.
    model, batch = make_model(), on_device(make_batch())
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, autocast(torch.bfloat16):
        model(**batch).loss.backward()
    kernels = set()
    for event in prof.events():
        if event.name in SDPA_KERNELS and len(event.input_shapes) >= 2:
            query, key = event.input_shapes[:2]
            if query[-2:-1] == key[-2:-1] == [TARGET_LENGTH]:  # (B, H, T, Dh) against (B, H, T, Dh)
                kernels.add(SDPA_KERNELS[event.name])
    assert len(kernels) == 1, kernels  # found, and every layer's took the same kernel
    if DEVICE_TYPE != "cuda":
        pytest.skip(f"the kernel names are CUDA's; on {DEVICE} the causal self-attention ran {kernels}")
    assert "sdpa:math" not in kernels  # the fallback that materialises the T x T scores
    assert kernels <= {"sdpa:flash", "sdpa:efficient", "sdpa:cudnn"}, kernels


def test_training_attention_keeps_sdpa_off_cudnn_in_bf16_training():
    # Proves: under `training_sdpa_backends` (the training loop runs under it, its steps included), bf16 forward and backward
    # passes on batches of two shapes run sdpa on flash or memory-efficient kernels, never cuDNN's, whose plan for
    # each new shape costs milliseconds of host time per call (docs/design.md).
    from vanilla_transformer.training.compute import training_sdpa_backends

    model, kernels = make_model(), set()
    for batch in (make_batch(), {name: tensor[:, :-3] for name, tensor in make_batch().items()}):
        with (profile(activities=[ProfilerActivity.CPU]) as prof, autocast(torch.bfloat16),
              training_sdpa_backends(DEVICE)):
            model(**on_device(batch)).loss.backward()
        kernels |= {SDPA_KERNELS[event.name] for event in prof.events() if event.name in SDPA_KERNELS}
    if DEVICE_TYPE != "cuda":
        pytest.skip(f"cuDNN's attention is CUDA's; on {DEVICE} sdpa ran {kernels}")
    assert kernels and kernels <= {"sdpa:flash", "sdpa:efficient"}, kernels


def test_fused_adam_equals_the_plain_loop():
    # Proves: the optimiser training builds (make_optimizer: torch's fused Adam on CUDA and CPUs) updates
    # the weights as torch's reference for-loop Adam with the same settings, over a few steps of the
    # paper's warm-up schedule. Both get the same gradients each step (computed once, copied), so any
    # difference is the optimiser's arithmetic: fp32 rounding, ~1e-7 of an update of ~1e-2.
    fused_model, batch = make_model(), on_device(make_batch())
    plain_model, initial = copy.deepcopy(fused_model), copy.deepcopy(fused_model.state_dict())
    fused = make_optimizer(fused_model, DEVICE)
    assert fused.defaults["fused"]
    plain = torch.optim.Adam(plain_model.parameters(), **{**fused.defaults, "fused": False, "foreach": False})
    schedules = [make_scheduler(optimizer, fused_model.config.d_model, warmup_steps=4) for optimizer in (fused, plain)]
    for _ in range(5):
        fused.zero_grad(set_to_none=True)
        fused_model(**batch).loss.backward()
        for fused_parameter, plain_parameter in zip(fused_model.parameters(), plain_model.parameters()):
            plain_parameter.grad = fused_parameter.grad.clone()
        for optimizer, schedule in zip((fused, plain), schedules):
            optimizer.step()
            schedule.step()
    for (name, fused_parameter), plain_parameter in zip(fused_model.named_parameters(), plain_model.parameters()):
        assert not torch.equal(fused_parameter, initial[name]), name  # it did train
        torch.testing.assert_close(fused_parameter, plain_parameter, rtol=1e-5, atol=1e-6, msg=name)


SENTENCES = [
    "In the beginning God created the heavens and the earth.",
    "Jesus wept.",
    "And God said, Let there be light: and there was light.",
]


def sequence_scores(model, batch, sequences, length_penalty: float | None) -> torch.Tensor:
    """Each row's score under `model` (fp32, on the CPU): the summed log-probability of its tokens after the
    decoder start, up to and with its first </s>, divided by length ** length_penalty for beam search."""
    labels = sequences[:, 1:].clone()
    after_end = (labels == model.config.eos_token_id).long().cumsum(1) - (labels == model.config.eos_token_id).long()
    labels[after_end > 0] = -100
    with torch.no_grad():
        logits = model(**batch, decoder_input_ids=sequences[:, :-1]).logits.float()
    kept = labels != -100
    token_scores = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    scores = (token_scores * kept).sum(1)
    return scores if length_penalty is None else scores / kept.sum(1) ** length_penalty


@pytest.mark.parametrize("num_beams", [1, 4], ids=["greedy", "beam 4"])
def test_generate_on_the_device_gives_the_cpu_s_tokens_or_an_equally_scored_output(hub_tiny_model, num_beams):
    # Proves: greedy and beam search in fp32 on the device (its attention kernels, transformers' cache,
    # beam reordering) pick the tokens they pick on the CPU, with a trained model whose output is real; where
    # a row differs, the two outputs score the same under the CPU's model to 1e-4 (a near-tie that the
    # kernels' different rounding breaks the other way), not a wrong search.
    model, tokenizer = hub_tiny_model
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    options = dict(num_beams=num_beams, max_new_tokens=24)
    on_cpu = model.generate(**batch, **options)
    on_the_device = copy.deepcopy(model).to(DEVICE).generate(**on_device(batch), **options).cpu()
    assert on_cpu[:, 1:].unique().numel() > 5  # not an empty or one-token output
    if torch.equal(on_the_device, on_cpu):
        return
    length = max(on_cpu.size(1), on_the_device.size(1))
    padded = [torch.nn.functional.pad(s, (0, length - s.size(1)), value=model.config.pad_token_id)
              for s in (on_cpu, on_the_device)]
    penalty = None
    if num_beams > 1:  # transformers' default when the generation config leaves it unset
        penalty = 1.0 if model.generation_config.length_penalty is None else model.generation_config.length_penalty
    cpu_scores, device_scores = (sequence_scores(model, batch, s, penalty) for s in padded)
    torch.testing.assert_close(device_scores, cpu_scores, rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{m}\n{tokenizer.batch_decode([*on_the_device, *on_cpu])}")


def test_the_training_loop_adds_no_synchronisation_to_a_bare_step(hub_tiny_model):
    # Proves: the loop's bf16 step (batches prefetched into pinned memory, the step's one reduction, the loss
    # sums on the device, the non-finite guard skipped on the device) makes no CUDA synchronisation that a
    # bare forward, backward and fused Adam step of the same model does not make.
    if DEVICE_TYPE != "cuda":
        pytest.skip("torch.cuda.set_sync_debug_mode counts CUDA synchronisations")
    from benchmarks.gpu_smoke import synchronisations

    counts = synchronisations(hub_tiny_model[1], DEVICE, steps=5)
    assert counts["loop_step"] <= counts["bare_step"], counts


@pytest.mark.slow
def test_the_training_command_trains_in_bf16_saves_and_resumes(tmp_path):
    # Proves: `vanilla-transformer train` runs 50 steps on the device in bf16 (its default on a GPU) with the
    # validation loss falling and beam-search translations scored, leaves a folder that AutoModelForSeq2SeqLM loads whole (fp32 weights), and
    # `--resume` continues that run from its step-50 checkpoint to step 60.
    corpus = load_translation_dataset("bible-en-es")  # a slice of the embedded corpus: a quick tokenizer
    data = tmp_path / "bible"
    data.mkdir()
    for split, n in (("train", 3000), ("validation", 40), ("test", 8)):
        corpus[split].select(range(n)).to_json(data / f"{split}.jsonl", force_ascii=False)
    out = tmp_path / "model"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if DEVICE_TYPE == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # Accelerate would take a GPU that is there

    # No --mixed-precision: bf16 is the GPU's default (the CPU is told). Beam-search evaluation decodes in bf16.
    options = ["--dataset", str(data), "--output-dir", str(out), "--vocab-size", "1000", "--preset", "tiny",
               *(["--mixed-precision", "bf16"] if DEVICE_TYPE == "cpu" else []), "--max-tokens", "1024",
               "--warmup-steps", "30", "--lr-scale", "0.3", "--eval-steps", "10", "--eval-samples", "8",
               "--test-samples", "8", "--save-steps", "25", "--num-beams", "4",
               # The eager step: compiling 16 shapes outlasts the GPU session's budget for these tests; the compiled
               # step is benchmarks/gpu_smoke.py's compiled part (its losses against the eager step's).
               "--torch-compile", "false"]

    def train(*extra):
        command = [sys.executable, "-m", "vanilla_transformer.cli", "train", *options, *extra]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"mixed precision bf16, devices 1 x {DEVICE_TYPE}" in result.stderr, result.stderr[-3000:]
        results = json.loads((out / "results.json").read_text())
        return results, [(h["step"], h["loss"]) for h in results["history"] if h["split"] == "validation"]

    results, losses = train("--max-steps", "50")
    assert results["steps"] == 50
    assert results["validation"]["translated"] == 8 and results["test"]["translated"] == 8  # beam search, in bf16
    assert [step for step, _ in losses] == [10, 20, 30, 40, 50]  # every 10 steps; step 50's stands for the final weights
    assert losses[-1][1] < losses[0][1] - 0.2, losses
    model, info = AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True, output_loading_info=True)
    assert type(model).__name__ == "VanillaTransformerForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    results, losses = train("--max-steps", "60", "--resume")
    assert results["steps"] == 60
    # The history the step-50 checkpoint kept, then this session's evaluations: it went on, not anew.
    assert [step for step, _ in losses] == [10, 20, 30, 40, 50, 60], losses

