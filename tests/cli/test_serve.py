"""`serve` under load and bad clients: the real server process over HTTP, concurrent clients on
every route, a chunked body past the limit, a client that stalls; the app's limits on a request, and where they come from;
and the neuron view's capture from threads sharing one model.
"""

import json
import select
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
    kind, data = _call_events(host, port, [sentence, 1, 0.6, 0])
    assert kind == "complete", data
    return data[0]


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
    # A connection that never finishes its headers is closed at the deadline, whatever their number.
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


# --- the JSON endpoint: POST /v1/translate ---


def _translate_json(served, payload, timeout=300):
    status, text, headers = serving.post(*served, "/v1/translate", payload, timeout=timeout, headers=True)
    return status, json.loads(text), headers


def _peak_memory_kb(pid: int) -> tuple[int, int]:
    """(resident, peak resident) memory of a process, in kB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


@pytest.mark.slow
def test_the_json_endpoint_answers_20_concurrent_clients_in_batches_as_it_answers_one(served, hub_tiny_model):
    import random

    from vanilla_transformer.inference import translate_texts

    texts = SENTENCES + ["God is love.", "Blessed are the meek.", "The Lord is my shepherd.", "Ask, and it shall be given you."]
    alone = {text: _translate_json(served, {"texts": [text], "num_beams": 1})[1]["translations"][0] for text in texts}
    assert list(alone.values()) == translate_texts(*hub_tiny_model, texts, num_beams=1)  # the CLI's translations
    resident, _ = _peak_memory_kb(served.pid)
    requests = [random.Random(i).sample(texts, 1 + i % 3) for i in range(200)]
    start = threading.Barrier(20)

    def client(number):
        start.wait()
        return [_translate_json(served, {"texts": request, "num_beams": 1}) for request in requests[number::20]]

    with ThreadPoolExecutor(20) as pool:
        answers = [answer for answers in pool.map(client, range(20)) for answer in answers]
    sent = [request for number in range(20) for request in requests[number::20]]
    assert [status for status, _, _ in answers] == [200] * 200, answers[:1]
    assert [body["translations"] for _, body, _ in answers] == [[alone[text] for text in request] for request in sent]
    batches = [int(headers["X-Batch-Texts"]) for _, _, headers in answers]
    assert max(batches) > 3 and max(batches) <= 32, batches  # requests of 1-3 texts decoded together, up to max_texts
    _, peak = _peak_memory_kb(served.pid)
    assert peak - resident < 300_000, f"the server grew from {resident} kB to a peak of {peak} kB"


@pytest.mark.slow
def test_the_json_endpoint_gives_scores_and_attention_only_when_asked(served):
    status, body, _ = _translate_json(served, {"texts": ["Jesus wept.", ""], "num_beams": 2, "with_scores": True})
    assert status == 200 and set(body) == {"translations", "scores"} and body["translations"][1] == "", body
    assert body["scores"][0] < 0 and body["scores"][1] == 0.0
    status, body, _ = _translate_json(served, {"texts": ["Jesus wept."], "attention": True})
    (attention,) = body["attentions"]
    assert status == 200 and set(body) == {"translations", "attentions"}
    weights = attention["cross_attention"]
    assert len(weights) == len(attention["target_tokens"]) and len(weights[0]) == len(attention["source_tokens"])
    assert abs(sum(weights[0]) - 1) < 1e-2


REFUSED = [  # (body, status, what the one line names)
    (b"not json", 400, "not JSON"),
    (b"[" * 20_000, 400, "not JSON"),  # nested deeper than Python's parser follows: its RecursionError is no 500
    ({"texts": "Jesus wept."}, 400, "`texts` must be a list of 1 to 32 strings"),
    ({"texts": ["x"] * 33}, 400, "`texts` must be a list of 1 to 32 strings"),
    ({"texts": [None]}, 400, "`texts` must be a list"),
    ({"texts": ["Jesus wept."], "num_beams": 20}, 400, "`num_beams` must be a whole number from 1 to 8"),
    ({"texts": ["Jesus wept."], "num_beams": "nan"}, 400, "`num_beams` must be a whole number"),
    (b'{"texts": ["Jesus wept."], "num_beams": NaN}', 400, "`num_beams` must be a whole number"),
    ({"texts": ["Jesus wept."], "max_new_tokens": "inf"}, 400, "`max_new_tokens` must be a whole number from 1 to 256"),
    ({"texts": ["Jesus wept."], "length_penalty": "0.6"}, 400, "length_penalty` must be a finite number"),
    ({"texts": ["Jesus wept."], "with_scores": "yes"}, 400, "`with_scores` must be true or false"),
    ({"texts": ["Jesus wept."], "beams": 4}, 400, "Unknown field 'beams'"),
    ({"texts": ["a " * 300]}, 400, "tokens long; this server translates at most 128 (max_input_tokens)"),
    ({"texts": ["x" * 50_000]}, 400, "texts[0] is 50000 characters long"),
]


@pytest.mark.slow
def test_the_json_endpoint_refuses_a_request_beyond_its_limits_in_one_line_and_logs_no_traceback(served):
    for body, status, message in REFUSED:
        answered, text = serving.post(*served, "/v1/translate", body)
        assert answered == status and message in json.loads(text)["error"], (body, answered, text)
        assert "\n" not in json.loads(text)["error"]
    assert "Traceback" not in served.log.read_text()


def _call_events(host, port, data):
    """The queue's REST route: the last event's kind and data."""
    status, text = serving.post(host, port, "/gradio_api/call/translate", {"data": data})
    assert status == 200, text
    event = json.loads(text)["event_id"]
    with urllib.request.urlopen(f"http://{host}:{port}/gradio_api/call/translate/{event}", timeout=300) as stream:
        lines = stream.read().decode().splitlines()
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return kinds[-1], json.loads(data[-1])


@pytest.mark.slow
@pytest.mark.parametrize("data, message", [
    (["Jesus wept.", "nan", 0.6, 0], "Beam size (1: greedy) must be a number from 1 to 8; got 'nan'."),
    (["Jesus wept.", 1, 0.6, "inf"], "must be a number of at least 0; got 'inf'."),
    ([None, None, None, None], "Beam size (1: greedy) must be a number from 1 to 8; got None."),
    (["Jesus wept.", 20, 0.6, 0], "Beam size (1: greedy) must be a number from 1 to 8; got 20."),
    ([None, 1, 0.6, 0], "The sentence must be text; got None."),
])
def test_the_page_refuses_bad_decoding_options_with_a_message_and_logs_no_traceback(served, data, message):
    # "nan" beams, "inf" tokens or nulls answered {"error": null} with a traceback in the log.
    kind, answer = _call_events(*served, data)
    assert kind == "error" and message in str(answer), answer
    assert "Traceback" not in served.log.read_text()


@pytest.mark.slow
def test_the_page_has_one_route_per_call(served):
    host, port = served
    with urllib.request.urlopen(f"http://{host}:{port}/gradio_api/info", timeout=30) as response:
        routes = json.load(response)["named_endpoints"]
    assert "/translate" in routes and "/translate_1" not in routes, sorted(routes)


def test_the_app_refuses_a_request_beyond_its_limits_naming_the_limit(hub_tiny_model, tmp_path):
    import re

    gr = pytest.importorskip("gradio")
    from vanilla_transformer.inference import translate_texts
    from vanilla_transformer.visualize.app import Limits, make_translate

    model, tokenizer = hub_tiny_model
    translate = make_translate(model, tokenizer, Limits(max_input_tokens=12, max_new_tokens=5, max_beams=2), tmp_path)
    for request, message in (
        (("In the beginning God created the heavens and the earth.", 1, 0.6, 0),
         r"The sentence is \d+ tokens long; this app translates at most 12 \(max_input_tokens\)"),
        (("Jesus wept.", 3, 0.6, 0), r"Beam size 3 is over this app's limit of 2 \(max_beams\)"),
        (("Jesus wept.", 1, 0.6, 6), r"The longest output asked for, 6 tokens, is over this app's limit of 5 \(max_new_tokens\)"),
        (("Jesus wept.", 1, 1e308, 0), r"The length penalty must be between -10.0 and 10.0"),
    ):
        with pytest.raises(gr.Error) as refused:  # refused, not clipped
            translate(*request)
        assert re.match(message, refused.value.message), refused.value.message
    # Within the limits; asking for no length gives the model's default, here capped at max_new_tokens.
    translation, frame, page = translate("Jesus wept.", 2, 0.6, 0)
    assert translation == translate_texts(model, tokenizer, ["Jesus wept."], num_beams=2, max_new_tokens=5)[0]
    assert translate("Jesus wept.", 1, 0.6, 3)[0] == translate_texts(model, tokenizer, ["Jesus wept."], num_beams=1,
                                                                      max_new_tokens=3)[0]


def test_the_app_serves_its_limits(hub_tiny_folder):
    import gc

    gr = pytest.importorskip("gradio")
    from vanilla_transformer.visualize.app import Limits, build_app

    demo = build_app(hub_tiny_folder, "cpu", Limits(max_beams=2, max_concurrent=2, max_queued=3))
    gc.collect()  # the explorer pages' folder lives as long as the app
    (translate,) = {block.fn for block in demo.fns.values() if block.fn.__name__ == "translate"}  # click and submit
    with pytest.raises(gr.Error, match="over this app's limit of 2"):
        translate("Jesus wept.", 3, 0.6, 0)
    assert Path(translate("Jesus wept.", 2, 0.6, 0)[2]).is_file()


def test_the_apps_limits_come_from_serves_options_then_the_environment_then_the_defaults(monkeypatch, capsys):
    pytest.importorskip("gradio")
    from vanilla_transformer.cli import main
    from vanilla_transformer.visualize import app

    assert app.Limits() == app.Limits(max_input_tokens=128, max_new_tokens=256, max_beams=8, max_concurrent=1, max_queued=8)
    served = []
    monkeypatch.setattr(app, "serve", lambda model, host, port, device, limits: served.append(limits))
    monkeypatch.setenv("VANILLA_TRANSFORMER_MAX_NEW_TOKENS", "64")  # as a Space's variable sets it
    monkeypatch.setenv("VANILLA_TRANSFORMER_MAX_BEAMS", "4")
    assert main(["serve", "--model", "m", "--max-beams", "2", "--max-concurrent", "3", "--max-input-tokens", "32"]) == 0
    assert capsys.readouterr().err == "threads: 1 (OMP_NUM_THREADS; --threads N to change)\n"  # the suite's, as serve starts
    assert served == [app.Limits(max_input_tokens=32, max_new_tokens=64, max_beams=2, max_concurrent=3, max_queued=8)]
    for argv, message in ((["--max-queued", "0"], "--max-queued must be a positive integer; got 0"),
                          ([], "--max-beams (VANILLA_TRANSFORMER_MAX_BEAMS) must be a whole number of at least 1; got 'many'"),
                          (["--max-new-tokens", "100000"], "--max-new-tokens must be a positive integer up to 4096 (its "
                                                           "cache is allocated up front); got 100000")):
        monkeypatch.setenv("VANILLA_TRANSFORMER_MAX_BEAMS", "many" if not argv else "4")
        with pytest.raises(SystemExit) as stop:
            main(["serve", "--model", "m", *argv])
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"vanilla-transformer serve: error: {message}\n"


def test_two_requests_for_the_same_sentence_at_once_both_get_their_page(hub_tiny_model, tmp_path, monkeypatch):
    # Both write explorer-<hash of the page>.html, and a write first removes what an earlier one of that file left:
    # without one writer at a time, the second removed the first's staging file before its rename.
    pytest.importorskip("gradio")
    from vanilla_transformer import staging
    from vanilla_transformer.visualize.app import Limits, make_translate

    real_move = staging._move

    def slow_move(source, destination):  # widens the moment between a page's write and its rename
        time.sleep(0.5)
        real_move(source, destination)

    monkeypatch.setattr(staging, "_move", slow_move)
    translate = make_translate(*hub_tiny_model, Limits(max_new_tokens=5), tmp_path)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: translate("Jesus wept.", 1, 0.6, 0), range(2)))
    assert answers[0] == answers[1] and Path(answers[0][2]).is_file()


def test_app_py_imports_the_package_by_name_as_a_space_runs_it_alone():
    # A Space runs app.py as a script, outside the package: a relative import there fails at start
    # (test_browser.py starts one; this says why at once).
    import ast

    from vanilla_transformer.visualize import app

    tree = ast.parse(Path(app.__file__).read_text(encoding="utf-8"))
    relative = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not relative, f"relative imports in app.py at lines {relative}"
