"""`serve` under load and bad clients: the real server process over HTTP, concurrent clients on
every route, a chunked body past the limit, a client that stalls; and the neuron view's capture from
threads sharing one model.
"""

import json
import select
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import serving

served = serving.served  # the fixture: a real `serve` process, on a free port
SENTENCES = ["Jesus wept.", "In the beginning God created the heaven and the earth.", "Love is patient and is kind.",
             "And the men of the city said unto him, Bring forth the man."]


def test_neuron_captures_from_threads_sharing_one_model_each_read_their_own_pass(hub_tiny_model):
    from vanilla_transformer.visualize.neuron_view import neuron_tensors

    model, tokenizer = hub_tiny_model
    model.eval()

    def capture(sentence):
        ids = tokenizer(sentence, return_tensors="pt")["input_ids"]
        decoder = torch.cat([torch.tensor([[model.config.decoder_start_token_id]]), ids[:, :-1]], dim=1)
        return neuron_tensors(model, ids, None, decoder).kinds

    expected = {sentence: capture(sentence) for sentence in SENTENCES}
    start = threading.Barrier(8)

    def concurrent(sentence):
        start.wait()
        return capture(sentence)

    with ThreadPoolExecutor(8) as pool:  # each sentence twice, all at once, on the one model
        results = list(pool.map(concurrent, SENTENCES * 2))
    for sentence, kinds in zip(SENTENCES * 2, results):
        for kind, tensors in kinds.items():
            assert torch.equal(tensors.queries, expected[sentence][kind].queries), (sentence, kind)
            assert torch.equal(tensors.scores, expected[sentence][kind].scores), (sentence, kind)


@pytest.mark.slow
def test_the_route_that_skips_the_queue_is_closed_to_every_client(served):
    # Gradio leaves /run/ open outside Spaces: 10 parallel requests there all ran at once, past every limit.
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: serving.post(*served, "/gradio_api/run/translate", {"data": ["Jesus wept.", 1, 0.6, 0]}),
                                range(10)))
    assert all(status == 404 and "Jes" not in text for status, text in answers), answers[:2]  # refused, nothing translated


def _call(host, port, sentence):
    """The queue's REST route: POST /call/<name> for an event id, then its result as server-sent events."""
    status, text = serving.post(host, port, "/gradio_api/call/translate", {"data": [sentence, 1, 0.6, 0]})
    assert status == 200, text
    event = json.loads(text)["event_id"]
    with urllib.request.urlopen(f"http://{host}:{port}/gradio_api/call/translate/{event}", timeout=300) as stream:
        lines = stream.read().decode().splitlines()
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert kinds[-1] == "complete", lines[-4:]
    return json.loads(data[-1])[0]


@pytest.mark.slow
def test_concurrent_clients_through_the_queue_each_get_their_own_translation(served):
    from gradio_client import Client

    host, port = served
    client = Client(f"http://{host}:{port}/", download_files=False, verbose=False)
    expected = {sentence: client.predict(sentence, 1, 0.6, 0, api_name="/translate")[0] for sentence in SENTENCES}
    jobs = [client.submit(sentence, 1, 0.6, 0, api_name="/translate") for sentence in SENTENCES * 2]
    with ThreadPoolExecutor(4) as pool:  # the REST route to the queue, at the same time as the client's
        called = list(pool.map(lambda sentence: _call(host, port, sentence), SENTENCES))
    assert called == [expected[sentence] for sentence in SENTENCES]
    assert [job.result(timeout=300)[0] for job in jobs] == [expected[sentence] for sentence in SENTENCES * 2]


def _answer(connection, timeout):
    """The bytes the server sends until it closes the connection (or `timeout` seconds pass: then None)."""
    connection.settimeout(timeout)
    received = b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except TimeoutError:
        return None
    return received


def _send_until_answered(connection, piece: bytes, times: int, wait: float) -> None:
    """Send `piece` up to `times` times, `wait` seconds apart, until the server answers or closes its end."""
    for _ in range(times):
        if select.select([connection], [], [], wait)[0]:
            return
        try:
            connection.sendall(piece)
        except OSError:  # the server closed its end: its answer is waiting
            return


@pytest.mark.slow
def test_a_chunked_body_past_the_limit_is_answered_413_and_the_connection_closed(served):
    host, port = served
    with socket.create_connection(served, timeout=30) as connection:
        connection.sendall(f"POST /gradio_api/queue/join HTTP/1.1\r\nHost: {host}:{port}\r\n"
                           "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        _send_until_answered(connection, b"%x\r\n%s\r\n" % (65536, b"x" * 65536), 80, 0.05)  # 5 MB at most
        answer = _answer(connection, 30)
    assert answer is not None, "no answer, and the connection was left open"
    assert answer.startswith(b"HTTP/1.1 413") and b"over this app's limit of" in answer


@pytest.mark.slow
def test_a_client_that_stalls_on_its_body_is_answered_408_and_closed(served):
    host, port = served
    with socket.create_connection(served, timeout=30) as connection:
        started = time.monotonic()
        connection.sendall(f"POST /gradio_api/queue/join HTTP/1.1\r\nHost: {host}:{port}\r\n"
                           "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"data\":".encode())
        answer = _answer(connection, 30)  # the server waits 3 s for the rest
    assert answer is not None, "the stalled client was never timed out"
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 3 seconds" in answer
    assert time.monotonic() - started < 20


@pytest.mark.slow
def test_a_body_dripped_a_byte_at_a_time_is_cut_at_the_whole_requests_deadline(served):
    # Each byte restarted the 3 s clock, so a body dripped every 2 s held its connection for as long as it
    # dripped (19 s and counting).
    host, port = served
    with socket.create_connection(served, timeout=30) as connection:
        started = time.monotonic()
        connection.sendall(f"POST /gradio_api/queue/join HTTP/1.1\r\nHost: {host}:{port}\r\n"
                           "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())
        _send_until_answered(connection, b" ", 10, 2)  # 20 s of drip at most
        answered = time.monotonic() - started
        answer = _answer(connection, 10)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert answered < 3 + 3, f"the body was read for {answered:.1f} s with a deadline of 3 s"


@pytest.mark.slow
def test_connections_that_send_half_their_headers_are_closed_at_the_deadline(served):
    # 40 connections sending half their headers were all still open after 10 s, one after 20 s.
    host, port = served
    connections = [socket.create_connection(served, timeout=30) for _ in range(40)]
    try:
        started = time.monotonic()
        for connection in connections:
            connection.sendall(f"POST /gradio_api/queue/join HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Ty".encode())
        open_ones = list(connections)
        while open_ones and time.monotonic() - started < 10:
            readable = select.select(open_ones, [], [], 0.5)[0]
            open_ones = [c for c in open_ones if c not in readable or _answer(c, 5) is None]
        assert not open_ones, f"{len(open_ones)} of 40 half-open connections still open after 10 s (deadline 3 s)"
        assert time.monotonic() - started < 3 + 3
        # The server still answers a whole request at once.
        assert urllib.request.urlopen(f"http://{host}:{port}/", timeout=10).status == 200
    finally:
        for connection in connections:
            connection.close()
