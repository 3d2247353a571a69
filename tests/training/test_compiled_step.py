"""The compiled training step (`--torch-compile`, training/compute.py) against the eager one, on a CPU.

The step is compiled for two bucket shapes at most. inductor generates and builds C++ kernels for every graph, slow
on a CPU (benchmarks/results/), so one test compiles with it (one shape) and the others with aot_eager:
the same graphs, forward and backward captured by dynamo and AOTAutograd, run on torch's own kernels.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.training.arguments import TrainArguments
from vanilla_transformer.training.compute import BF16_WEIGHTS_VARIABLE, Bf16Weights, CompiledLoss, compile_timing
from vanilla_transformer.training.batches import IGNORE_INDEX, PadCollator
from vanilla_transformer.training import criterion
from vanilla_transformer.training.budget import Budget
from vanilla_transformer.training.run_state import RunState
from vanilla_transformer.training.schedule import make_optimizer, make_scheduler
from vanilla_transformer.training.setup import Components, prepare
from vanilla_transformer.training.step import next_rate, train_step

pytestmark = pytest.mark.slow

PAD = 0
SHAPES = [(4, 6), (2, 9)]  # (rows, length): the bucket shapes the batches are padded to
SHORT = [([5, 6, 7, 2], [8, 9, 2]), ([10, 11, 2], [12, 13, 14, 15, 2]), ([16, 17, 2], [21, 2])]
LONG = [([3, 4, 5, 6, 7, 8, 9, 2], [22, 23, 5, 2]), ([10, 2], [12, 13, 14, 15, 16, 17, 18, 2])]
THIRD = [([3, 4, 2], [5, 2])] * 9  # 9 rows: a shape of neither bucket


def batch(pairs, shapes=SHAPES) -> dict:
    return PadCollator(PAD, shapes)({"input_ids": [s for s, _ in pairs], "labels": [t for _, t in pairs]})


def tiny_model() -> VanillaTransformerForConditionalGeneration:
    """No dropout: a step is a function of the weights and the batch alone."""
    torch.manual_seed(0)
    config = VanillaTransformerConfig.from_preset(
        "tiny", vocab_size=24, d_model=32, d_ff=64, num_heads=2, encoder_layers=1, decoder_layers=1, dropout=0.0,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, label_smoothing=0.1)
    return VanillaTransformerForConditionalGeneration(config)


def train(batches, mixed_precision: str, compiled: CompiledLoss | None):
    """A step on each of `batches` as `train` takes it (the compiled step timed by `compile_timing`), on a new
    tiny model: each step's loss and NLL per target token, one after the other, and the final weights."""
    AcceleratorState._reset_state(reset_partial_state=True)  # one precision per process otherwise
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = tiny_model()
    optimizer = make_optimizer(model, accelerator.device)
    scheduler = make_scheduler(optimizer, model.config.d_model, 10)
    model, optimizer = prepare(accelerator, model, optimizer)
    components = Components(accelerator, model, optimizer, scheduler, Path("unused"), TrainArguments(output_dir="unused"),
                            compiled=compiled)
    state = RunState()
    budget = Budget(state=state)
    losses = []
    for b in batches:
        micro_batches = [(b, int((b["labels"] != IGNORE_INDEX).sum()))]
        with compile_timing(components.compiled, micro_batches, accelerator.device):
            done = train_step(components, micro_batches, state.step, budget)
        next_rate(components, done)
        state.count_step(1, done.tokens)
        losses.extend(components.losses.read(state.step))
    AcceleratorState._reset_state(reset_partial_state=True)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_alike(eager, compiled, rel: float) -> None:
    (eager_losses, eager_weights), (compiled_losses, compiled_weights) = eager, compiled
    assert compiled_losses == pytest.approx(eager_losses, rel=rel)
    for name, weight in eager_weights.items():
        if name.endswith("k_proj.bias"):  # its gradient is 0 but for rounding (softmax ignores a shift of a query's
            continue  # scores), which Adam, dividing by its size, makes steps of: not a difference between the two
        torch.testing.assert_close(compiled_weights[name], weight, rtol=rel, atol=rel, msg=name)


def test_the_step_compiled_by_inductor_trains_as_the_eager_one_in_fp32():
    # Proves: inductor's kernels for the forward, loss and backward of the model (fused attention projections,
    # the closed-form loss) give the eager step's losses and weights to fp32 rounding, step after step.
    batches = [batch(SHORT, SHAPES[:1])] * 3
    torch._dynamo.reset()
    compiled = CompiledLoss(shapes=1)
    assert_alike(train(batches, "no", None), train(batches, "no", compiled), rel=1e-5)
    assert compiled.seen == {(4, 6, 4, 6)} and compiled.seconds > 0


@pytest.mark.parametrize("bf16_weights", ["0", "1"], ids=["autocast", "bf16-weights"])
def test_the_compiled_step_trains_as_the_eager_one_in_bf16(monkeypatch, bf16_weights):
    # Proves: under bf16 autocast, and on compute.py's bf16 copies of the weights, the compiled forward and its
    # backward give the eager step's losses and weights within bf16's rounding, over both bucket shapes.
    monkeypatch.setenv(BF16_WEIGHTS_VARIABLE, bf16_weights)
    batches = [batch(SHORT), batch(LONG), batch(SHORT), batch(LONG)]
    torch._dynamo.reset()
    assert_alike(train(batches, "bf16", None), train(batches, "bf16", CompiledLoss(2, "aot_eager")), rel=1e-2)


def test_the_step_compiles_once_per_bucket_shape_and_never_falls_back_past_the_limit():
    # Proves: one graph per distinct batch shape seen, whatever the order and repeats of the batches; each shape's
    # first step is timed as its compile time; a shape past the limit is an error, not a silent eager step.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = CompiledLoss(2, "aot_eager")
    train([batch(SHORT), batch(LONG), batch(SHORT), batch(SHORT), batch(LONG)], "no", compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert compiled.seen == {(4, 6, 4, 6), (2, 9, 2, 9)} and compiled.seconds > 0
    assert compiled.record() == {"backend": "aot_eager", "mode": None, "shapes": 2,
                                 "compile_seconds": round(compiled.seconds, 2)}
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        train([batch(SHORT), batch(LONG), batch(THIRD, [*SHAPES, (9, 3)])], "no", CompiledLoss(2, "aot_eager"))


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "train", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("options, message", [
    (["--torch-compile", "--bucket-shapes", "0"], "error: `torch_compile` needs bucket shapes"),
    (["--torch-compile-mode", "fastest"], "error: argument --torch-compile-mode: invalid choice"),
    (["--torch-compile-backend", "tvm"], "error: argument --torch-compile-backend: invalid choice"),
    (["--torch-compile", "maybe"], "error: argument --torch-compile: expected true or false; got 'maybe'"),
])
def test_bad_compile_options_are_refused_in_one_line(tmp_path, options, message):
    out = tmp_path / "run"
    result = cli("--output-dir", str(out), *options)
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if "error" in line] == result.stderr.splitlines()[-1:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()  # refused before anything is written


@pytest.mark.parametrize("options, message", [
    (dict(torch_compile="yes"), r"`torch_compile` must be true or false or None; got 'yes'\."),
    (dict(torch_compile_mode="default", bucket_shapes=0), r"`torch_compile` needs bucket shapes: .*"),
    (dict(torch_compile=False, torch_compile_mode="reduce-overhead"), r".* leaves it eager: give one or the other\."),
    (dict(torch_compile_backend="aot_eager", torch_compile_mode="max-autotune"), r"`torch_compile_mode` is inductor's.*"),
])
def test_compile_options_that_contradict_are_refused(options, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        TrainArguments(output_dir="unused", **options).validate()


def test_train_with_torch_compile_from_the_command_line(tmp_path, small_task, small_run):
    # Proves: `train --torch-compile` trains end to end on a CPU over two bucket shapes, logs each shape's compile
    # time, records it in results.json, and the run's minutes (what --time-limit counts) include it.
    out = tmp_path / "run"
    result = cli("--output-dir", str(out), "--dataset", str(small_task), *small_run, "--max-steps", "4",
                 "--log-steps", "2", "--torch-compile", "--torch-compile-backend", "aot_eager", "--bucket-shapes", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled step: torch.compile (aot_eager) of the forward and loss" in result.stderr
    compiled_lines = [line for line in result.stderr.splitlines() if "compiled in" in line]
    assert len(compiled_lines) == 2 and "2 shape(s) so far" in compiled_lines[-1]
    results = json.loads((out / "results.json").read_text())
    record = results["compiled_step"]
    assert record["backend"] == "aot_eager" and record["shapes"] == 2 and record["compile_seconds"] > 0
    assert sum(part["seconds"] for part in results["parts"]) >= record["compile_seconds"]


@pytest.mark.parametrize("typed, parsed", [([], None), (["--torch-compile"], True), (["--torch-compile", "false"], False),
                                           (["--torch-compile", "true"], True)])
def test_torch_compile_is_left_to_the_run_unless_typed(typed, parsed):
    from vanilla_transformer import cli
    from vanilla_transformer.training.arguments import TrainArguments

    options = vars(cli.build_parser().parse_args(["train", "--output-dir", "x", *typed]))
    assert TrainArguments(**{k: v for k, v in options.items() if k not in ("command", "func")}).torch_compile is parsed


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("fast_paths", [True, False], ids=["fused-attention", "plain-attention"])
@pytest.mark.parametrize("bf16_weights", [False, True], ids=["autocast", "bf16-weights"])
def test_the_model_s_forward_and_loss_are_one_graph(attention, fast_paths, bf16_weights):
    # Proves: dynamo captures the whole forward and loss without a break, for the attention kernels and paths a
    # run may take (a break would leave the step partly eager and compile more graphs than there are shapes).
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset(
        "tiny", vocab_size=24, d_model=32, d_ff=64, num_heads=2, encoder_layers=1, decoder_layers=1,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, fast_paths=fast_paths)).train()
    model.set_attn_implementation(attention)
    torch._dynamo.reset()
    if bf16_weights:
        with Bf16Weights(model).swapped():
            explained = torch._dynamo.explain(criterion.batch_loss)(model, batch(LONG))
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            explained = torch._dynamo.explain(criterion.batch_loss)(model, batch(LONG))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_two_ddp_processes_train_the_compiled_step_as_the_eager_one(tmp_path, small_task, small_run):
    # Proves: under DDP (two CPU processes, gloo) the compiled step, a compiled function calling the DDP-wrapped model,
    # trains as the eager step does: the same logged losses; each shape compiles once (the main process's log).
    def launch(name, *extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}, "ACCELERATE_USE_CPU": "1",
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        result = subprocess.run(
            [sys.executable, "-m", "accelerate.commands.launch", "--mixed_precision", "no", "--dynamo_backend", "no",
             "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(port),
             "-m", "vanilla_transformer.cli", "train", "--output-dir", str(tmp_path / name), "--dataset", str(small_task),
             *small_run, "--max-steps", "4", "--log-steps", "1", "--bucket-shapes", "2", *extra],
            env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / name / "training_log.jsonl").read_text().splitlines()]
        return result.stderr, [(r["loss"], r["nll"]) for r in records if "split" not in r]

    _, eager = launch("eager")
    log, compiled = launch("compiled", "--torch-compile-backend", "aot_eager")
    assert len(eager) == 4 and compiled == [pytest.approx(losses, rel=1e-6) for losses in eager]
    assert "under MULTI_CPU" in log and len([line for line in log.splitlines() if "compiled in" in line]) == 2
