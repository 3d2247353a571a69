"""Shared test helpers.

`run_without_package` runs Python code in a fresh process in which `vanilla_transformer` cannot be
imported (as on a user's machine that only has a saved folder), offline, and returns its stdout.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

torch.set_num_threads(1)

_BLOCK_PACKAGE = "import sys; sys.modules['vanilla_transformer'] = None  # any import of the package now fails\n"


def run_without_package(code: str, cwd=None, timeout: int = 300) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_PACKAGE + textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


@pytest.fixture(name="run_without_package")
def run_without_package_fixture():
    return run_without_package
