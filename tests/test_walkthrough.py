"""The walkthrough notebook (notebooks/walkthrough.py, jupytext's percent format) runs headless and shows what it
says: the shapes at each step, the plain classes, the masks, attention by hand equal to the model's, label
smoothing's target, the beams' scores, the notes' table and at least eight figures."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "walkthrough.py"


def _outputs(notebook) -> tuple[str, list[str], int]:
    """The notebook's printed text, its Markdown outputs and its number of figures; an error fails here."""
    text, markdown, figures = [], [], 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", f"{output['ename']}: {output['evalue']}"
            if output["output_type"] == "stream":
                text.append(output["text"])
            data = output.get("data", {})
            figures += "image/png" in data
            if "text/markdown" in data:
                markdown.append(data["text/markdown"])
    return "".join(text), markdown, figures


@pytest.mark.slow
def test_the_walkthrough_runs_headless_and_shows_each_step(tmp_path, monkeypatch):
    import jupytext  # the test extra's, with nbclient
    import nbclient

    # A small budget; the toy model even where the demo's model was trained (the toy's numbers are known here).
    for name, value in {"WALKTHROUGH_MODEL": str(tmp_path / "no-model"), "WALKTHROUGH_MODEL_STEPS": "150",
                        "WALKTHROUGH_STUDY_STEPS": "4", "WALKTHROUGH_OUTPUT": str(tmp_path / "study"),
                        "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}.items():
        monkeypatch.setenv(name, value)
    notebook = jupytext.read(NOTEBOOK)
    nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    text, markdown, figures = _outputs(notebook)

    assert figures >= 8, f"{figures} figures"
    assert "attention: eager | fast_paths: False" in text
    classes = re.search(r"classes: \[(.*)\]", text).group(1)
    assert "'MultiHeadAttention'" in classes and "'LabelSmoothedCrossEntropy'" in classes
    assert "Fused" not in classes and "ClosedForm" not in classes and "Packable" not in classes
    for shown in ("input_ids shape (B, S): (2, 7)", "sinusoidal_encoding shape (positions, d_model): (50, 64)",
                  "Embeddings output shape (B, S, d_model): (2, 7, 64)",
                  "encoder mask shape (B, 1, queries, keys): (2, 1, 7, 7), visible pairs of sentence 2: 35 of 49",
                  "Q, K, V shape (B, heads, S, d_k): (2, 4, 7, 16)", "scores and weights shape (B, heads, S, S): (2, 4, 7, 7)",
                  "logits shape (B, T, V): (2, ", "ε = 0.1, V = 32: q(gold) = 0.9031, q(other) = 0.00313, sum = 1.0000",
                  "peak: paper 6.99e-04 at step 4000"):
        assert shown in text, shown
    # The look-ahead mask: query t sees keys 0..t of the decoder's own positions, never a later one.
    decoder = re.search(r"decoder mask shape \(B, 1, queries, keys\): \(2, 1, (\d+), \1\)", text)
    assert decoder, "the decoder's mask is square"
    difference = float(re.search(r"largest difference from the model's own weights: (\S+)", text).group(1))
    assert difference < 1e-5
    accuracy = float(re.search(r"held-out token accuracy (\S+) \(chance 0\.034\)", text).group(1))
    assert accuracy > 0.1, "the toy model learned beyond chance"
    scores = [float(s) for s in re.findall(r"beam \d: score (\S+)", text)]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)
    assert re.search(r"^greedy: \S", text, flags=re.M)
    (table,) = [m for m in markdown if "| option |" in m]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "option" not in line]
    assert len(rows) == 11 and rows[0].startswith("| scaled_dot |") and "Chance token accuracy: 0.034" in table
    assert (tmp_path / "study" / "attention-study.png").is_file()
    assert re.search(r"walkthrough ran in \d+ s on \d+ cores", text)


@pytest.mark.slow
def test_the_walkthrough_reads_a_trained_folder_when_there_is_one(hub_tiny_folder, tmp_path, monkeypatch):
    """The demo's model branch: a saved folder, its tokenizer's words on the axes, the same steps and figures."""
    import jupytext
    import nbclient

    for name, value in {"WALKTHROUGH_MODEL": str(hub_tiny_folder), "WALKTHROUGH_STUDY_STEPS": "1",
                        "WALKTHROUGH_OUTPUT": str(tmp_path / "study"), "HF_HUB_OFFLINE": "1",
                        "PYTHONPATH": str(ROOT)}.items():
        monkeypatch.setenv(name, value)
    notebook = jupytext.read(NOTEBOOK)
    nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    text, _, figures = _outputs(notebook)
    assert figures >= 8 and f"the demo's model from {hub_tiny_folder}" in text
    assert "'Jesus wept.' -> [" in text and "Ġ" not in text and "Ã" not in text  # words, not byte-level symbols
    assert float(re.search(r"largest difference from the model's own weights: (\S+)", text).group(1)) < 1e-5
    assert len(re.findall(r"beam \d: score", text)) == 4
