"""The `vanilla-transformer` command as the tests run it: a real process (`CLI`), offline (`ENV`), with the test's
timeout, and under an address-space cap (`memory`, in bytes) where memory is the point."""

import os
import resource
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "vanilla_transformer.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
UNBUFFERED = {**ENV, "PYTHONUNBUFFERED": "1"}  # for a test that reads the output as it comes


def capped(memory: int):
    """A `preexec_fn` that caps the child's address space at `memory` bytes."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def run_cli(*args, timeout: int, memory: int | None = None, env: dict | None = None,
            **kwargs) -> subprocess.CompletedProcess:
    """`vanilla-transformer ARGS` (each made a string) in a process of its own, its output captured as text; a
    process still running after `timeout` seconds fails the test. Standard input is empty unless given."""
    if "input" not in kwargs:
        kwargs.setdefault("stdin", subprocess.DEVNULL)  # a question asked on the terminal gets no answer, not a wait
    try:
        return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=env or ENV,
                              timeout=timeout, preexec_fn=capped(memory) if memory else None, **kwargs)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{args[0]} still running after {timeout} s: {(err.stderr or b'')[-2000:]!r}")
