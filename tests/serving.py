"""A real `serve` process for the tests that talk to it over HTTP, and a client's POST."""

import json
import socket
import subprocess
import time
import urllib.request

import pytest

from commands import CLI, UNBUFFERED as ENV


class Served(tuple):
    """(host, port) of a `serve` process, with its `pid` and `log` (the file of its output)."""


@pytest.fixture(scope="module")
def served(hub_tiny_folder, tmp_path_factory):
    """A real `serve` process translating up to 4 requests at once, with up to 32 waiting, that waits 3 s for a
    request's body: (host, port), with .pid and .log."""
    pytest.importorskip("gradio_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as output:  # a file: a pipe nobody reads would stop the server once full
        process = subprocess.Popen(
            [*CLI, "serve", "--model", str(hub_tiny_folder), "--port", str(port), "--max-concurrent", "4",
             "--max-queued", "32"],
            env={**ENV, "GRADIO_TEMP_DIR": str(tmp_path_factory.mktemp("gradio")), "VANILLA_TRANSFORMER_REQUEST_TIMEOUT": "3"},
            stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
            break
        except OSError:
            time.sleep(1)
    served = Served(("127.0.0.1", port))
    served.pid, served.log = process.pid, log
    yield served
    process.kill()
    process.wait()


def post(host, port, path, payload, timeout=120, headers=False):
    """(status, body) of a POST of `payload` (JSON, or bytes as they are), and the response's headers if `headers`."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(f"http://{host}:{port}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as err:
        answer = err.code, err.read().decode(), err.headers
    return answer if headers else answer[:2]
