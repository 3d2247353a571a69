"""A real `serve` process for the tests that talk to it over HTTP, and a client's POST."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CLI = [sys.executable, "-m", "vanilla_transformer.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def served(hub_tiny_folder, tmp_path_factory):
    """A real `serve` process translating up to 4 requests at once, that waits 3 s for a request's body: (host, port)."""
    pytest.importorskip("gradio_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [*CLI, "serve", "--model", str(hub_tiny_folder), "--port", str(port), "--max-concurrent", "4"],
        env={**ENV, "GRADIO_TEMP_DIR": str(tmp_path_factory.mktemp("gradio")), "VANILLA_TRANSFORMER_REQUEST_TIMEOUT": "3"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()[-2000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
            break
        except OSError:
            time.sleep(1)
    yield "127.0.0.1", port
    process.kill()
    process.wait()


def post(host, port, path, payload, timeout=120):
    request = urllib.request.Request(f"http://{host}:{port}{path}", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
