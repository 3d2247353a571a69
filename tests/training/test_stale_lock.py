"""A stale lock: a run killed while a process it forked lives on leaves its `.train.lock` held by that
process; the PID in the file tells the next run that the run itself is gone, and it takes the folder over with one
warning. A live run still holds the folder, and a run whose lock is gone stops before it writes again."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from commands import CLI, ENV, run_cli

# A run as `train` takes its folder, that forks a worker (a data loader's, a pool's) which inherits the lock's file.
HOLDER = """
import os, sys, time
from vanilla_transformer.training.run_folder import RunLock
RunLock(sys.argv[1]).acquire()
if os.fork() == 0:
    time.sleep(120)
    os._exit(0)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_killed_runs_lock_still_held_by_its_fork_is_taken_over_and_a_live_run_still_refuses(tmp_path, small_task,
                                                                                              small_run):
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=ENV,
                           start_new_session=True)
    try:
        assert run.stdout.readline() == "ready\n"
        train = ["train", "--dataset", small_task, "--output-dir", out, *small_run, "--max-steps", 1]
        refused = run_cli(*train, timeout=300)
        assert refused.returncode == 2 and f"is in use by another training run (PID {run.pid} " in refused.stderr
        run.kill()  # kill -9 of the run alone: its fork lives on, holding the lock's file
        run.wait()
        result = run_cli(*train, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        taken = [line for line in result.stderr.splitlines() if "taking over" in line]
        assert len(taken) == 1 and f"the run that left it (PID {run.pid} on host" in taken[0], result.stderr[-3000:]
        assert (out / "model.safetensors").is_file() and not (out / ".train.lock").exists()
    finally:
        run.kill()
        run.wait()
        try:
            os.killpg(run.pid, signal.SIGKILL)  # the fork, in the run's session
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_a_lock_naming_a_live_process_that_holds_nothing_is_taken_over_saying_what_is_true(tmp_path, small_task,
                                                                                          small_run):
    # A file naming PID 1 (alive, no run of the folder) is taken over with a line that says why, not "as no longer
    # running", which would be false.
    out = tmp_path / "out"
    out.mkdir()
    (out / ".train.lock").write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "started": "earlier",
                                                 "command": "written by hand"}))
    result = run_cli("train", "--dataset", small_task, "--output-dir", out, *small_run, "--max-steps", 1, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    taken = [line for line in result.stderr.splitlines() if "taking over" in line]
    assert len(taken) == 1 and "no longer running" not in taken[0], result.stderr[-3000:]
    assert taken[0].endswith(f"taking over {out}/.train.lock: it names PID 1 on this host, a running process that does "
                             "not hold the lock, so no run of this folder (the PID reused, or the file written by "
                             f"hand): PID 1 on host {socket.gethostname()}, started earlier: written by hand")


@pytest.mark.slow
def test_a_run_whose_lock_is_removed_stops_before_its_next_checkpoint(tmp_path, small_task, small_run):
    # With its lock removed, a run went on writing checkpoints while a second run took the folder: both trained
    # on it, their checkpoints interleaved.
    out = tmp_path / "out"
    train = [*CLI, "train", "--dataset", str(small_task), "--output-dir", str(out), *small_run, "--max-steps", "500",
             "--save-steps", "1", "--keep-checkpoints", "500"]
    run = subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 240
        while not list((out / "checkpoints").glob("checkpoint-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        (out / ".train.lock").unlink()
        before = sorted(path.name for path in (out / "checkpoints").glob("checkpoint-*"))
        _, stderr = run.communicate(timeout=240)
    finally:
        run.kill()
    assert run.returncode == 2, stderr[-3000:]
    assert stderr.splitlines()[-1] == (
        f"vanilla-transformer train: error: {out}/.train.lock was removed or replaced while this run trained, so another "
        f"run may be writing {out}; this run stops before writing its next checkpoint. Check which run should go on, "
        "then `resume` it alone")
    after = sorted(path.name for path in (out / "checkpoints").glob("checkpoint-*"))
    assert before and after[:len(before)] == before and len(after) <= len(before) + 1  # one being saved at most
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("content", ["[1, 2]", '"x"', '{"pid": ', "\u00ff", " " * ((1 << 20) + 1) + "{}"])
def test_a_lock_file_holding_no_record_is_taken_over_as_one_with_no_holder(tmp_path, content):
    from vanilla_transformer.training.run_folder import LOCK_FILE, RunLock

    (tmp_path / LOCK_FILE).write_text(content, encoding="latin-1")  # left by no run of ours, or damaged: unlocked
    lock = RunLock(tmp_path)
    lock.acquire()  # not an AttributeError from a record that is a list, or a read of any size
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    lock.release()
