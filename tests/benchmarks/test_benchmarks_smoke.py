"""Smoke runs of `python -m benchmarks --quick` and `python -m benchmarks.score_functions`: each command works end to end and writes its report.

The numbers of a quick run mean nothing (tiny inputs, one repeat, a loaded CI machine); what is
checked is that every part ran, the contenders did the same work, and the report names its settings.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from vanilla_transformer.modeling.configuration_vanilla_transformer import PRESETS
from vanilla_transformer.quickstart import PRESET_SETTINGS
from vanilla_transformer.training.compute import MARGIN, cpu_computes_bf16

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # every test starts a benchmark process


def test_quick_benchmark_writes_json_and_markdown(tmp_path, hub_tiny_folder):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--threads", "1", "--out", str(tmp_path),
         "--generation-model", str(hub_tiny_folder)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (json_path,) = tmp_path.glob("benchmarks-*-cpu-quick.json")
    (md_path,) = tmp_path.glob("benchmarks-*-cpu-quick.md")
    assert not list(tmp_path.glob("*.tmp"))
    report = json.loads(json_path.read_text())

    env_info = report["environment"]
    assert env_info["threads"] == 1 and env_info["torch"] and env_info["transformers"]
    assert report["settings"]["quick"] and report["settings"]["sizes"] == ["tiny"]

    # Training in the precisions the training loop takes here: fp32, and bf16 autocast where the CPU has it.
    precisions = report["training"]["tiny"]["precisions"]
    assert list(precisions) == (["fp32", "bf16"] if cpu_computes_bf16() else ["fp32"])
    for train in precisions.values():
        for name in ("ours", "marian"):
            assert train[name]["tokens_per_s"]["median"] > 0
            assert train[name]["peak_rss_mb"] > train[name]["peak_rss_above_imports_mb"] > 0
            assert train[name]["attention_kernels"]  # a kernel was seen by the profiler
            assert 0 < train[name]["share_of_matmul_rate"] < 1  # the step does the products and more
        assert train["ours"]["parameters"] == train["marian"]["parameters"]  # the same architecture
        assert train["ours"]["target_tokens_per_batch"] == train["marian"]["target_tokens_per_batch"]
        assert train["speedup_vs_marian"]["median"] > 0
        assert train["matmul_gflops_per_s"]["median"] > 0
        # Ours trains on the attention implementation the training loop would choose: the faster one timed.
        timed = train["ours"]["attention_seconds"]
        assert set(timed) == {"sdpa", "eager"}
        # sdpa, transformers' default, stays unless eager is MARGIN faster: a near tie keeps it.
        expected = "eager" if timed["eager"] < (1 - MARGIN) * timed["sdpa"] else "sdpa"
        assert train["ours"]["attention_chosen"] == [expected]  # one round
        chosen_kernels = ["explicit"] if expected == "eager" else ["sdpa:flash(cpu)"]
        assert train["ours"]["attention_kernels"] == chosen_kernels
        # Where ours' step goes: the top operators, then the rest, as shares of the profiled steps.
        shares = train["ours"]["profile"]["shares"]
        assert len(shares) == 10 and list(shares)[-2:] == ["other operators", "outside operators"]
        assert all(share >= 0 for share in shares.values()) and sum(shares.values()) == pytest.approx(1)
        assert {"aten::mm", "aten::addmm"} & set(shares)  # matrix products are among the top
        assert "profile" not in train["marian"]

    contenders = {"ours", "marian"}
    if importlib.util.find_spec("ctranslate2") is not None:
        contenders |= {"ctranslate2-float32", "ctranslate2-int8"}
    for size in ("tiny", "trained"):
        generation = report["generation"][size]
        for mode in ("greedy", "beam4"):
            result = generation["modes"][mode]
            assert result["ours_equals_marian"] == 1.0  # same weights, fp32: the same tokens
            assert contenders <= set(result["contenders"])
            for name in contenders:
                assert result["contenders"][name]["tokens_per_s"]["median"] > 0
                assert result["contenders"][name]["sentences_per_s"]["median"] > 0
                assert ("bleu" in result["contenders"][name]) == (size == "trained")
            assert result["contenders"]["marian"]["agrees_with_ours"] == 1.0
            for name in ("ours", "marian"):  # what decoding holds beyond the loaded model: something, not GBs
                assert 0 < result["contenders"][name]["peak_memory_mb"] < 2_000
            # Each decoding change undone, and the compiled static-cache step, decode the same tokens.
            ablations = {name: c for name, c in result["contenders"].items() if name.startswith("ours") and "," in name}
            # beam4: our loop is the GNMT one (transformers' ranking, "ours", runs in transformers' loop)
            assert len(ablations) == {"greedy": 4, "beam4": 2}[mode]
            gnmt = result["contenders"]["ours-gnmt"]["agrees_with_ours"] if mode == "beam4" else 1.0
            for name, c in ablations.items():
                assert c["agrees_with_ours"] == (gnmt if name.startswith("ours-gnmt") else 1.0), name
            if "ctranslate2-float32" in contenders:  # exported with our exporter: the same search, the same tokens
                assert result["contenders"]["ctranslate2-float32"]["agrees_with_ours"] == 1.0
    assert generation["weights"].startswith("trained")
    # The trained model's outputs are its own: varied, not one token repeated up to the cap.
    assert generation["modes"]["greedy"]["mean_distinct_tokens_per_output"] > 2
    assert report["tokenizer"]["encode_sentences_per_s"] > 0

    markdown = md_path.read_text()
    for expected in ("| tiny | fp32 | ours |", "| tiny | fp32 | marian |", "- tiny, fp32: products at", "Ours' step: ",
                     "| trained | 32 | greedy | ours |", "## Generation", "## Tokenizer", "load average"):
        assert expected in markdown
    assert ("| tiny | bf16 autocast | ours |" in markdown) == cpu_computes_bf16()

    # A second run of the day writes beside the first, not over it.
    from benchmarks.__main__ import write_report

    again = write_report(report, tmp_path)
    assert [path.name for path in again] == [json_path.stem + "-2.json", md_path.stem + "-2.md"]
    assert md_path.read_text() == markdown and json.loads(json_path.read_text()) == report


def test_ctranslate2_decodes_in_a_process_of_its_own(tmp_path, hub_tiny_model):
    """In torch's process CTranslate2 runs several times slower (and slows torch): the benchmark runs it
    in a spawned process, which decodes what CTranslate2 decodes in ours, hands errors back, and ends."""
    pytest.importorskip("ctranslate2")
    from benchmarks.generation import _ctranslate2_runner
    from vanilla_transformer.export.ctranslate2 import CTranslate2Translator, export_ctranslate2

    model, tokenizer = hub_tiny_model
    folder = export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    batches = [tokenizer(["Jesus wept.", "In the beginning God created the heaven and the earth."],
                         return_tensors="pt", padding=True)]
    runner = _ctranslate2_runner(str(folder), tokenizer, batches, "cpu", 1, 8)
    try:
        assert runner.process.pid != os.getpid()
        outputs = runner({"num_beams": 1})
        tokens = [tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"]) for text in
                  ["Jesus wept.", "In the beginning God created the heaven and the earth."]]
        here = CTranslate2Translator(folder, device="cpu", threads=1).translate_tokens(tokens, num_beams=1, max_new_tokens=8)
        assert [row[: len(mine)] for row, mine in zip(outputs, here)] == here  # (+ </s> where it ended early)
        assert runner.last_peak_mb is not None
        with pytest.raises(KeyError, match="num_beams"):  # raised in the child, handed to the parent
            runner({})
    finally:
        runner.close()
    assert not runner.process.is_alive()


def test_score_function_study_writes_its_table_and_figure(tmp_path, capsys):
    """`python -m benchmarks.score_functions` at smoke size: one score function for two steps, then another one
    crossed with a variant appended to the report (each row trains a model: two rows see every path)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.score_functions", "--steps", "2", "--score-functions", "scaled_dot",
         "--test-samples", "4", "--decode-sentences", "4", "--timing-steps", "1", "--threads", "1",
         "--out", str(tmp_path), "--figure", str(tmp_path / "figure.png")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (json_path,) = tmp_path.glob("score-functions-*-cpu.json")
    (md_path,) = tmp_path.glob("score-functions-*-cpu.md")
    report = json.loads(json_path.read_text())
    assert report["environment"]["threads"] == 1 and report["environment"]["cpu"]
    assert report["settings"]["steps"] == 2 and report["settings"]["test_samples"] == 4
    results = report["results"]
    assert list(results) == ["scaled_dot"]
    assert results["scaled_dot"]["parameters_added"] == 0
    assert results["scaled_dot"]["fused_kernel"] and results["scaled_dot"]["figure"] == str(tmp_path / "figure.png")
    image = matplotlib.image.imread(tmp_path / "figure.png")
    assert image.shape[0] > 300 and image.shape[1] > 300 and image[..., :3].std() > 0.05
    markdown = md_path.read_text()
    for expected in ("| scaled_dot | ", "val. ppl @2", "yes (sdpa", "load average"):
        assert expected in markdown

    # More rows in the same report: trained with its settings, the table and the figure redrawn with every row.
    from benchmarks.score_functions import main as study  # the refusals come before any work: no process needed

    for options, message in ((["--steps", "3"], "leave out --steps"),
                             (["--score-functions", "scaled_dot"], "already has the row(s) scaled_dot")):
        with pytest.raises(SystemExit) as refused:
            study(["--append-to", str(json_path), "--threads", "1", "--figure", str(tmp_path / "variants.png"), *options])
        assert refused.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.score_functions", "--append-to", str(json_path), "--threads", "1",
         "--figure", str(tmp_path / "variants.png"), "--score-functions", "location", "--variants", "hard"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    appended = json.loads(json_path.read_text())
    name = "location + hard (straight-through Gumbel)"
    assert list(appended["results"]) == ["scaled_dot", name]
    assert appended["results"]["scaled_dot"]["curve"] == results["scaled_dot"]["curve"]
    row = appended["results"][name]
    assert row["config"] == {"attention_score": "location", "attention_hardness": "hard"}
    assert row["run"]["command"].endswith("--variants hard")
    for r in appended["results"].values():
        assert [point["step"] for point in r["curve"]] == [1, 2]  # the report's steps, not the default
        assert all(1 < point["perplexity"] < 1e5 for point in r["curve"])  # an 8k vocabulary, barely trained
        assert r["curve"][-1]["perplexity"] == pytest.approx(r["validation_perplexity"])
        assert r["test"]["translated"] == 4 and 0 <= r["test"]["bleu"] <= 100 and 0 <= r["test"]["chrf"] <= 100
        assert r["train_tokens_per_s"] > 0 and r["decode_sentences_per_s"] > 0 and r["train_peak_memory_mb"] > 0
        assert r["figure_translation"] is not None
    # Location adds W_a (heads x d_k x 256 positions, i.e. d_model x 256) and drops W^K (d_model x d_model
    # + d_model) in each attention block: self-attention in every layer, cross-attention in the decoder's.
    shape = PRESETS[PRESET_SETTINGS["small"]["preset"]]
    blocks = shape["encoder_layers"] + 2 * shape["decoder_layers"]
    d = shape["d_model"]
    assert row["parameters_added"] == blocks * (d * 256 - (d * d + d))
    assert not row["fused_kernel"] and row["attention_kernels"] == ["explicit"]
    assert {r["figure"] for r in appended["results"].values()} == {str(tmp_path / "variants.png")}
    assert matplotlib.image.imread(tmp_path / "variants.png").shape[1] > image.shape[1]  # two panels across, not one
    markdown = md_path.read_text()
    for expected in (f"| {name} | ", "no (explicit)", "yes (sdpa", "Rows added to the report later", "What so short a run"):
        assert expected in markdown


def test_hard_attention_estimators_benchmark_writes_its_curves(tmp_path):
    """`python -m benchmarks.hard_attention` at smoke size: every estimator trains and is scored."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.hard_attention", "--steps", "4", "--out", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (json_path,) = tmp_path.glob("hard-attention-*-cpu.json")
    report = json.loads(json_path.read_text())
    assert list(report["results"]) == ["soft", "hard", "hard-reinforce", "hard-untrained-scores"]
    for r in report["results"].values():
        assert [point["step"] for point in r["curve"]] == [1, 2, 3, 4] and r["finite"]
        assert all(1 < point["perplexity"] < 1e3 and 0 <= point["accuracy"] <= 1 for point in r["curve"])
    assert "| hard, REINFORCE with a baseline | " in (tmp_path / json_path.with_suffix(".md").name).read_text()


def test_big_corpus_benchmark_reaches_the_first_step_and_reuses_its_caches(tmp_path):
    """`python -m benchmarks.big_corpus` at a tiny size: both runs reach the first step and report memory."""
    out = tmp_path / "big.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.big_corpus", "--pairs", "3000", "--runs", "2", "--workdir", str(tmp_path),
         "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(out.read_text())["results"]
    assert (first["pairs"], first["run"], second["run"]) == (3000, 1, 2)
    assert first["seconds_to_first_step"] > 0 and first["peak_rss_mib"] > 0
    assert (tmp_path / "run-3000" / "tokenizer.json").is_file()  # trained once, read back by the second run


def test_the_gpu_smoke_script_runs_quick_on_a_cpu(tmp_path):
    # Proves: `python -m benchmarks.gpu_smoke` (the first GPU run's script) runs end to end where there is no
    # GPU (--device cpu --quick: the throughput part, which drives the training loop's own step beside
    # MarianMTModel's bare step on the same bucketed batches, in TF32 and bf16) and writes its report naming the
    # device; the GPU-only parts and numbers are left out there.
    completed = subprocess.run([sys.executable, "-m", "benchmarks.gpu_smoke", "--device", "cpu", "--quick",
                                "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    (report,) = tmp_path.glob("gpu-smoke-*-cpu.json")
    throughput = json.loads(report.read_text())["throughput"]
    assert throughput["device"] == "cpu" and list(throughput["presets"]) == ["tiny"]
    tiny = throughput["presets"]["tiny"]
    assert 1 < len(tiny["shapes"]) <= 4 and tiny["max_tokens"] == 1024
    for precision in ("tf32", "bf16"):
        for name in ("ours", "marian"):
            r = tiny[precision][name]
            assert r["target_tokens_per_s"] > 0 and r["tflops_per_s"] > 0 and r["mfu"] is None  # no rated peak for a CPU
            assert r["kernels_per_step"] > 100 and r["host_ms"] > 0 and r["step_ms"] > 0
            assert r["gpu_ms"] is r["launched_kernels"] is r["peak_memory_gib"] is r["compile_seconds"] is None
        assert tiny[precision]["speedup_vs_marian"] > 0 and "ours-compiled" not in tiny[precision]
    # bf16 autocast casts; fp32 casts next to nothing.
    assert tiny["bf16"]["ours"]["casts_per_step"] > 10 * tiny["tf32"]["ours"]["casts_per_step"]
    text = report.with_suffix(".md").read_text()
    assert "# GPU smoke run" in text and "| tiny | bf16 | marian | 1,024 |" in text and "ours / Marian" in text


def test_two_ddp_processes_on_one_device_train_resume_and_average(tmp_path):
    # Proves: `python -m benchmarks.ddp_one_device` (the GPU session's DDP run) launches two processes through its
    # worker, each told it is its machine's first, which train together, save, --resume and average the last two
    # checkpoints, ending with the same weights; on a CPU with gloo, the backend its GPU run falls back to.
    completed = subprocess.run([sys.executable, "-m", "benchmarks.ddp_one_device", "--device", "cpu",
                                "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    (report,) = tmp_path.glob("ddp-one-device-*-cpu.json")
    (attempt,) = json.loads(report.read_text())["attempts"]
    assert attempt["backend"] == "gloo" and attempt["passed"]
    results = attempt["results"]
    assert results["steps"] == 6 and results["averaged_checkpoints"] == ["checkpoint-00000004", "checkpoint-00000006"]
    assert len(results["replica_checksums"]) == 2 and len(set(results["replica_checksums"])) == 1
    assert "resumed from " in attempt["resumed"]["output_tail"]
    assert "- gloo: passed" in report.with_suffix(".md").read_text()


def test_the_cpu_precision_benchmark_compares_its_variants_from_the_same_start(tmp_path):
    # Proves: `python -m benchmarks.cpu_precision` runs each variant in a process of its own from the same weights
    # and batch (their first losses agree to bf16's precision), and reports each one's rate, the matmul rate in its
    # precision, the share, a profile and its copies by cause; an unknown variant is refused in one line naming the option.
    completed = subprocess.run([sys.executable, "-m", "benchmarks.cpu_precision", "--variants", "fp32,bf16-weights",
                                "--attention", "eager", "--tokens", "256", "--rounds", "1", "--warmup", "0", "--steps", "1",
                                "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    (report,) = tmp_path.glob("cpu-precision-*-eager-256.json")
    results = json.loads(report.read_text())["results"]["256"]
    assert set(results) == {"fp32", "bf16-weights"}
    for result in results.values():
        assert result["tokens_per_s"] > 0 and result["matmul_gflops_per_s"] > 0 and 0 < result["share_of_matmul_rate"]
        assert result["profile"]["shares"]
    assert results["bf16-weights"]["copies"]["casts"]["elements"] > 0  # the loss reads bf16 logits in fp32
    assert abs(results["fp32"]["loss_first_last"][0] - results["bf16-weights"]["loss_first_last"][0]) < 0.05
    assert "| bf16-weights |" in report.with_suffix(".md").read_text()
    refused = subprocess.run([sys.executable, "-m", "benchmarks.cpu_precision", "--variants", "fp16"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "--variants takes a comma-separated subset of fp32,bf16-autocast,bf16-weights,bf16-autocast-compiled; got ['fp16']")


def test_score_function_study_trains_the_preset_named(tmp_path, capsys):
    """`--preset` picks the quickstart's size every row trains; a report's rows keep the report's."""
    import argparse

    from benchmarks.score_functions import main as study, new_settings

    args = argparse.Namespace(steps=None, timing_steps=None, preset="tiny", score_functions=["scaled_dot"],
                              test_samples=None, decode_sentences=None)
    settings = new_settings(args, "python -m benchmarks.score_functions --preset tiny")
    assert settings["model"] == {"preset": "tiny", **PRESETS["tiny"]}
    assert (settings["warmup_steps"], settings["lr_scale"]) == (PRESET_SETTINGS["tiny"]["warmup_steps"], 1.0)
    assert new_settings(argparse.Namespace(**{**vars(args), "preset": None}), "")["model"]["preset"] == "small"
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"environment": {"device": "cpu"}, "settings": {}, "results": {}}))
    with pytest.raises(SystemExit) as refused:
        study(["--append-to", str(report), "--preset", "tiny"])
    assert refused.value.code == 2 and "leave out --preset" in capsys.readouterr().err.splitlines()[-1]


def test_cli_against_pipeline_times_both_on_the_same_lines(hub_tiny_folder):
    result = subprocess.run([sys.executable, "-m", "benchmarks.cli_translate", "--model", str(hub_tiny_folder), "--lines",
                             "40"], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    first, cli, pipeline = result.stdout.splitlines()[-3:]
    assert first.startswith("40 lines, beams 1, 1 thread(s)") and first.endswith("outputs differing: 0"), first
    assert cli.lstrip().startswith("cli: ") and pipeline.startswith("pipeline: ")
