"""A run's precision (training/precision.py): bf16 only where the CPU computes it, and a one-process bf16 run on
bf16 copies of the weights where that is faster."""

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training import precision
from vanilla_transformer.training.precision import cpu_computes_bf16, cpu_flags

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
    monkeypatch.setenv(precision.CPU_BF16_VARIABLE, value)
    assert cpu_computes_bf16() is native
    assert cpu_computes_bf16(set()) is False and cpu_computes_bf16({"amx_bf16"}) is True
    monkeypatch.setenv(precision.CPU_BF16_VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"^VANILLA_TRANSFORMER_CPU_BF16 must be 0 or 1 \(or unset\); got 'yes'\.$"):
        cpu_computes_bf16()
    monkeypatch.delenv(precision.CPU_BF16_VARIABLE)
    assert cpu_computes_bf16() is bool(precision.BF16_CPU_FLAGS & cpu_flags())


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
        monkeypatch.delenv(precision.BF16_WEIGHTS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(precision.BF16_WEIGHTS_VARIABLE, forced)
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
    monkeypatch.setenv(precision.BF16_WEIGHTS_VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"^VANILLA_TRANSFORMER_BF16_WEIGHTS must be 0 or 1 \(or unset\); got 'yes'\.$"):
        precision.bf16_weights(components.accelerator, components.model)


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
        monkeypatch.setenv(precision.BF16_WEIGHTS_VARIABLE, weights_variable)
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
