"""The attention implementation a run trains on (training/attention_implementation.py): timed on the run's
first batch, with every candidate computing the same numbers."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training import attention_implementation
from vanilla_transformer.training.attention_implementation import (
    attn_implementation_choice,
    fastest_attn_implementation,
)

from tiny_step import batch, loss, model


def clocked_loss(monkeypatch, seconds: dict):
    """A loss whose implementations take `seconds` each on the clock `fastest_attn_implementation` reads (no real
    timing)."""
    clock = [0.0]
    monkeypatch.setattr(attention_implementation.time, "perf_counter", lambda: clock[0])

    def timed_loss(m, b):
        clock[0] += seconds[m.config._attn_implementation]
        return loss(m, b)

    return timed_loss


@pytest.mark.parametrize("slow", ["sdpa", "eager"])
def test_the_attention_that_runs_the_first_batch_fastest_is_kept_and_the_run_goes_on_untouched(slow, monkeypatch):
    net = model().train()
    first = batch()
    timed_loss = clocked_loss(monkeypatch, {"sdpa": 0.1, "eager": 0.1, slow: 0.2})
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    seconds = fastest_attn_implementation(Accelerator(cpu=True), net, first, timed_loss)
    assert seconds == pytest.approx({"sdpa": 0.1, "eager": 0.1, slow: 0.2})
    assert net.config._attn_implementation != slow
    assert all(p.grad is None for p in net.parameters())  # nothing left for the first step to add to
    assert torch.equal(torch.rand(3), expected_draw)  # dropout's masks as if the timing had not run


def test_a_near_tie_keeps_the_configured_attention(monkeypatch):
    # Proves: a difference within the first batch's noise changes nothing (sdpa, the default, a little slower here).
    net = model().train()
    timed_loss = clocked_loss(monkeypatch, {"sdpa": 0.102, "eager": 0.1})
    seconds = fastest_attn_implementation(Accelerator(cpu=True), net, batch(), timed_loss)
    assert seconds["sdpa"] > seconds["eager"] and net.config._attn_implementation == "sdpa"


def test_the_words_for_the_attention_kept_agree_with_its_timings(monkeypatch):
    """The line names the attention kept and why: one faster by less than 5% is not called the fastest."""
    for seconds, words in (({"sdpa": 1.527, "eager": 1.495}, "attention: sdpa, kept: eager was faster on the first "
                            "batch, forward and backward, but by less than 5% (sdpa 1527 ms, eager 1495 ms)"),
                           ({"sdpa": 1.527, "eager": 1.2}, "attention: eager, the fastest here on the first batch, "
                            "forward and backward (sdpa 1527 ms, eager 1200 ms)")):
        net = model().train()
        timed = fastest_attn_implementation(Accelerator(cpu=True), net, batch(), clocked_loss(monkeypatch, seconds))
        assert attn_implementation_choice(net.config._attn_implementation, timed) == words


@pytest.mark.parametrize("allowed, runs, chosen", [(3.0, 1, "sdpa"), (4.0, 4, "eager"), (None, 6, "eager")],
                         ids=["not even a round", "two rounds", "no allowance"])
def test_the_timing_stops_before_it_would_pass_its_allowance(monkeypatch, allowed, runs, chosen):
    """sdpa takes 1 s a run, eager 0.5 s: each run is followed only where the runs to the next deciding round's end
    fit; stopped before a round past the warm-up, the configured implementation stays and nothing is returned."""
    net = model().train()
    calls, asked = [], []
    clocked = clocked_loss(monkeypatch, {"sdpa": 1.0, "eager": 0.5})

    def counted(m, b):
        calls.append(m.config._attn_implementation)
        return clocked(m, b)

    def allowance(per_run):
        asked.append(per_run)
        return allowed

    seconds = fastest_attn_implementation(Accelerator(cpu=True), net, batch(), counted,
                                          allowance=None if allowed is None else allowance)
    assert len(calls) == runs and net.config._attn_implementation == chosen
    assert seconds == ({} if runs < 4 else pytest.approx({"sdpa": 1.0, "eager": 0.5}))
    assert set(asked) <= {1.0}  # the slowest implementation's fastest run so far
    assert all(p.grad is None for p in net.parameters())


def test_a_model_with_one_attention_implementation_is_left_on_it():
    net = model(attention_score="general")  # explicit variants run eager only
    assert fastest_attn_implementation(Accelerator(cpu=True), net, batch(), loss) == {}
    assert net.config._attn_implementation == "eager"


def attention_loss_and_gradient(implementation: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the flattened gradient of one step of the same model on `implementation`, in `dtype` autocast."""
    net = model(dropout=0.0).train()
    net.set_attn_implementation(implementation)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        value = loss(net, batch())
    value.backward()
    return value.detach().float(), torch.cat([p.grad.flatten() for p in net.parameters()])


# bf16 keeps 8 bits of mantissa: through a step's backward the gradient moves by a few % of its norm, more where
# the CPU emulates bf16 than where it computes it in hardware; a wrong attention moves it by far more.
BF16_GRADIENT_TOLERANCE = 6e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_candidates_train_to_the_same_loss_and_gradients_in_fp32_and_in_bf16_autocast(dtype):
    # Proves: choosing the faster attention changes no number beyond the precision's rounding, forward and backward:
    # in fp32 the candidates agree to float rounding, in bf16 each stays within bf16's rounding of the fp32 step.
    loss_fp32, grad_fp32 = attention_loss_and_gradient("eager", torch.float32)
    for implementation in ("eager", "sdpa"):
        value, gradient = attention_loss_and_gradient(implementation, dtype)
        tolerance = 1e-5 if dtype == torch.float32 else BF16_GRADIENT_TOLERANCE
        torch.testing.assert_close(value, loss_fp32, rtol=tolerance if dtype == torch.float32 else 2e-2, atol=1e-5)
        assert (gradient - grad_fp32).norm() <= tolerance * grad_fp32.norm(), implementation


def test_a_training_run_on_a_gpu_keeps_sdpa_off_cudnn_and_a_cpu_run_is_left_alone():
    # Proves: training_sdpa_backends turns torch's cuDNN attention off (flash, memory-efficient and math stay on) while it
    # lasts on a CUDA device, and puts torch's switches back as they were; on a CPU it changes none. torch's switches
    # can be set without a GPU, so this runs anywhere; tests/gpu/test_gpu.py reads the kernels a GPU step then runs.
    switches = ("cudnn_sdp_enabled", "flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled")

    def state():
        return {name: getattr(torch.backends.cuda, name)() for name in switches}

    before = state()
    assert before["cudnn_sdp_enabled"]  # torch's default: the premise
    with attention_implementation.training_sdpa_backends(torch.device("cuda", 0)):
        assert state() == {"cudnn_sdp_enabled": False, "flash_sdp_enabled": True, "mem_efficient_sdp_enabled": True,
                           "math_sdp_enabled": True}
    assert state() == before
    with attention_implementation.training_sdpa_backends("cpu"):
        assert state() == before


SLOW_LOSS = """
import atexit, sys, time
import torch
from vanilla_transformer.training import criterion

real, runs = criterion.batch_loss, []

def batch_loss(model, batch):  # each forward and backward half a second slower, and counted
    if torch.is_grad_enabled():
        runs.append(model.config._attn_implementation)
        time.sleep(0.5)
    return real(model, batch)

criterion.batch_loss = batch_loss
atexit.register(lambda: print(f"forward and backward: {len(runs)}"))
from vanilla_transformer.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_tiny_run_with_a_time_limit_spends_a_small_share_of_it_choosing_the_attention(tmp_path, small_task, small_run):
    """Timing the kernels costs at most 3% of the time limit: when the first run shows that the rest would pass
    it, sdpa stays, untimed, and the line says so."""
    asked = small_run.index("--attn-implementation")
    del small_run[asked:asked + 2]  # the run chooses
    argv = ["train", "--dataset", str(small_task), "--output-dir", str(tmp_path / "run"), *small_run, "--time-limit", "0.5"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run([sys.executable, "-c", SLOW_LOSS, *argv], env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    steps = int(re.search(r"time limit of 0.5 min reached at step (\d+)", out).group(1))
    runs = int(re.search(r"forward and backward: (\d+)", out).group(1))
    assert runs - steps == 1  # the timing's: one, where there were 6
    assert re.search(r"attention: sdpa, not timed: 1 forward and backward took \d+\.\d s, and the timing may take 3% "
                     r"of what is left of the run", out)
