"""A small web app for trying a model: type a sentence, read its translation, explore its attention.

    vanilla-transformer serve --model runs/quickstart        # then open http://127.0.0.1:7860

This same file is the `app.py` of a Hugging Face Space for a published model: copy it into a Gradio
Space as app.py, with a requirements.txt that names this package with its `serve` extra, and set the
Space variable MODEL_ID to the model's repository (user/name). Spaces run `python app.py`, and Gradio
takes the address from GRADIO_SERVER_NAME and GRADIO_SERVER_PORT.

What one visitor may ask is bounded (`Limits`: source and output length, beams, requests served at once
and waiting): a request beyond a limit is refused with a message naming it. A deployer changes them with
`serve --max-input-tokens ...` or, in a Space, the variables VANILLA_TRANSFORMER_MAX_INPUT_TOKENS,
..._MAX_NEW_TOKENS, ..._MAX_BEAMS, ..._MAX_TEXTS, ..._MAX_CONCURRENT, ..._MAX_QUEUED and ..._REQUEST_TIMEOUT. Every
request goes through the queue: Gradio's REST route that skips it (`/run/`) is closed. `serve` answers a
request body larger than `max_texts` of the longest sentences need with 413, from its length before reading it or, sent
in chunks, once past the limit (`BodyLimit`), and a client that takes longer than `request_timeout` to send
its headers and body, however it spaces them out, with 408 (`RequestDeadline`); it keeps the explorer's files in one folder inside Gradio's cache (the newest
`KEPT_PAGES`), removed when it stops.

Programs call the JSON endpoint `POST /v1/translate` (api.py), served beside the page within the same limits;
its batches and the page's requests share the `max_concurrent` translation slots.

The page loads nothing from other hosts: the theme uses the system's fonts, analytics are off, and
the explorer is the self-contained page of `vanilla_transformer.visualize.explorer`, shown in a sandboxed frame
(and offered as a file to keep). Gradio is an optional dependency: `pip install vanilla-transformer[serve]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import html
import math
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

try:
    import gradio as gr
except ImportError as err:  # an optional dependency
    from vanilla_transformer.errors import MissingPackage

    raise MissingPackage("the web app needs Gradio: pip install 'vanilla-transformer[serve]'") from err
import h11  # uvicorn's, which Gradio serves with
from uvicorn.protocols.http.h11_impl import H11Protocol

from vanilla_transformer.visualize.attention_maps import check_attention_support
from vanilla_transformer.visualize.explorer import explorer_html, explorer_record
from vanilla_transformer.choices import SERVE_LIMITS
from vanilla_transformer.errors import BadInput
from vanilla_transformer.inference import load_model, longest_token
from vanilla_transformer.modeling.value_checks import MAX_NEW_TOKENS, check_decoding_options
from vanilla_transformer.modeling.generation import DEFAULT_MAX_LENGTH_OFFSET
from vanilla_transformer.staging import temporary_folder, write_file_whole

__all__ = ["Limits", "RequestDeadline", "build_app", "make_translate", "serve"]

EXAMPLES = [
    "In the beginning, God created the heavens and the earth.",
    "Jesus wept.",
    "Love is patient and is kind.",
]


@dataclass(frozen=True)
class Limits:
    """What the app serves: one request without a ceiling on its output took 152 s and 1.7 GB."""

    # The defaults, and what each is, in choices.py: `serve --help` shows them without importing this module.
    max_input_tokens: int = SERVE_LIMITS["max_input_tokens"]
    max_new_tokens: int = SERVE_LIMITS["max_new_tokens"]
    max_beams: int = SERVE_LIMITS["max_beams"]
    max_texts: int = SERVE_LIMITS["max_texts"]
    max_concurrent: int = SERVE_LIMITS["max_concurrent"]
    max_queued: int = SERVE_LIMITS["max_queued"]
    request_timeout: int = SERVE_LIMITS["request_timeout"]

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(f"--{name.replace('_', '-')} ({ENVIRONMENT_PREFIX}{name.upper()}) must be a whole "
                               f"number of at least 1; got {value!r}")
        if self.max_new_tokens > MAX_NEW_TOKENS:  # what generate accepts
            raise BadInput(f"--max-new-tokens ({ENVIRONMENT_PREFIX}MAX_NEW_TOKENS) must be at most {MAX_NEW_TOKENS}; "
                           f"got {self.max_new_tokens}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ, **given: int | None) -> Limits:
        """The limits `given` (None: not given), else those the environment sets, else the defaults."""
        values = {}
        for field in dataclasses.fields(cls):
            value, variable = given.get(field.name), ENVIRONMENT_PREFIX + field.name.upper()
            if value is None and environ.get(variable, "").strip():
                text = environ[variable].strip()
                value = int(text) if text.isdigit() else text  # refused below, named
            values[field.name] = field.default if value is None else value
        return cls(**values)


ENVIRONMENT_PREFIX = "VANILLA_TRANSFORMER_"


def _length_offset(model) -> int:
    """New tokens the model allows beyond the source's length when the request names no limit."""
    return getattr(model.generation_config, "max_length_offset", None) or DEFAULT_MAX_LENGTH_OFFSET


def make_translate(model, tokenizer, limits: Limits, pages: str | os.PathLike | tempfile.TemporaryDirectory,
                   slots: threading.Semaphore | None = None):
    """The app's function: (sentence, beams, length penalty, longest output (0: the model's default)) ->
    (translation, the explorer in a frame, the explorer's file, written under `pages`, which keeps the newest
    `KEPT_PAGES`). A request beyond `limits` is a gr.Error naming the limit. `slots`: held while translating."""
    offset, slots = _length_offset(model), slots or threading.Semaphore(limits.max_concurrent)
    writing = threading.Lock()  # see _write_page
    longest_text = limits.max_input_tokens * longest_token(tokenizer)

    def translate(sentence: str, num_beams: float, length_penalty: float, max_new_tokens: float):
        if not isinstance(sentence, str):  # a client's call may hold anything: Gradio passes it on
            raise _refuse(f"The sentence must be text; got {sentence!r}.")
        num_beams, requested = int(num_beams), int(max_new_tokens or 0)  # numbers in range: App.validate_inputs
        if len(sentence or "") > longest_text:  # before tokenising: the cost of that grows with the text
            raise _refuse(f"The sentence is {len(sentence)} characters long, more than the {limits.max_input_tokens} "
                         "tokens this app translates (max_input_tokens) can hold. Give a shorter sentence.")
        tokens = len(tokenizer(sentence or "")["input_ids"])
        if tokens > limits.max_input_tokens:
            raise _refuse(f"The sentence is {tokens} tokens long; this app translates at most {limits.max_input_tokens} "
                         "(max_input_tokens). Give a shorter sentence.")
        if num_beams > limits.max_beams:
            raise _refuse(f"Beam size {num_beams} is over this app's limit of {limits.max_beams} (max_beams).")
        if requested > limits.max_new_tokens:
            raise _refuse(f"The longest output asked for, {requested} tokens, is over this app's limit of "
                         f"{limits.max_new_tokens} (max_new_tokens).")
        try:  # an emptied box (None) is no number either
            check_decoding_options(length_penalty=math.nan if length_penalty is None else length_penalty,
                                   names={"length_penalty": "The length penalty"})
        except ValueError as err:
            raise _refuse(str(err)) from None
        if not requested and tokens + offset > limits.max_new_tokens:
            requested = limits.max_new_tokens  # the model's default (source length + offset) within the limit
        try:
            with slots:
                record = explorer_record(
                    model, tokenizer, sentence, num_beams=num_beams, length_penalty=float(length_penalty),
                    max_new_tokens=requested or None,
                )
        except (TypeError, ValueError) as err:
            raise _refuse(str(err).replace("`text`", "The sentence")) from None
        page = explorer_html(record)
        # `pages` itself, not its name: a TemporaryDirectory lives as long as this function refers to it
        path = _write_page(Path(pages.name if isinstance(pages, tempfile.TemporaryDirectory) else pages), page, writing)
        frame = (f'<iframe title="Attention explorer" sandbox="allow-scripts" srcdoc="{html.escape(page)}" '
                 'style="width: 100%; height: 1000px; border: 0"></iframe>')
        return record.translation, frame, str(path)

    return translate


def _write_page(folder: Path, page: str, writing: threading.Lock) -> Path:
    """`page` as explorer-<its hash>.html in `folder`, whole (it is served from there), the newest KEPT_PAGES kept.
    One at a time (`writing`): two requests for the same sentence write the same file, and a write removes what an
    earlier write of that file left half done."""
    path = folder / f"explorer-{hashlib.sha1(page.encode()).hexdigest()[:12]}.html"
    with writing:
        write_file_whole(path, page)
        _keep_newest(folder, KEPT_PAGES)
    return path


def _refuse(message: str) -> gr.Error:
    """A refusal the client reads, which the server does not log as a failure."""
    return gr.Error(message, print_exception=False)


KEPT_PAGES = 32  # explorer files kept for download: a few MB each, for as long as the app serves


def _keep_newest(folder: Path, count: int) -> None:
    """Remove all but the `count` newest files of `folder`."""
    files = sorted(folder.iterdir(), key=lambda path: path.stat().st_mtime_ns)
    for path in files[:-count]:
        path.unlink(missing_ok=True)


def pages_folder() -> tempfile.TemporaryDirectory:
    """A new folder for the explorer's files inside Gradio's cache, which serves them from there instead of
    keeping a copy of each; it is removed when the app stops."""
    from gradio.utils import get_upload_folder

    return temporary_folder(get_upload_folder(), "vanilla-transformer-app-")


class App(gr.Blocks):
    """The app's Blocks, which answer a call with the wrong number of inputs with what the call needs: Gradio
    refuses it with an error that it hides from the client, who reads `{"error": null}`."""

    def validate_inputs(self, block_fn, inputs):
        if len(inputs) != len(block_fn.inputs):
            names = ", ".join(str(getattr(block, "label", None) or block) for block in block_fn.inputs)
            raise gr.Error(f"This call takes {len(block_fn.inputs)} inputs ({names}); it was given {len(inputs)}.",
                           print_exception=False)
        for block, value in zip(block_fn.inputs, inputs):
            if isinstance(block, (gr.Slider, gr.Number)):
                _check_number(block, value)
        super().validate_inputs(block_fn, inputs)


def _check_number(block, value) -> None:
    """Refuse a value that Gradio's own range check would fail on with a traceback and an empty error (a string,
    NaN) or log as a failure (out of range); an emptied number box (None) is left to the app's function."""
    if value is None and isinstance(block, gr.Number):
        return
    low, high = block.minimum, block.maximum
    fits = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not fits or (low is not None and value < low) or (high is not None and value > high):
        bounds = f" from {low} to {high}" if high is not None else (f" of at least {low}" if low is not None else "")
        raise _refuse(f"{block.label} must be a number{bounds}; got {value!r}.")


def build_app(model_name_or_path: str, device: str | None = None, limits: Limits | None = None) -> gr.Blocks:
    """The Gradio app for one model (loaded now, so that a bad folder fails before anything is served), serving
    within `limits` (default: `Limits.from_environment()`)."""
    limits = limits or Limits.from_environment()
    model, tokenizer = load_model(model_name_or_path, device)
    check_attention_support(model)
    config = model.generation_config
    pages = pages_folder()  # lives as long as the app
    slots = threading.Semaphore(limits.max_concurrent)  # the page's requests and the JSON endpoint's batches share them
    translate = make_translate(model, tokenizer, limits, pages, slots)
    max_request_bytes = request_bytes(limits, longest_token(tokenizer))

    with App(title=f"Translate with {model_name_or_path}", analytics_enabled=False) as demo:
        gr.Markdown(
            f"## Translate with `{model_name_or_path}`\n"
            "The Transformer of *Attention Is All You Need*. Type a sentence; below its translation, explore "
            "what every layer and head attended to."
        )
        sentence = gr.Textbox(label="Sentence", lines=2, placeholder=EXAMPLES[0], elem_id="sentence")
        with gr.Accordion("Decoding", open=False):
            with gr.Row():
                num_beams = gr.Slider(1, limits.max_beams, value=min(config.num_beams or 1, limits.max_beams), step=1,
                                      label="Beam size (1: greedy)")
                length_penalty = gr.Number(value=config.length_penalty, label="Length penalty (beam search)")
                max_new_tokens = gr.Number(value=0, precision=0, minimum=0,
                                           label=f"Longest output in tokens (0: source length + {_length_offset(model)}, at most "
                                                 f"{limits.max_new_tokens})")
        button = gr.Button("Translate", variant="primary", elem_id="translate")
        translation = gr.Textbox(label="Translation", interactive=False, elem_id="translation")
        explorer = gr.HTML(elem_id="explorer")
        download = gr.File(label="The explorer as one HTML file (it works offline)", elem_id="download")
        gr.Examples(EXAMPLES, inputs=sentence)
        inputs, outputs = [sentence, num_beams, length_penalty, max_new_tokens], [translation, explorer, download]
        # One event for both triggers: one API route (/translate), not a second one (/translate_1) for the same call.
        gr.on([button.click, sentence.submit], translate, inputs, outputs, api_name="translate")
    demo.max_request_bytes = max_request_bytes  # for `serve`'s BodyLimit
    demo.json_route = json_endpoint(model, tokenizer, limits, slots)  # for `serve`: POST /v1/translate
    demo.request_timeout = limits.request_timeout  # for `serve`'s BodyLimit
    # api_open=False: Gradio otherwise leaves the REST route /run/ open outside Spaces, where no limit holds
    return demo.queue(max_size=limits.max_queued, default_concurrency_limit=limits.max_concurrent, api_open=False)


def json_endpoint(model, tokenizer, limits: Limits, slots: threading.Semaphore):
    """The route of the JSON endpoint (api.py), its requests decoded in batches within `limits`."""
    from vanilla_transformer.visualize.api import Batcher, json_route, make_decode  # absolute: a Space runs this file alone

    # The model's own default length (source + offset) where no source within the limits can pass max_new_tokens.
    default = None if limits.max_input_tokens + _length_offset(model) <= limits.max_new_tokens else limits.max_new_tokens
    decode, check = make_decode(model, tokenizer, limits, default, slots)
    batcher = Batcher(decode, check, limits.max_texts, limits.max_queued)
    return json_route(batcher, limits, limits.max_input_tokens * longest_token(tokenizer))


def serve(model_name_or_path: str, host: str | None = None, port: int | None = None, device: str | None = None,
          limits: Limits | None = None) -> None:
    """Serve the app until interrupted; `host` and `port` default to Gradio's (GRADIO_SERVER_NAME/PORT, else 127.0.0.1:7860)."""
    import signal

    from starlette.middleware import Middleware

    limits = limits or Limits.from_environment()
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])  # no web fonts
    demo = build_app(model_name_or_path, device, limits)
    # SIGTERM stops the server as Ctrl-C does (Gradio closes it), so that the explorer's folder is removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    body_limit = Middleware(BodyLimit, max_bytes=demo.max_request_bytes, timeout=demo.request_timeout)
    _use_request_deadline(demo.request_timeout)
    demo.launch(server_name=host, server_port=port, theme=theme,
                app_kwargs={"middleware": [body_limit], "routes": [demo.json_route]})


def request_bytes(limits: Limits, longest_token: int) -> int:
    """The largest request body the app reads: `max_texts` sentences of `max_input_tokens` tokens, each character
    escaped in JSON (at most 12 bytes: a surrogate pair), and room for the rest of the request."""
    return limits.max_texts * limits.max_input_tokens * longest_token * 12 + 64 * 1024


class BodyLimit:
    """ASGI middleware: a request whose body is over `max_bytes` is answered 413, from its Content-Length before
    it is read, or, sent in chunks, once past the limit; a client that has not sent its whole body `timeout`
    seconds after its headers is answered 408. Both close the connection. A body within the limit is read whole (at most
    `max_bytes`) before the app sees it, so that no request holds a translation slot while its client dawdles."""

    def __init__(self, app, max_bytes: int, timeout: float = 30):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is None and b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)  # no body (a page, a stream of queue events)
        too_large = f"The request is over this app's limit of {self.max_bytes} bytes."
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _answer(send, 413, too_large)
        parts, received = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout  # for the whole body: a drip does not restart it
        while True:
            try:
                event = await asyncio.wait_for(receive(), max(deadline - asyncio.get_running_loop().time(), 0))
            except asyncio.TimeoutError:  # not yet the built-in TimeoutError on Python 3.10
                return await _answer(send, 408, f"The request's body did not arrive within {self.timeout} seconds.")
            if event["type"] == "http.disconnect":
                return None
            parts.append(event.get("body", b""))
            received += len(parts[-1])
            if received > self.max_bytes:
                return await _answer(send, 413, too_large)
            if not event.get("more_body"):
                break
        whole = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()

        return await self.app(scope, replay, send)


def _use_request_deadline(timeout: float) -> None:
    """Have the server Gradio starts use `RequestDeadline` with `timeout`: Gradio passes uvicorn no protocol of
    its choosing, so the one uvicorn picks by default ("auto") is named here."""
    import uvicorn.config

    uvicorn.config.HTTP_PROTOCOLS["auto"] = type("RequestDeadline", (RequestDeadline,), {"timeout": timeout})


class RequestDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline per request: a client that has not sent its headers and body
    `timeout` seconds after its first byte (or after connecting) is answered 408 and closed. Without it a client
    that sends half its headers holds its connection for ever, and uvicorn's keep-alive clock starts only after
    a response."""

    timeout: float = 30

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.timeout, self._too_late)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None:  # the first bytes of the next request on a kept-alive connection
            self._deadline = self.loop.call_later(self.timeout, self._too_late)
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):  # the request is whole: the app's time is its own
            self._stop_clock()

    def handle_websocket_upgrade(self, event) -> None:
        self._stop_clock()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            message = f"The request did not arrive within {self.timeout} seconds.".encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(message), message))
        self.transport.close()


async def _answer(send, status: int, message: str) -> None:
    """A plain-text answer that closes the connection (what is left of the request is never read)."""
    body = message.encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":  # as a Space's app.py
    if not os.environ.get("MODEL_ID"):
        raise SystemExit("Set MODEL_ID to the model to serve: a Hub repository (user/name) or a model folder.")
    try:
        limits = Limits.from_environment()
    except ValueError as err:
        raise SystemExit(str(err)) from None
    serve(os.environ["MODEL_ID"], limits=limits)
