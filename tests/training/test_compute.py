"""How a run computes on the machine (training/compute.py): bf16 only where the CPU computes it, and a one-process bf16
run on bf16 copies of the weights where that is faster; the attention implementation timed on the run's first batch,
with every candidate computing the same numbers. The compiled step is tested in test_compiled_step.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training import compute
from vanilla_transformer.training.compute import (
    attn_implementation_choice,
    cpu_computes_bf16,
    cpu_flags,
    fastest_attn_implementation,
)

from tiny_step import batch, loss, model

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma sha_ni\n"
ZEN5 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx512f amx_bf16 amx_tile amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


@pytest.mark.parametrize("cpuinfo, native", [(ZEN3, False), (ZEN5, True), (SAPPHIRE_RAPIDS, True), (GRAVITON3, True),
                                             (GRAVITON2, False), (None, False)],
                         ids=["AVX2 only", "AVX-512 BF16", "AMX", "Arm BF16", "Arm without", "unreadable"])
def test_bf16_is_chosen_only_where_the_cpu_multiplies_bf16_in_hardware(tmp_path, cpuinfo, native):
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    assert cpu_computes_bf16(cpu_flags(path)) is native


@pytest.mark.parametrize("value, native", [("1", True), ("0", False), (" 1 ", True)])
def test_the_environment_answers_for_the_cpu_so_the_suite_runs_either_way_on_any_machine(monkeypatch, value, native):
    # Proves: VANILLA_TRANSFORMER_CPU_BF16 overrides this CPU's flags (not flags passed in), and a value that is
    # neither 0 nor 1 is refused in one line naming the variable.
    monkeypatch.setenv(compute.CPU_BF16_VARIABLE, value)
    assert cpu_computes_bf16() is native
    assert cpu_computes_bf16(set()) is False and cpu_computes_bf16({"amx_bf16"}) is True
    monkeypatch.setenv(compute.CPU_BF16_VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"^VANILLA_TRANSFORMER_CPU_BF16 must be 0 or 1 \(or unset\); got 'yes'\.$"):
        cpu_computes_bf16()
    monkeypatch.delenv(compute.CPU_BF16_VARIABLE)
    assert cpu_computes_bf16() is bool(compute.BF16_CPU_FLAGS & cpu_flags())


def test_a_bf16_autocast_step_stays_close_to_fp32():
    # Proves: on a CPU with bf16 the run's loss is fp32's to bf16's rounding (the loss itself is computed in fp32).
    net = model(dropout=0.0).train()
    plain = loss(net, batch())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = loss(net, batch())
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, plain, rtol=2e-2, atol=0)


def bf16_step_components(monkeypatch, forced: str | None, **overrides):
    """The training loop's Components for a one-process bf16 run on the CPU, with bf16 weights as `forced` says."""
    from accelerate.state import AcceleratorState

    from vanilla_transformer.training.arguments import TrainArguments
    from vanilla_transformer.training.schedule import make_optimizer, make_scheduler
    from vanilla_transformer.training.setup import Components, prepare

    if forced is None:
        monkeypatch.delenv(compute.BF16_WEIGHTS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(compute.BF16_WEIGHTS_VARIABLE, forced)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    net = model(dropout=0.0, label_smoothing=0.1, **overrides)
    optimizer = make_optimizer(net, accelerator.device)
    net, optimizer = prepare(accelerator, net, optimizer)
    return Components(accelerator, net, optimizer, make_scheduler(optimizer, 32, 4000), Path("unused"),
                      TrainArguments(output_dir="unused"))


@pytest.mark.parametrize("forced, on", [(None, False), ("1", True), ("0", False)])
def test_bf16_weights_are_a_gpu_s_default_and_the_environment_decides_anywhere(monkeypatch, forced, on):
    components = bf16_step_components(monkeypatch, forced)
    assert (components.bf16_weights is not None) is on  # this is a CPU: off unless asked for
    monkeypatch.setenv(compute.BF16_WEIGHTS_VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"^VANILLA_TRANSFORMER_BF16_WEIGHTS must be 0 or 1 \(or unset\); got 'yes'\.$"):
        compute.bf16_weights(components.accelerator, components.model)


def test_bf16_weights_give_the_fp32_parameters_gradients_as_close_to_fp32_s_as_autocast_s(monkeypatch):
    # Proves: forward and backward run on bf16 copies (tied embeddings stay one), the model's own parameters stay
    # fp32 and receive the gradients, in fp32, two micro-batches summed; those gradients are as close to fp32's
    # as autocast's are (bf16's rounding, nothing more); the modules hold their own parameters again afterwards.
    from vanilla_transformer.training import criterion

    grads = {}
    for mode in ("fp32", "autocast", "bf16 weights"):
        components = bf16_step_components(monkeypatch, "1" if mode == "bf16 weights" else "0")
        net = components.model
        own = {name: p for name, p in net.named_parameters()}
        for _ in range(2):
            if components.bf16_weights is None:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                    loss_value, _ = criterion.batch_loss(net, batch())
                loss_value.backward()
                continue
            with components.bf16_weights.swapped():
                assert all(p.dtype == torch.bfloat16 for p in net.parameters())
                assert net.lm_head.weight is net.model.shared.weight
                loss_value, _ = criterion.batch_loss(net, batch())
                loss_value.backward()
        assert {name: p for name, p in net.named_parameters()} == own
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in own.values())
        grads[mode] = {name: p.grad for name, p in own.items()}
    for name, exact in grads["fp32"].items():
        scale = exact.abs().max()
        if scale < 1e-2:  # the keys' biases: no gradient but rounding (softmax ignores a shift of every score)
            continue
        autocast_error, copies_error = ((grads[mode][name] - exact).abs().max() / scale for mode in ("autocast", "bf16 weights"))
        assert copies_error <= 1.5 * autocast_error + 1e-2, (name, copies_error, autocast_error)


def test_a_step_on_bf16_weights_casts_a_handful_of_times_where_autocast_casts_at_every_use(monkeypatch):
    import sys

    from vanilla_transformer.training.budget import Budget
    from vanilla_transformer.training.run_state import RunState
    from vanilla_transformer.training.step import train_step

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not an installed package
    from benchmarks.kernels import count_kernels

    counts, losses = {}, {}
    for forced in ("0", "1"):
        components = bf16_step_components(monkeypatch, forced)
        b = batch()
        tokens = int((b["labels"] != -100).sum())
        state = RunState()
        train_step(components, [(b, tokens)], 0, Budget(state=state))  # Adam's state made
        counts[forced] = count_kernels(lambda: train_step(components, [(b, tokens)], 1, Budget(state=state)))
        losses[forced] = components.losses
    assert counts["1"].casts < counts["0"].casts / 4
    assert counts["1"]["aten._foreach_copy_"] == 2  # the copies refreshed, the gradients handed back
    assert counts["1"].total < counts["0"].total


@pytest.mark.slow
def test_a_run_on_bf16_weights_saves_fp32_weights_and_resumes_to_the_uninterrupted_run(tmp_path, small_task, small_run,
                                                                                    monkeypatch):
    # Proves, through the real command: with bf16 weights the checkpoints hold the fp32 weights Adam updates (not
    # the bf16 copies), a resumed run refreshes its copies from them and ends where an uninterrupted run ends, and
    # the copies are what ran (an autocast run ends elsewhere).
    from safetensors.torch import load_file

    from vanilla_transformer.cli import main
    from vanilla_transformer.training.checkpoints import latest_checkpoint

    small_run[small_run.index("--mixed-precision") + 1] = "bf16"

    def run(name, weights_variable, *extra):
        monkeypatch.setenv(compute.BF16_WEIGHTS_VARIABLE, weights_variable)
        out = tmp_path / name
        main(["train", "--dataset", str(small_task), "--output-dir", str(out), *small_run, "--save-steps", "2", *extra])
        return load_file(str(latest_checkpoint(out / "checkpoints") / "model.safetensors"))

    whole = run("whole", "1", "--max-steps", "4")
    run("part", "1", "--max-steps", "2")
    resumed = run("part", "1", "--max-steps", "4", "--resume")
    autocast = run("autocast", "0", "--max-steps", "4")
    assert whole.keys() == resumed.keys()
    for name, tensor in whole.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, resumed[name]), name
    assert any(not torch.equal(tensor, autocast[name]) for name, tensor in whole.items())

def clocked_loss(monkeypatch, seconds: dict):
    """A loss whose implementations take `seconds` each on the clock `fastest_attn_implementation` reads (no real
    timing)."""
    clock = [0.0]
    monkeypatch.setattr(compute.time, "perf_counter", lambda: clock[0])

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
    with compute.training_sdpa_backends(torch.device("cuda", 0)):
        assert state() == {"cudnn_sdp_enabled": False, "flash_sdp_enabled": True, "mem_efficient_sdp_enabled": True,
                           "math_sdp_enabled": True}
    assert state() == before
    with compute.training_sdpa_backends("cpu"):
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
