"""The attention explorer and the web app in a real browser (headless Chromium, every outside request blocked
and counted). Without a browser these tests are skipped with the reason; CI installs one and runs them."""

import base64
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import vanilla_transformer
from vanilla_transformer.modeling.configuration_vanilla_transformer import ATTENTION_SCORES, VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.visualize.attention_maps import DECODER_ROWS
from vanilla_transformer.visualize.explorer import explorer_data, explorer_record, save_explorer
from vanilla_transformer.inference import translate_texts

pytestmark = pytest.mark.slow  # every test drives a Chromium process

SENTENCE = "Jesús wept; ¿why? In the beginning God created the heavens and the earth."
LINES = "svg.links line"


class Watched:
    """A page whose console errors, uncaught exceptions and requests are recorded; every request to an address
    other than `allowed` (a prefix) is blocked."""

    def __init__(self, browser, allowed: str):
        self.context = browser.new_context(viewport={"width": 1200, "height": 900})
        self.requests, self.blocked, self.errors = [], [], []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.allowed = allowed

    def _route(self, route):
        if route.request.url.startswith(self.allowed):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def close(self):
        self.context.close()


def _lines(page) -> str:
    """What the lines view draws, as text: each line's ends and opacity."""
    return page.eval_on_selector_all(LINES, "ls => ls.map(l => [l.getAttribute('y1'), l.getAttribute('y2'), l.getAttribute('stroke-opacity')].join()).join(';')")


def _heat(page) -> str:
    return page.eval_on_selector("canvas.heat", "c => c.toDataURL()")


def _quantized(packed) -> torch.Tensor:
    """The page's weights of one kind, as the page holds them (dense)."""
    values = torch.frombuffer(bytearray(base64.b64decode(packed["values"])), dtype=torch.uint8).float() / 255
    return values.view(packed["layers"], packed["heads"], packed["queries"], packed["keys"])


def _click(page, group: str, value) -> None:
    page.click(f'#{group} button[data-value="{value}"]')


@pytest.fixture(scope="module")
def explorer_file(hub_tiny_model, tmp_path_factory):
    model, tokenizer = hub_tiny_model
    record = explorer_record(model, tokenizer, SENTENCE, num_beams=1, max_new_tokens=10)
    return record, save_explorer(record, tmp_path_factory.mktemp("explorer") / "explorer.html")


def test_the_explorer_renders_offline_switches_views_and_highlights_hovered_lines(chromium, explorer_file, tmp_path):
    record, path = explorer_file
    watched = Watched(chromium, allowed=path.as_uri())
    page = watched.page
    start = time.perf_counter()
    page.goto(path.as_uri())
    page.wait_for_selector(LINES)
    print(f"explorer rendered in {time.perf_counter() - start:.2f} s")

    # Readable tokens, no byte-level symbols; pieces inside a word are marked as joined to it.
    body = page.inner_text("body")
    assert "Ġ" not in body and "Ã" not in body and SENTENCE in body
    pieces, special = record.source_pieces, [i in record.special_ids for i in record.source_ids]
    starts = [i == 0 or special[i] or special[i - 1] or piece[:1].isspace() for i, piece in enumerate(pieces)]
    assert page.locator(".col.keys .tok .j").count() == starts.count(False) > 0  # keys: the source, in cross-attention
    assert page.locator("#src-text .word").count() == starts.count(True)
    assert page.locator(".col.queries .tok").count() == len(record.target_ids) - 1  # each token written

    # Switching kind, layer and head changes what is drawn.
    seen = {_lines(page)}
    for group, value in (("layers", 0), ("heads", 1), ("kinds", "decoder"), ("kinds", "encoder"), ("heads", -1)):
        _click(page, group, value)
        drawn = _lines(page)
        assert drawn and drawn not in seen, f"{group}={value} drew nothing new"
        seen.add(drawn)
    assert page.locator(".col.keys .tok").count() == len(record.source_ids)  # encoder: source against source
    _click(page, "kinds", "decoder")
    assert page.locator(".col.keys .tok").first.inner_text() == "<start>"
    _click(page, "views", "heat")
    maps = {_heat(page)}
    for group, value in (("heads", 2), ("layers", 1), ("kinds", "cross")):
        _click(page, group, value)
        maps.add(_heat(page))
    assert len(maps) == 4

    # Hovering a token shows its lines, as many as it has non-zero weights, and the weights beside the tokens.
    _click(page, "views", "lines")
    _click(page, "heads", -1)
    cross = _quantized(explorer_data(record)["weights"]["cross"])[1]  # layer 2, every head
    overview = page.locator(LINES).count()
    assert overview == int((cross.mean(0) > 0).sum())
    page.hover('.col.queries .tok[data-i="1"]')
    assert page.locator(f"{LINES}.focus").count() == page.locator(LINES).count() == int((cross[:, 1].sum(0) > 0).sum())
    assert page.locator(".col.queries .tok.focus").get_attribute("data-i") == "1"
    assert page.locator(".col.keys .tok.weighted").count() == int((cross[:, 1].sum(0) > 0).sum())
    page.hover('.col.keys .tok[data-i="0"]')
    assert page.locator(f"{LINES}.focus").count() == int((cross[:, :, 0].sum(0) > 0).sum())
    page.mouse.move(5, 5)
    assert page.locator(f"{LINES}.focus").count() == 0 and page.locator(LINES).count() == overview

    # Stepping through the translation: step 2 shows what the decoder attended to while writing its second token.
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    written = page.locator("#tgt-text .writing").inner_text()
    assert f"Step 2 of {len(record.target_ids) - 1}" in page.inner_text("#what") and written in page.inner_text("#what")
    row = cross.mean(0)[1]
    shown = [float(w or 0) for w in page.eval_on_selector_all("#src-text .piece", "ps => ps.map(p => p.style.getPropertyValue('--w'))")]
    assert shown == pytest.approx(row.tolist(), abs=1e-3)
    assert page.locator(f"{LINES}.focus").count() == int((cross[:, 1].sum(0) > 0).sum())  # the step's query

    screenshot = page.screenshot(path=tmp_path / "explorer.png", full_page=True)
    assert screenshot[:8] == b"\x89PNG\r\n\x1a\n" and len(screenshot) > 20_000
    assert watched.errors == []
    assert watched.blocked == [] and watched.requests == [path.as_uri()]  # the page itself, nothing else
    watched.close()


def _pressed(page) -> dict:
    """What the controls show: the pressed button of each group, the step and the neuron view's query."""
    shown = {group: page.locator(f"#{group} button[aria-pressed=true]").get_attribute("data-value")
             for group in ("kinds", "layers", "heads", "views")}
    shown["step"] = page.input_value("#slider")
    if shown["views"] == "neuron":
        shown["query"] = page.locator("#nv-queries button[aria-pressed=true]").get_attribute("data-query")
    return shown


def test_decoder_rows_are_the_token_read_and_the_page_says_so(chromium, explorer_file):
    """As in the PNGs and bertviz: the first decoder row is the start token, the last the last token but one."""
    record, path = explorer_file
    watched = Watched(chromium, allowed=path.as_uri())
    page = watched.page
    page.goto(path.as_uri())
    page.wait_for_selector(LINES)
    for kind in ("cross", "decoder"):
        _click(page, "kinds", kind)
        for view in ("lines", "heat"):
            _click(page, "views", view)
            assert DECODER_ROWS in page.inner_text("#rows-note").lower(), (kind, view)
        _click(page, "views", "lines")
        rows = page.eval_on_selector_all(".col.queries .tok", "ts => ts.map(t => t.textContent.replace('\u2011', ''))")
        assert rows[0] == "<start>" and rows == record.target_labels, kind
    _click(page, "views", "neuron")
    assert "the token read" in page.inner_text("#nv-queries")
    assert watched.errors == []
    watched.close()


def test_the_address_keeps_what_is_shown_and_a_reload_or_a_link_shows_it_again(chromium, explorer_file):
    record, path = explorer_file
    watched = Watched(chromium, allowed=path.as_uri())
    page = watched.page
    page.goto(path.as_uri())
    page.wait_for_selector(LINES)
    _click(page, "kinds", "decoder")
    _click(page, "layers", 0)
    _click(page, "heads", 2)
    _click(page, "views", "heat")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    shown, url = _pressed(page), page.url
    assert shown == {"kinds": "decoder", "layers": "0", "heads": "2", "views": "heat", "step": "2"}
    assert "#" in url and "kind=decoder" in url and "view=heat" in url
    drawn = _heat(page)
    page.reload()
    page.wait_for_selector("canvas.heat")
    assert _pressed(page) == shown and _heat(page) == drawn
    other = watched.context.new_page()  # a link opened afresh
    other.goto(url)
    other.wait_for_selector("canvas.heat")
    assert _pressed(other) == shown
    _click(other, "views", "neuron")
    _click(other, "kinds", "encoder")
    other.click('#nv-queries button[data-query="3"]')
    shown = _pressed(other)
    assert shown["query"] == "3" and shown["kinds"] == "encoder"
    page.goto(other.url)  # the same file with another hash: the page follows it
    page.wait_for_selector("#nv-queries")
    assert _pressed(page) == shown
    page.goto("about:blank")
    page.goto(path.as_uri() + "#kind=nothing&layer=99&head=-4&view=x&step=1e9&query=0")  # ignored, not an error
    page.wait_for_selector(LINES)
    assert _pressed(page) == {"kinds": "cross", "layers": "1", "heads": "-1", "views": "lines", "step": "0"}
    assert watched.errors == [] and watched.blocked == []
    watched.close()


def test_the_neuron_view_shows_the_models_numbers_for_the_chosen_kind_layer_head_and_query(chromium, explorer_file, tmp_path):
    record, path = explorer_file
    watched = Watched(chromium, allowed=path.as_uri())
    page = watched.page
    page.goto(path.as_uri())
    page.wait_for_selector(LINES)
    _click(page, "views", "neuron")
    assert page.locator('#heads button[data-value="-1"]').is_disabled()  # one head at a time, not their mean
    dh = record.neurons.kinds["cross"].queries.size(-1)
    for kind, layer, head, query in (("cross", 1, 2, 3), ("decoder", 0, 1, 4), ("encoder", 1, 3, 6)):
        _click(page, "kinds", kind)
        _click(page, "layers", layer)
        _click(page, "heads", head)
        page.click(f'#nv-queries button[data-query="{query}"]')
        assert page.locator("#nv-queries button[aria-pressed=true]").get_attribute("data-query") == str(query)
        numbers = record.neurons.kinds[kind]
        keys = numbers.scores.size(-1)
        assert page.locator("td.score").count() == page.locator("td.wt").count() == keys
        # the query's vector, square by square, as the hover titles give it
        q = [float(title.rsplit("= ", 1)[1]) for title in page.eval_on_selector_all("tbody tr.first:first-child .cells span", "s => s.map(x => x.title)")]
        assert q == pytest.approx(numbers.queries[layer, head, query].tolist(), abs=2e-3, rel=2e-3) and len(q) == dh
        shown = [float(text) for text in page.eval_on_selector_all("td.score", "s => s.map(x => x.textContent)")]
        assert shown == pytest.approx(numbers.scores[layer, head, query].tolist(), abs=2e-3, rel=2e-3)
        weights = [float(w) for w in page.eval_on_selector_all("td.wt", "s => s.map(x => x.dataset.weight)")]
        assert weights == pytest.approx(numbers.weights[layer, head, query].tolist(), abs=1e-3)
        j = int(numbers.weights[layer, head, query].argmax())
        assert "/ \u221a16" in page.get_attribute(f'td.score[data-key="{j}"]', "title")  # scaled dot product: q·k / √Dh
        if kind == "decoder":  # the look-ahead mask: keys after the query are greyed, their weight 0
            assert page.locator("tr.masked td.wt").count() == keys - query - 1
    _click(page, "kinds", "cross")
    page.keyboard.press("ArrowRight")  # a step of the translation picks its query: the token being written
    page.keyboard.press("ArrowRight")
    assert page.locator("#nv-queries button[aria-pressed=true]").get_attribute("data-query") == "1"
    screenshot = page.screenshot(path=tmp_path / "neuron.png", full_page=True)
    assert screenshot[:8] == b"\x89PNG\r\n\x1a\n"
    assert watched.errors == [] and watched.requests == [path.as_uri()]
    watched.close()


def test_the_neuron_view_draws_every_score_function_from_its_score_drawing(chromium, tiny_corpus, tmp_path):
    """The page draws each score function as its entry in score_drawings.py says: its rows for each key, and the
    steps from them (on the score's hover title) end at the model's score."""
    tokenizer = tiny_corpus[0]
    for score in ATTENTION_SCORES:
        torch.manual_seed(0)
        config = VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), attention_score=score)
        model = VanillaTransformerForConditionalGeneration(config).eval()
        record = explorer_record(model, tokenizer, SENTENCE, num_beams=1, max_new_tokens=6)
        path = save_explorer(record, tmp_path / f"{score}.html")
        drawing = explorer_data(record)["neurons"]["drawing"]
        watched = Watched(chromium, allowed=path.as_uri())
        page = watched.page
        page.goto(path.as_uri())
        page.wait_for_selector(LINES)
        _click(page, "views", "neuron")
        _click(page, "kinds", "cross")
        _click(page, "layers", 0)
        _click(page, "heads", 1)
        page.click('#nv-queries button[data-query="2"]')
        keys = record.neurons.kinds["cross"].scores.size(-1)
        names = [name for name, *_ in drawing["rows"]]
        assert page.eval_on_selector_all("tbody th", "s => s.map(x => x.textContent)")[-len(names):] == names
        assert page.locator("tbody .cells").count() == 1 + len(drawing["top"]) + keys * len(names)
        titles = page.eval_on_selector_all("td.score", "s => s.map(x => x.title)")
        last_steps = [float(title.split("  \u00b7  ")[0].rsplit("= ", 1)[1]) for title in titles]
        assert last_steps == pytest.approx(record.neurons.kinds["cross"].scores[0, 1, 2].tolist(), abs=2e-2, rel=1e-2), score
        assert watched.errors == [], score
        watched.close()


def test_a_1000_token_sentence_stays_usable(chromium, synthetic_record, tmp_path):
    """3 + 3 layers, 4 heads, 1,000 tokens a side: the page keeps each query's strongest keys, draws the strongest
    lines until a token is hovered or a step chosen, holds the neuron view of the heads that fit, and answers in
    well under a second once loaded."""
    record = synthetic_record(1000, 1000, neurons=True)
    path = save_explorer(record, tmp_path / "long.html")
    watched = Watched(chromium, allowed=path.as_uri())
    page = watched.page
    start = time.perf_counter()
    page.goto(path.as_uri())
    page.wait_for_selector(LINES)
    loaded = time.perf_counter() - start
    assert "keeps only the" in page.inner_text("#note")
    assert page.locator(LINES).count() == 4000 and "4,000 strongest" in page.inner_text("#lines-note")
    start = time.perf_counter()
    page.hover('.col.queries .tok[data-i="500"]')
    keep = explorer_data(record)["weights"]["cross"]["keep"]
    assert keep <= page.locator(f"{LINES}.focus").count() <= 4 * keep  # the union of the heads' strongest keys
    page.keyboard.press("ArrowRight")
    assert "Step 1 of 1000" in page.inner_text("#what")
    _click(page, "views", "heat")
    assert page.eval_on_selector("canvas.heat", "c => c.width") >= 1000
    _click(page, "views", "neuron")  # the heads that fit, and the first 8 query tokens of each kind
    neurons = explorer_data(record)["neurons"]
    assert f"holds {neurons['kept']} of the 36 heads" in page.inner_text("#note") and "first 8 of 1000 query tokens" in page.inner_text("#note")
    assert page.locator("#nv-queries button:disabled").count() == 1000 - 8
    assert page.locator('#layers button[data-value="2"]').is_disabled() and page.locator("td.score").count() == 64  # the strongest keys
    answered = time.perf_counter() - start
    print(f"1,000 tokens: {path.stat().st_size / 1e6:.1f} MB, loaded in {loaded:.1f} s, hover + step + heat map + neuron view in {answered:.1f} s")
    assert loaded < 20 and answered < 10  # generous: a shared 2-core machine
    assert watched.errors == [] and watched.requests == [path.as_uri()]
    watched.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(process, url: str, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the app exited ({process.returncode}):\n{process.stdout.read()}")
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"the app did not answer at {url} within {seconds} s")


@pytest.mark.parametrize("launch", ["cli", "space"])
def test_the_web_app_translates_a_sentence_typed_in_a_browser(launch, chromium, hub_tiny_folder, hub_tiny_model, tmp_path):
    """`vanilla-transformer serve`, and app.py run as a Hub Space runs it (MODEL_ID, GRADIO_SERVER_PORT), on a
    loopback port: type, click, read the translation and the explorer; then shut it down."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if launch == "cli":
        argv = [sys.executable, "-m", "vanilla_transformer.cli", "serve", "--model", str(hub_tiny_folder), "--port", str(port)]
    else:  # a Space: its app.py is this file, the package comes from requirements.txt
        shutil.copy(Path(vanilla_transformer.__file__).parent / "visualize" / "app.py", tmp_path / "app.py")
        argv = [sys.executable, "app.py"]
        env.update(MODEL_ID=str(hub_tiny_folder), GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(vanilla_transformer.__file__).parents[1]), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               stdin=subprocess.DEVNULL)
    watched = None
    try:
        _wait_for_server(process, url)
        started = time.perf_counter() - start
        watched = Watched(chromium, allowed=f"http://127.0.0.1:{port}/")
        page = watched.page
        page.goto(url)
        sentence = "In the beginning God created the heavens and the earth."
        if launch == "cli":  # an empty sentence gets a clear message
            page.click("#translate")
            page.get_by_text("The sentence is empty").first.wait_for(timeout=60_000)
        page.fill("#sentence textarea", sentence)
        start = time.perf_counter()
        page.click("#translate")
        page.wait_for_function("document.querySelector('#translation textarea').value.length > 0", timeout=120_000)
        answered = time.perf_counter() - start
        translation = page.input_value("#translation textarea")
        model, tokenizer = hub_tiny_model
        assert translation == translate_texts(model, tokenizer, [sentence])[0]  # the model's own decoding (beam 4, §6.1)
        frame = page.frame_locator("#explorer iframe")
        assert frame.locator("#translation").inner_text() == translation
        assert frame.locator(LINES).count() > 0
        assert watched.blocked == []  # nothing from any other host: fonts, scripts, analytics
        print(f"{launch}: app answered after {started:.1f} s, translated in {answered:.1f} s")
    finally:
        if watched:
            watched.close()
        process.terminate()
        process.wait(timeout=60)
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)
