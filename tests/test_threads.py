"""Threads chosen for the machine (threads.py): --threads on every command that computes, a default from the
CPUs this process may use (its affinity, its cgroup's CPU quota), and a line naming the number."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from vanilla_transformer.cli import main
from vanilla_transformer import threads
from vanilla_transformer.threads import CpuClock, load_average, oversubscription, quota_cpus

GREEDY = ["--num-beams", "1", "--max-new-tokens", "8"]
CPUS = os.cpu_count()  # the most threads a command takes


def _evaluate(folder, *options, cpus=None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}  # the machine's default
    return subprocess.run(
        [sys.executable, "-m", "vanilla_transformer.cli", "evaluate", "--model", str(folder), *GREEDY, *options,
         "--max-samples", "2"], capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )


@pytest.mark.slow
def test_the_default_is_the_cpus_this_process_may_use_and_the_timing_names_it(hub_tiny_folder):
    """The default is the CPUs this process may use, not the machine's cores, and the timing line names it.
    Standard error stays for errors alone."""
    pinned = _evaluate(hub_tiny_folder, cpus={min(os.sched_getaffinity(0))})  # as `taskset -c N` runs it
    assert pinned.returncode == 0, pinned.stderr
    assert "segments translated in" in pinned.stdout and "s on 1 CPU thread (transformers)" in pinned.stdout
    given = _evaluate(hub_tiny_folder, "--threads", str(CPUS))
    threads = f"{CPUS} CPU thread{'s' * (CPUS > 1)}"
    assert given.returncode == 0 and f"s on {threads} (transformers)" in given.stdout
    assert "threads:" not in pinned.stderr + given.stderr


@pytest.mark.parametrize("command", [
    ["translate", "--model", "{folder}", "x"], ["evaluate", "--model", "{folder}", "--max-samples", "1"],
    ["attention", "--model", "{folder}", "x"], ["export", "--model", "{folder}", "--format", "ctranslate2",
                                                "--output-dir", "{folder}-ct2"],
    ["serve", "--model", "{folder}"], ["quickstart", "--output-dir", "{folder}-quick", "--preset", "tiny"],
    ["train", "--output-dir", "{folder}-run"],
])
def test_every_command_that_computes_refuses_a_thread_count_below_one_in_one_line(command, tmp_path, capsys):
    argv = [arg.format(folder=tmp_path / "model") for arg in command]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--threads", "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"--threads must be a positive integer up to {CPUS} (this machine's CPUs); got 0")


def test_the_cgroup_quota_bounds_the_default(tmp_path):
    root = tmp_path / "cgroup"
    (root / "jobs" / "one").mkdir(parents=True)
    own = tmp_path / "self-cgroup"
    own.write_text("0::/jobs/one\n")
    assert quota_cpus(root, own) is None  # no cpu.max anywhere: no quota
    (root / "jobs" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2 threads
    (root / "jobs" / "one" / "cpu.max").write_text("max 100000\n")
    assert quota_cpus(root, own) == 2
    (root / "jobs" / "one" / "cpu.max").write_text("50000 100000\n")  # the tightest level counts
    assert quota_cpus(root, own) == 1
    own.write_text("12:cpu:/jobs/one\n")  # cgroup v1 only
    assert quota_cpus(root, own) is None


def test_train_sets_the_threads_and_logs_them(tmp_path, caplog):
    rows = [{"translation": {"src": f"a b {i % 7}", "tgt": f"{i % 7} b a"}} for i in range(60)]
    (tmp_path / "data").mkdir()
    for split in ("train", "validation"):
        (tmp_path / "data" / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO):
            main(["train", "--dataset", str(tmp_path / "data"), "--output-dir", str(tmp_path / "run"), "--vocab-size",
                  "300", "--config-overrides", "d_model=32,d_ff=64,num_heads=2,encoder_layers=1,decoder_layers=1",
                  "--max-steps", "1", "--warmup-steps", "2", "--eval-samples", "0", "--mixed-precision", "no",
                  "--attn-implementation", "eager", "--threads", "2"])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert "threads: 2 (--threads; --threads N to change)" in caplog.text


def test_an_oversubscribed_machine_gets_one_line_that_suggests_fewer_threads():
    """The premises: the load average over the CPUs this process may use, or a first step computed on less than half
    a CPU. The suggestion leaves the CPUs the other jobs hold, and never goes below one thread."""
    assert oversubscription(2, 1.8, load=1.5, cpus=2) is None  # busy, and nobody else waiting
    assert oversubscription(2, 1.8, load=2.0, cpus=2) is None  # the load of this run alone
    assert oversubscription(2, 1.8, load=6.0, cpus=2) == (
        "threads: the machine looks oversubscribed (load average 6.0 on the 2 CPU(s) this process may use): "
        "fewer threads may train faster: try --threads 1")
    assert oversubscription(16, 3.0, load=20.0, cpus=16).endswith("try --threads 12")  # 4 CPUs' worth of others
    assert oversubscription(2, 0.3, load=None, cpus=2) == (
        "threads: the machine looks oversubscribed (its first step computed on 0.3 CPU(s) with 2 thread(s)): "
        "fewer threads may train faster: try --threads 1")
    both = oversubscription(4, 0.4, load=9.0, cpus=4)
    assert "load average 9.0 on the 4 CPU(s)" in both and "0.4 CPU(s) with 4 thread(s)" in both
    one = oversubscription(1, 0.2, load=3.0, cpus=2)
    assert "--threads N" in one and "try --threads" not in one  # one thread already: nothing fewer to suggest


def test_the_load_average_and_the_cpu_clock_read_the_machine(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    assert load_average() == 3.5
    monkeypatch.setattr(os, "getloadavg", lambda: (_ for _ in ()).throw(OSError("no load average here")))
    assert load_average() is None
    clock = CpuClock()
    deadline = threads.time.perf_counter() + 0.2
    while threads.time.perf_counter() < deadline:  # busy: about one CPU, less on a shared machine
        pass
    assert 0 < clock.cpus() <= 1.2


def _translate(folder, *options, env=()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "translate", "--model", str(folder), *GREEDY,
                           *options, "a b c"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **dict(env)})


@pytest.mark.slow
@pytest.mark.parametrize("options, env, message", [
    (["--threads", "100000"], {}, "--threads must be a positive integer up to {cpus} (this machine's CPUs); got 100000"),
    ([], {"OMP_NUM_THREADS": "100000"},
     "the environment variable OMP_NUM_THREADS must be a positive whole number of at most {cpus}; got '100000'"),
    ([], {"OMP_NUM_THREADS": "abc"},
     "the environment variable OMP_NUM_THREADS must be a positive whole number of at most {cpus}; got 'abc'"),
    ([], {"LOCAL_WORLD_SIZE": "abc"}, "the environment variable LOCAL_WORLD_SIZE must be a positive whole number; got 'abc'"),
])
def test_threads_beyond_the_machines_cpus_and_bad_variables_are_one_line_naming_them(hub_tiny_folder, options, env,
                                                                                    message):
    """Threads past the machine's CPUs would fail to start and kill the process; a variable that is not a number
    is named, never an int() error naming nothing, never ignored."""
    result = _translate(hub_tiny_folder, *options, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr  # libgomp may say a line of its own before ours
    assert result.stderr.strip().splitlines()[-1] == f"vanilla-transformer translate: error: {message.format(cpus=CPUS)}"


@pytest.mark.slow
@pytest.mark.parametrize("option, value, message", [
    ("--threads", "100000", f"--threads must be a positive integer up to {CPUS} (this machine's CPUs); got 100000"),
    ("--seed", "-1", "--seed must be an integer in [0, 2**32); got -1"),
    ("--seed", str(2**32), f"--seed must be an integer in [0, 2**32); got {2**32}"),
])
def test_train_refuses_threads_and_seeds_out_of_bounds_before_it_sets_up(tmp_path, option, value, message):
    """An option out of bounds is refused before anything is written: before the folder is taken and the data
    read."""
    result = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "train", "--output-dir",
                             str(tmp_path / "run"), "--max-steps", "1", option, value], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"vanilla-transformer train: error: {message}"]
    assert not (tmp_path / "run").exists()
