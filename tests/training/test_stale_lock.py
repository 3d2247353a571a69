"""A stale lock: a run killed while a process it forked lives on leaves its `.train.lock` held by that
process; the PID in the file tells the next run that the run itself is gone, and it takes the folder over with one
warning. A live run still holds the folder."""

import os
import signal
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "vanilla_transformer.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# A run as `train` takes its folder, that forks a worker (a data loader's, a pool's) which inherits the lock's file.
HOLDER = """
import os, sys, time
from vanilla_transformer.training.lock import RunLock
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
        train = [*CLI, "train", "--dataset", str(small_task), "--output-dir", str(out), *small_run, "--max-steps", "1"]
        refused = subprocess.run(train, capture_output=True, text=True, env=ENV, timeout=300)
        assert refused.returncode == 2 and f"is in use by another training run (PID {run.pid} " in refused.stderr
        run.kill()  # kill -9 of the run alone: its fork lives on, holding the lock's file
        run.wait()
        result = subprocess.run(train, capture_output=True, text=True, env=ENV, timeout=300)
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
