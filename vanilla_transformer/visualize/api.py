"""`serve`'s JSON endpoint, for programs: texts and decoding options in, translations out.

    curl -s http://127.0.0.1:7860/v1/translate -H 'Content-Type: application/json' \
        -d '{"texts": ["Jesus wept.", "Love is patient."], "num_beams": 4, "with_scores": true}'
    # {"translations": ["Jesús lloró.", ...], "scores": [-1.93, ...]}

The body is a JSON object: `texts` (a list of 1 to `max_texts` strings) and, each optional, `num_beams`,
`max_new_tokens`, `length_penalty`, `with_scores` (the log-probability each translation is ranked by) and
`attention` (the last layer's cross-attention, mean of the heads, with both sides' tokens). The requests
waiting when the model is free are decoded as one batch (at most `max_texts` texts, all with the same
options), as OpenNMT-py's REST server and CTranslate2's batch readers batch theirs; the header
`X-Batch-Texts` says how many texts the batch held. A request beyond a limit, or malformed, is answered
4xx with `{"error": "one line"}`; more than `max_queued` requests waiting, 429.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from ..checks.files import parse_json
from ..modeling.value_checks import check_decoding_options

__all__ = ["ROUTE", "Batcher", "Refused", "json_route", "parse_request"]

ROUTE = "/v1/translate"
FLAGS = ("with_scores", "attention")
NUMBERS = ("num_beams", "max_new_tokens", "length_penalty")


class Refused(ValueError):
    """A request the endpoint does not serve: answered `status` with its one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, limits, longest_text: int) -> tuple[list[str], dict]:
    """(texts, options) of a request's body, or Refused naming the field and what it must be."""
    try:
        request = parse_json(body, "the body")
    except (ValueError, UnicodeDecodeError):
        raise Refused("The body is not JSON: send an object such as {\"texts\": [\"Jesus wept.\"]}.") from None
    if not isinstance(request, dict):
        raise Refused("The body must be a JSON object with a list of `texts`.")
    unknown = sorted(set(request) - {"texts", *NUMBERS, *FLAGS})
    if unknown:
        raise Refused(f"Unknown field {unknown[0]!r}; the fields are texts, {', '.join(NUMBERS + FLAGS)}.")
    texts = request.get("texts")
    if not isinstance(texts, list) or not 1 <= len(texts) <= limits.max_texts or not all(isinstance(t, str) for t in texts):
        raise Refused(f"`texts` must be a list of 1 to {limits.max_texts} strings (max_texts).")
    for index, text in enumerate(texts):
        if len(text) > longest_text:  # before tokenising: the cost of that grows with the text
            raise Refused(f"texts[{index}] is {len(text)} characters long, more than the {limits.max_input_tokens} "
                          "tokens this server translates (max_input_tokens) can hold. Give a shorter sentence.")
    options = {name: request.get(name) for name in NUMBERS}
    _check_whole(options, "num_beams", limits.max_beams, "max_beams")
    _check_whole(options, "max_new_tokens", limits.max_new_tokens, "max_new_tokens")
    try:
        check_decoding_options(length_penalty=options["length_penalty"])
    except ValueError as err:
        raise Refused(str(err)) from None
    for flag in FLAGS:
        if not isinstance(request.get(flag, False), bool):
            raise Refused(f"`{flag}` must be true or false; got {request[flag]!r}.")
        options[flag] = request.get(flag, False)
    return texts, options


def _check_whole(options: dict, name: str, limit: int, limit_name: str) -> None:
    value = options[name]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit):
        raise Refused(f"`{name}` must be a whole number from 1 to {limit}, this server's limit ({limit_name}); got {value!r}.")


@dataclass
class Job:
    texts: list[str]
    options: dict
    future: Future


class Batcher:
    """Decodes the requests that wait together as one batch, in one thread: `decode(texts, options)` gives one
    answer per text; `check(texts)` refuses a request (Refused) before it joins a batch. A batch holds the
    first request waiting and those behind it with the same options, up to `max_texts` texts."""

    def __init__(self, decode, check, max_texts: int, max_queued: int):
        self.decode, self.check, self.max_texts, self.max_queued = decode, check, max_texts, max_queued
        self.waiting: collections.deque[Job] = collections.deque()
        self.changed = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="translation batches").start()

    def submit(self, texts: list[str], options: dict) -> Future:
        """A future of (answers, texts in the batch); Refused (429) when `max_queued` requests already wait."""
        with self.changed:
            if len(self.waiting) >= self.max_queued:
                raise Refused(f"{len(self.waiting)} requests are waiting, this server's limit (max_queued): "
                              "try again shortly.", status=429)
            job = Job(texts, options, Future())
            self.waiting.append(job)
            self.changed.notify()
        return job.future

    def _take(self) -> list[Job]:
        """The next batch: the first job waiting and those behind it that fit beside it."""
        with self.changed:
            while not self.waiting:
                self.changed.wait()
            batch = [self.waiting.popleft()]
            count = len(batch[0].texts)
            for job in list(self.waiting):
                if job.options == batch[0].options and count + len(job.texts) <= self.max_texts:
                    self.waiting.remove(job)
                    batch.append(job)
                    count += len(job.texts)
            return batch

    def _run(self) -> None:
        while True:
            batch = []
            for job in self._take():
                try:
                    self.check(job.texts)
                    batch.append(job)
                except Exception as err:  # Refused, or a failure of this request's own: the thread goes on
                    job.future.set_exception(err)
            if batch:
                self._decode(batch)

    def _decode(self, batch: list[Job]) -> None:
        texts = [text for job in batch for text in job.texts]
        try:
            answers = self.decode(texts, batch[0].options)
        except Exception as err:  # handed to the requests, whose handler reports it
            for job in batch:
                job.future.set_exception(err)
            return
        start = 0
        for job in batch:
            job.future.set_result((answers[start : start + len(job.texts)], len(texts)))
            start += len(job.texts)


def make_decode(model, tokenizer, limits, default_max_new_tokens: int | None, slots: threading.Semaphore):
    """(decode, check) for a `Batcher` on `model`, with a copy of `tokenizer` of their own (a fast tokenizer's
    padding and truncation settings are shared state: threads using one tokenizer disturb each other)."""
    from ..inference import translate_nbest, translate_texts
    from .attention_maps import collect_attentions

    tokenizer = copy.deepcopy(tokenizer)

    def check(texts: list[str]) -> None:
        for index, ids in enumerate(tokenizer(texts)["input_ids"]):
            if len(ids) > limits.max_input_tokens:
                raise Refused(f"texts[{index}] is {len(ids)} tokens long; this server translates at most "
                              f"{limits.max_input_tokens} (max_input_tokens). Give a shorter sentence.")

    def decode(texts: list[str], options: dict) -> list[dict]:
        settings = {name: options[name] for name in NUMBERS}
        settings["max_new_tokens"] = settings["max_new_tokens"] or default_max_new_tokens
        with slots:
            if options["with_scores"]:
                best = translate_nbest(model, tokenizer, texts, batch_size=len(texts), **settings)
                answers = [{"translation": text, "score": score} for [(text, score)] in best]
            else:
                answers = [{"translation": text} for text in
                           translate_texts(model, tokenizer, texts, batch_size=len(texts), **settings)]
            if options["attention"]:
                for answer, text in zip(answers, texts):  # each alone, as the explorer draws them
                    record = collect_attentions(model, tokenizer, text, **settings) if text.strip() else None
                    answer["attention"] = record and _attention(record)
        return answers

    return decode, check


def _attention(record) -> dict:
    """The last layer's cross-attention, mean of the heads: a row per output token, a column per source token."""
    weights = record.cross_attention[-1].mean(0)
    return {"source_tokens": record.source_pieces, "target_tokens": record.target_pieces[1:],
            "cross_attention": [[round(float(w), 4) for w in row] for row in weights]}


def json_route(batcher: Batcher, limits, longest_text: int):
    """The Starlette route of the endpoint."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def translate(request):
        try:
            texts, options = parse_request(await request.body(), limits, longest_text)
            answers, batch_texts = await asyncio.wrap_future(batcher.submit(texts, options))
        except Refused as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)
        result = {"translations": [answer["translation"] for answer in answers]}
        for field, key in (("scores", "score"), ("attentions", "attention")):
            if options["with_scores" if key == "score" else key]:
                result[field] = [answer[key] for answer in answers]
        return JSONResponse(result, headers={"X-Batch-Texts": str(batch_texts)})

    return Route(ROUTE, translate, methods=["POST"])
