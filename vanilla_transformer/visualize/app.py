"""A small web app for trying a model: type a sentence, read its translation, explore its attention.

    vanilla-transformer serve --model runs/quickstart        # then open http://127.0.0.1:7860

This same file is the `app.py` of a Hugging Face Space for a published model: copy it into a Gradio
Space as app.py, with a requirements.txt that names this package with its `serve` extra, and set the
Space variable MODEL_ID to the model's repository (user/name). Spaces run `python app.py`, and Gradio
takes the address from GRADIO_SERVER_NAME and GRADIO_SERVER_PORT.

The page loads nothing from other hosts: the theme uses the system's fonts, analytics are off, and
the explorer is the self-contained page of `vanilla_transformer.visualize.explorer`, shown in a sandboxed frame
(and offered as a file to keep). Gradio is an optional dependency: `pip install vanilla-transformer[serve]`.
"""

from __future__ import annotations

import hashlib
import html
import os
import tempfile
from pathlib import Path

try:
    import gradio as gr
except ImportError as err:  # an optional dependency
    raise ImportError("the web app needs Gradio: pip install 'vanilla-transformer[serve]'") from err

from vanilla_transformer.visualize.attention_maps import check_attention_support, collect_attentions
from vanilla_transformer.visualize.explorer import explorer_html
from vanilla_transformer.inference import load_model

__all__ = ["build_app", "serve"]

EXAMPLES = [
    "In the beginning, God created the heavens and the earth.",
    "Jesus wept.",
    "Love is patient and is kind.",
]


def build_app(model_name_or_path: str, device: str | None = None) -> gr.Blocks:
    """The Gradio app for one model (loaded now, so that a bad folder fails before anything is served)."""
    model, tokenizer = load_model(model_name_or_path, device)
    check_attention_support(model)
    config = model.generation_config
    pages = tempfile.TemporaryDirectory(prefix="vanilla-transformer-app-")  # lives as long as the app

    def translate(sentence: str, num_beams: float, length_penalty: float, max_new_tokens: float):
        try:
            record = collect_attentions(
                model, tokenizer, sentence, num_beams=int(num_beams), length_penalty=float(length_penalty),
                max_new_tokens=int(max_new_tokens) or None,
            )
        except (TypeError, ValueError) as err:
            raise gr.Error(str(err).replace("`text`", "The sentence"), print_exception=False) from err
        page = explorer_html(record)
        path = Path(pages.name) / f"explorer-{hashlib.sha1(page.encode()).hexdigest()[:12]}.html"
        path.write_text(page, encoding="utf-8")
        frame = (f'<iframe title="Attention explorer" sandbox="allow-scripts" srcdoc="{html.escape(page)}" '
                 'style="width: 100%; height: 1000px; border: 0"></iframe>')
        return record.translation, frame, str(path)

    with gr.Blocks(title=f"Translate with {model_name_or_path}", analytics_enabled=False) as demo:
        gr.Markdown(
            f"## Translate with `{model_name_or_path}`\n"
            "The Transformer of *Attention Is All You Need*. Type a sentence; below its translation, explore "
            "what every layer and head attended to."
        )
        sentence = gr.Textbox(label="Sentence", lines=2, placeholder=EXAMPLES[0], elem_id="sentence")
        with gr.Accordion("Decoding", open=False):
            with gr.Row():
                num_beams = gr.Slider(1, 8, value=config.num_beams or 1, step=1, label="Beam size (1: greedy)")
                length_penalty = gr.Number(value=config.length_penalty, label="Length penalty (beam search)")
                max_new_tokens = gr.Number(value=0, precision=0, minimum=0, label="Longest output in tokens (0: source length + 50)")
        button = gr.Button("Translate", variant="primary", elem_id="translate")
        translation = gr.Textbox(label="Translation", interactive=False, elem_id="translation")
        explorer = gr.HTML(elem_id="explorer")
        download = gr.File(label="The explorer as one HTML file (it works offline)", elem_id="download")
        gr.Examples(EXAMPLES, inputs=sentence)
        inputs, outputs = [sentence, num_beams, length_penalty, max_new_tokens], [translation, explorer, download]
        button.click(translate, inputs, outputs)
        sentence.submit(translate, inputs, outputs)
    return demo


def serve(model_name_or_path: str, host: str | None = None, port: int | None = None, device: str | None = None) -> None:
    """Serve the app until interrupted; `host` and `port` default to Gradio's (GRADIO_SERVER_NAME/PORT, else 127.0.0.1:7860)."""
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])  # no web fonts
    build_app(model_name_or_path, device).launch(server_name=host, server_port=port, theme=theme)


if __name__ == "__main__":  # as a Space's app.py
    if not os.environ.get("MODEL_ID"):
        raise SystemExit("Set MODEL_ID to the model to serve: a Hub repository (user/name) or a model folder.")
    serve(os.environ["MODEL_ID"])
