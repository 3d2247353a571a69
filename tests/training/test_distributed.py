"""Real `accelerate launch` runs on CPU processes: the launch guard, the start-of-run line, two processes against
one, a resumed run and two machines.

Each launch runs in its own process group, so that a hang takes its ranks down with it.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from vanilla_transformer.training.checkpoints import read_state

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--mixed_precision", "no", "--dynamo_backend", "no"]
TRAIN = ["-m", "vanilla_transformer.cli", "train"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def start(command, env, log: Path) -> subprocess.Popen:
    """Output to a file, not a pipe: two launches waited on one after the other must not block on a full pipe."""
    with open(log, "w") as out:
        launched = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
    launched.log = log
    return launched


def finish(launched: subprocess.Popen, timeout: int = 480) -> tuple[int, str]:
    try:
        launched.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launched.pid, signal.SIGKILL)
        launched.wait()
        raise AssertionError(f"timed out; its output ends:\n{launched.log.read_text()[-3000:]}") from None
    return launched.returncode, launched.log.read_text()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the mismatch needs a machine without GPUs")
def test_multi_gpu_launch_without_gpus_trains_together_or_is_refused_before_anything_is_written(tmp_path, small_task,
                                                                                                small_run):
    """`--multi_gpu` without ACCELERATE_USE_CPU=1 on a CPU machine: older Accelerate releases run DDP over the CPU
    processes, newer ones run each process alone. Either the two train as one run, or both stop at once with the
    fix before the output folder exists: never two runs racing on one folder."""
    output = tmp_path / "out"
    command = [*LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port",
               str(free_port()), *TRAIN, "--output-dir", str(output), "--dataset", str(small_task), *small_run,
               "--max-steps", "2"]
    code, stderr = finish(start(command, environment(), tmp_path / "launch.log"), timeout=240)
    if code == 0:
        assert "distributed: DDP (MULTI_CPU), world size 2" in stderr, stderr[-3000:]
        return
    assert "the launcher started 2 processes (WORLD_SIZE=2) but Accelerate runs 1" in stderr, stderr[-3000:]
    assert "set ACCELERATE_USE_CPU=1" in stderr
    assert not output.exists()  # no lock, no tokenizer, no checkpoints folder


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="FSDP runs where there are GPUs")
def test_fsdp_without_gpus_is_one_clear_error(tmp_path, small_task, small_run):
    """FSDP on a launch without GPUs is refused by the run before Accelerate starts (whatever Accelerate's own
    error for it says in the installed release), saying to use DDP instead."""
    output = tmp_path / "out"
    command = [*LAUNCH, "--use_fsdp", "--num_processes", "2", "--num_machines", "1", "--main_process_port",
               str(free_port()), *TRAIN, "--output-dir", str(output), "--dataset", str(small_task), *small_run,
               "--max-steps", "2"]
    code, stderr = finish(start(command, environment(ACCELERATE_USE_CPU="1"), tmp_path / "launch.log"), timeout=240)
    assert code != 0
    assert "FSDP was asked for" in stderr and "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu" in stderr, stderr[-3000:]
    assert not output.exists()


@pytest.mark.parametrize("use_cpu", ["1", ""])
def test_fsdp_is_refused_from_the_launch_settings_where_there_is_no_accelerator(monkeypatch, use_cpu):
    from vanilla_transformer.training.distributed import check_strategy_has_devices

    monkeypatch.setenv("ACCELERATE_USE_CPU", use_cpu)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # pins the premise on a GPU machine too
    with pytest.raises(ValueError, match="FSDP was asked for .* ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu"):
        check_strategy_has_devices("FSDP")
    check_strategy_has_devices(None)  # DDP or one process: nothing to refuse
    check_strategy_has_devices("DEEPSPEED")  # refused later, from what Accelerate starts (check_world_size)


def test_fsdp_is_let_through_where_there_is_an_accelerator(monkeypatch):
    from vanilla_transformer.training.distributed import check_strategy_has_devices

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    check_strategy_has_devices("FSDP")


def two_processes_command(output_dir: Path, args) -> list:
    """`accelerate launch` of two CPU processes on one machine (DDP over gloo) training into `output_dir`."""
    return [*LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port",
            str(free_port()), *TRAIN, "--output-dir", str(output_dir), *args]


def weights(checkpoint: Path) -> dict:
    return load_file(str(checkpoint / "model.safetensors"))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, write_synthetic_task, small_run_options):
    """Four steps of two processes on one machine, the run the tests below match in other ways: its folder, its
    options, its environment and its output."""
    root = tmp_path_factory.mktemp("ddp")
    data = write_synthetic_task(root / "data", n_train=300, n_eval=12, reverse=True)  # as `small_task`
    options = list(small_run_options)
    options[options.index("--config-overrides") + 1] += ",dropout=0"
    args = ["--dataset", str(data), *options, "--max-steps", "4", "--save-steps", "4", "--log-steps", "1"]
    env = environment(ACCELERATE_USE_CPU="1")
    code, output = finish(start(two_processes_command(root / "two", args), env, root / "two.log"))
    assert code == 0, output[-3000:]
    return SimpleNamespace(folder=root / "two", args=args, env=env, output=output)


SLOW_PREPARATION = """
import sys, time
from accelerate import PartialState
from vanilla_transformer import cli
from vanilla_transformer.training import task

learn = task.prepare_tokenizer


def slowly(*args, **kwargs):  # the main process prepares for {seconds} s while the others wait for it
    if PartialState().is_main_process:
        time.sleep({seconds})
    return learn(*args, **kwargs)


task.prepare_tokenizer = slowly
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_the_other_processes_wait_for_a_long_data_preparation_as_long_as_ddp_timeout_says(tmp_path, small_task, small_run):
    # Proves: `--ddp-timeout` is the process group's: while rank 0 prepares the data for 12 s (a WMT corpus: an
    # hour), rank 1 waits for it; a run whose timeout the preparation outlasts stops with gloo's timeout (as
    # NCCL's default of 10 minutes stopped a WMT run), one with a longer timeout completes.
    script = tmp_path / "slow_preparation.py"
    script.write_text(SLOW_PREPARATION.format(seconds=12))
    env = environment(ACCELERATE_USE_CPU="1")

    def launch(name, timeout):
        args = ["--dataset", str(small_task), *small_run, "--max-steps", "1", "--ddp-timeout", str(timeout)]
        command = [*LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port",
                   str(free_port()), str(script), "train", "--output-dir", str(tmp_path / name), *args]
        return start(command, env, tmp_path / f"{name}.log")

    short, long = launch("short", 4), launch("long", 120)
    code, output = finish(short)
    assert code != 0 and re.search(r"time[sd]? ?out", output, re.IGNORECASE), output[-3000:]  # gloo's words vary
    code, output = finish(long)
    assert code == 0, output[-3000:]
    assert json.loads((tmp_path / "long" / "results.json").read_text())["steps"] == 1



FULL_DISK_AT_THE_FIRST_SAVE = """
import sys
from vanilla_transformer import cli, staging
from vanilla_transformer.training import checkpoints


def publish_on_a_full_disk(folder, final):  # the main process's rename of the run's first checkpoint
    raise staging.DiskFull(f"could not write {final}: no space left on device")


checkpoints.publish_folder = publish_on_a_full_disk
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_save_that_fails_on_the_main_process_stops_every_process_at_once(tmp_path, small_task, small_run):
    # Proves: where the main process cannot publish a checkpoint, the other process stops by itself with one line
    # instead of waiting at the next barrier. (On one machine the launcher would end it once the main process
    # failed; on another machine nothing would, before `--ddp-timeout`.)
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_AT_THE_FIRST_SAVE)
    command = [*LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port",
               str(free_port()), str(script), "train", "--output-dir", str(tmp_path / "run"), "--dataset", str(small_task),
               *small_run, "--max-steps", "2", "--save-steps", "1", "--ddp-timeout", "600"]
    code, output = finish(start(command, environment(ACCELERATE_USE_CPU="1"), tmp_path / "run.log"), timeout=300)
    assert code != 0
    assert "train: error: could not write" in output and "no space left on device" in output, output[-3000:]
    assert "train: error: the main process could not save checkpoint-00000001; its error says why" in output, output[-3000:]
    assert "Traceback" not in output.split("no space left on device")[0], output[-3000:]

@pytest.mark.slow
def test_two_processes_match_one_process_with_the_same_global_batch_and_resume_to_it(two_processes, tmp_path):
    run, args, env = two_processes, two_processes.args, two_processes.env
    checksums = json.loads((run.folder / "results.json").read_text())["replica_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]  # both ranks hold the same weights

    # One process accumulating two batches sees exactly the batches the two processes saw together.
    # A fresh process as well, with the same environment: not this one, whose earlier tests may have
    # changed process-wide state (threads, CPU floating-point modes set by other libraries).
    one = subprocess.run([sys.executable, *TRAIN, "--output-dir", str(tmp_path / "one"), *args,
                          "--gradient-accumulation-steps", "2"], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    assert one.returncode == 0, one.stderr[-3000:]
    two_checkpoint, one_checkpoint = (folder / "checkpoints" / "checkpoint-00000004"
                                      for folder in (run.folder, tmp_path / "one"))
    two, one = weights(two_checkpoint), weights(one_checkpoint)
    # Each rank's loss is scaled by world/total_tokens, DDP averages: the gradient is the same sum
    # over the same tokens. Measured: bit-identical on CPU/gloo (max difference 0.0). The 1e-5
    # allows for an all-reduce that adds in another order (NCCL rings, more ranks): float32 rounding
    # over 4 Adam steps of size ~lr (~1e-2 here) stays orders of magnitude below it.
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=name)
    assert read_state(one_checkpoint)["train_tokens"] == read_state(two_checkpoint)["train_tokens"]

    # Under DDP as in one process: stopped after 2 steps and resumed by two processes, the same run.
    part = tmp_path / "part"
    for stage, extra in (("first", ["--max-steps", "2", "--save-steps", "2"]), ("resumed", ["--resume"])):
        code, output = finish(start(two_processes_command(part, [*args, *extra]), env, tmp_path / f"{stage}.log"))
        assert code == 0, output[-3000:]
    resumed = weights(part / "checkpoints" / "checkpoint-00000004")
    for name in two:
        assert torch.equal(resumed[name], two[name]), name
    assert read_state(part / "checkpoints" / "checkpoint-00000004")["train_tokens"] == read_state(
        two_checkpoint)["train_tokens"]


@pytest.mark.slow
def test_two_machines_on_loopback_match_one_machine_with_two_processes(two_processes, tmp_path):
    """Two `accelerate launch` commands, machine ranks 0 and 1 over 127.0.0.1 (gloo), one process each, train
    together: the same weights, tokens and losses as two processes on one machine. Each run says at the start
    what runs. (The machines share the output folder here, as real ones must: see the README.)"""
    one_machine = two_processes.output
    assert "distributed: DDP (MULTI_CPU), world size 2 (1 machine(s) x 2 process(es)), mixed precision no, " \
           "devices 2 x cpu" in one_machine, one_machine[-3000:]
    assert "process 1 (local 1): cpu" in one_machine

    port = free_port()
    machines = [
        start([*LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(rank),
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", "static",
               *TRAIN, "--output-dir", str(tmp_path / "two"), *two_processes.args], two_processes.env,
              tmp_path / f"machine{rank}.log")
        for rank in (0, 1)
    ]
    (code0, stderr0), (code1, stderr1) = [finish(m) for m in machines]
    assert code0 == 0 and code1 == 0, stderr0[-3000:] + stderr1[-3000:]
    assert "distributed: DDP (MULTI_CPU), world size 2 (2 machine(s) x 1 process(es))" in stderr0, stderr0[-3000:]
    assert "process 1 (local 0): cpu" in stderr1

    one, two = (folder / "checkpoints" / "checkpoint-00000004" for folder in (two_processes.folder, tmp_path / "two"))
    weights_one, weights_two = weights(one), weights(two)
    assert weights_one.keys() == weights_two.keys()
    for name in weights_one:  # measured: bit-identical (gloo sums two tensors in the same order either way)
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=0, atol=1e-6, msg=name)
    state_one, state_two = read_state(one), read_state(two)
    assert state_one["train_tokens"] == state_two["train_tokens"]
    results_one, results_two = (json.loads((folder / "results.json").read_text())
                                for folder in (two_processes.folder, tmp_path / "two"))
    assert results_one["replica_checksums"] == pytest.approx(results_two["replica_checksums"], rel=1e-9)
    assert results_one["validation_loss"] == pytest.approx(results_two["validation_loss"], rel=1e-6)


def deepspeed_accelerator(stage: int, world: int = 2, **config):
    """What `configure_deepspeed` reads of an Accelerator: Accelerate's own DeepSpeed plugin (it builds
    without DeepSpeed installed), as `accelerate launch --use_deepspeed --zero_stage N` makes it."""

    from accelerate import PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    PartialState()  # the one-process state, for Accelerate's logger
    plugin = DeepSpeedPlugin(zero_stage=stage)
    plugin.deepspeed_config.update(config)
    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=world,
                           state=SimpleNamespace(deepspeed_plugin=plugin))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_gets_one_token_batch_per_micro_step_and_our_clipping(stage):
    from vanilla_transformer.training.distributed import configure_deepspeed
    from vanilla_transformer.training.arguments import TrainArguments

    accelerator = deepspeed_accelerator(stage, world=8)
    configure_deepspeed(accelerator, TrainArguments(output_dir="unused", max_grad_norm=1.0))
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"], config["train_batch_size"],
            config["gradient_clipping"]) == (1, 1, 8, 1.0)
    assert config["zero_optimization"]["stage"] == stage

    accelerator = deepspeed_accelerator(stage)
    configure_deepspeed(accelerator, TrainArguments(output_dir="unused"))
    assert accelerator.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.0  # off, as without DeepSpeed


def test_deepspeed_settings_that_contradict_token_batches_are_refused():
    from vanilla_transformer.training.distributed import configure_deepspeed
    from vanilla_transformer.training.arguments import TrainArguments

    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=16.*must be 1 or 'auto'"):
        configure_deepspeed(deepspeed_accelerator(2, train_micro_batch_size_per_gpu=16), TrainArguments(output_dir="x"))
    with pytest.raises(ValueError, match="`gradient_accumulation_steps` 2 is not supported under DeepSpeed"):
        configure_deepspeed(deepspeed_accelerator(2), TrainArguments(output_dir="x", gradient_accumulation_steps=2))
    kept = deepspeed_accelerator(2, gradient_clipping=0.5)  # the user's own clipping stays
    configure_deepspeed(kept, TrainArguments(output_dir="x", max_grad_norm=1.0))
    assert kept.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.5


def test_deepspeed_launch_without_gpus_names_the_cause(monkeypatch):
    """Accelerate starts DeepSpeed's process group only on an accelerator: on a CPU machine each DeepSpeed
    process runs alone (seen with DeepSpeed 0.19.8, Accelerate 1.15). The refusal says so and names DDP."""
    from accelerate.utils import DistributedType

    from vanilla_transformer.training.distributed import check_world_size

    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.DEEPSPEED, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"2 DeepSpeed processes \(WORLD_SIZE=2\) but Accelerate runs each alone.*"
                                         r"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu"):
        check_world_size(alone)
    check_world_size(SimpleNamespace(num_processes=2, distributed_type=DistributedType.DEEPSPEED, device=torch.device("cpu")))


@pytest.mark.parametrize(
    "cuda, bf16, cpu_bf16, use_cpu, launcher, expected",
    [(True, True, False, False, None, "bf16"), (True, False, False, False, None, "fp16"),
     (False, False, False, False, None, None), (False, False, True, False, None, "bf16"),
     (True, True, False, True, None, None), (True, True, False, False, "no", None)],
    ids=["bf16 GPU", "older GPU", "CPU without bf16", "CPU with bf16", "CPU asked for", "the launcher says"],
)
def test_mixed_precision_defaults_to_bf16_where_the_hardware_has_it(
        monkeypatch, cuda, bf16, cpu_bf16, use_cpu, launcher, expected):
    # Proves: without --mixed-precision a run on a GPU trains in bf16 autocast (fp16, which Accelerate pairs
    # with a loss scaler, on a GPU without bf16), a CPU run in bf16 only where the CPU multiplies bf16 in
    # hardware (else fp32), and a launcher's own setting is kept. The CPU's flags are faked, not the machine's.
    from vanilla_transformer.training import compute
    from vanilla_transformer.training.distributed import default_mixed_precision

    monkeypatch.setenv("ACCELERATE_USE_CPU", "1") if use_cpu else monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    if launcher is not None:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setenv(compute.CPU_BF16_VARIABLE, "1" if cpu_bf16 else "0")  # the CPU's answer, faked
    assert default_mixed_precision() == expected
