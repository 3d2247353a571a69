"""Every writer killed (SIGKILL) at its worst moment: all written, nothing published yet.

Each writer runs in a child python whose `staging._move` (the one rename that publishes, in staging.py)
kills the child right before it renames the file named in the table. The test then shows that what the
writer publishes is the old content or absent, never half, that a staging entry was left, and that the
next run or save in that folder removes it and touches nothing without the prefix.

    writer                                   file(s)                                  the command that runs it
    tokenizer.save_tokenizer                 tokenizer.json, tokenizer_config.json    train, train-tokenizer
    hub.save_model_files                     model.safetensors, config.json, code...  train, quickstart
    hub.write_results                        results.json                             train, quickstart
    hub.write_model_card                     README.md                                train, quickstart
    hub.write_model_card (_draw_attention)   attention.png                            train, quickstart
    hub._retarget_card_file                  README.md                                push
    export.ctranslate2.export_ctranslate2    model.bin, config.json, ...              export --format ctranslate2
    cli.evaluate (staging.write_file_whole)  --hypotheses-out, --references-out       evaluate
    visualize.explorer.save_explorer         explorer.html                            attention --html
    visualize.app.make_translate             explorer-<hash>.html (a served page)     serve
    visualize.attention_maps.save_attention_maps  <kind>_layer<N>.png, overview.png, bertviz.pt   attention
    training.task.prepare_tokenizer          checkpoints/tokenizer_options.json       train
    training.checkpoints.save_run_config     checkpoints/config.json                  train
    training.logs.TrainingLog                training_log.jsonl                       train --resume
    training.checkpoints.save_checkpoint     checkpoints/checkpoint-<step>/           train
    training.checkpoints.newest_sound_checkpoint  damaged-checkpoint-<step>/ (a rename)  train --resume
    training.finetuning.save_adapter         adapter/                                 train --lora-rank
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pytest

from vanilla_transformer.staging import STAGING_PREFIX

pytestmark = pytest.mark.slow

CHILD = """
import fnmatch, os, signal, sys
sys.path.insert(0, sys.argv[1])
from vanilla_transformer import staging
import test_kill_writers

real_move = staging._move

def kill_before(source, destination):
    if fnmatch.fnmatch(os.path.basename(destination), os.environ["KILL_BEFORE"]):
        os.kill(os.getpid(), signal.SIGKILL)  # all written, nothing of it published: the worst moment
    real_move(source, destination)

staging._move = kill_before
test_kill_writers.WRITERS[sys.argv[2]].write(sys.argv[3], sys.argv[4], "new")
"""
FOREIGN = ("notes.txt", ".staging-mine", f"x{STAGING_PREFIX}y")  # a user's files: never touched


def _model(model_dir):
    from vanilla_transformer import VanillaTransformerForConditionalGeneration
    from vanilla_transformer.inference import load_tokenizer

    return VanillaTransformerForConditionalGeneration.from_pretrained(model_dir), load_tokenizer(model_dir)


def _record(model_dir, variant):
    from vanilla_transformer.visualize.attention_maps import collect_attentions

    model, tokenizer = _model(model_dir)
    return collect_attentions(model, tokenizer, "Jesus wept." if variant == "old" else "Love is patient.", num_beams=1)


def _tokenizer(out, model_dir, variant):
    from vanilla_transformer.tokenizer import save_tokenizer

    tokenizer = _model(model_dir)[1]
    tokenizer.model_max_length = 100 if variant == "old" else 200
    save_tokenizer(tokenizer, out)


def _model_files(out, model_dir, variant):
    from vanilla_transformer.hub import save_model_files

    model, tokenizer = _model(model_dir)
    model.config.update({"dataset_name": variant})
    save_model_files(model, tokenizer, out)


def _results(out, model_dir, variant):
    from vanilla_transformer.hub import write_results

    write_results(out, {"split": variant})


def _card(out, model_dir, variant):
    from vanilla_transformer.hub import write_model_card

    model, tokenizer = _model(model_dir)
    example = "Jesus wept." if variant == "old" else "Love is patient."
    write_model_card(model, tokenizer, out, {"bleu": 1.0}, example=example, dataset=variant)


def _retarget(out, model_dir, variant):
    from vanilla_transformer.hub import _retarget_card_file

    _retarget_card_file(Path(out) / "README.md", f"someone/{variant}")


def _export(out, model_dir, variant):
    from vanilla_transformer.export.ctranslate2 import export_ctranslate2

    if variant != "old":  # an export goes to a new folder: there is no old one
        export_ctranslate2(*_model(model_dir), Path(out) / "ct2")


def _hypotheses(out, model_dir, variant):
    from vanilla_transformer.staging import write_file_whole

    write_file_whole(Path(out) / "hypotheses.txt", f"{variant} line\n" * 3)  # as evaluate writes them


def _explorer(out, model_dir, variant):
    from vanilla_transformer.visualize.explorer import save_explorer

    save_explorer(_record(model_dir, variant), Path(out) / "explorer.html")


def _served_page(out, model_dir, variant):
    from vanilla_transformer.visualize import app

    translate = app.make_translate(*_model(model_dir), app.Limits(max_new_tokens=5), out)
    translate("Jesus wept." if variant == "old" else "Love is patient.", 1, 0.6, 0)


def _attention_maps(out, model_dir, variant):
    from vanilla_transformer.visualize.attention_maps import save_attention_maps

    save_attention_maps(_record(model_dir, variant), Path(out) / "maps")


def _tokenizer_record(out, model_dir, variant):
    from accelerate import PartialState

    from vanilla_transformer.training.arguments import TrainArguments
    from vanilla_transformer.training.task import load_splits, prepare_tokenizer

    PartialState()  # the run's logging needs it
    data_dir = Path(out).parent / "data"
    if not data_dir.is_dir():
        data_dir.mkdir()
        pairs = [{"translation": {"src": f"a b {i % 7} c", "tgt": f"c {i % 5} b a"}} for i in range(40)]
        for split in ("train", "validation"):
            (data_dir / f"{split}.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    args = TrainArguments(output_dir=str(out), dataset=str(data_dir), vocab_size=300 if variant == "old" else 310)
    prepare_tokenizer(args, *load_splits(args))


def _run_config(out, model_dir, variant):
    from vanilla_transformer import VanillaTransformerConfig
    from vanilla_transformer.training.checkpoints import save_run_config

    root = Path(out) / "checkpoints"
    root.mkdir(exist_ok=True)
    save_run_config(VanillaTransformerConfig.from_preset("tiny", vocab_size=300 if variant == "old" else 310), root)


def _training_log(out, model_dir, variant):
    from vanilla_transformer.training.logs import TrainingLog

    if variant == "old":
        (Path(out) / "training_log.jsonl").write_text("".join(json.dumps({"step": step}) + "\n" for step in (1, 2, 3)))
    else:
        TrainingLog(out, resumed_step=1)


def _accelerated():
    import torch
    from accelerate import Accelerator

    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=300))
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model, torch.optim.Adam(model.parameters()))  # a checkpoint that verifies has both
    return accelerator


def _checkpoint(out, model_dir, variant):
    from vanilla_transformer.training.checkpoints import save_checkpoint

    save_checkpoint(_accelerated(), Path(out) / "checkpoints", 1 if variant == "old" else 2, {"note": variant})


def _damaged_checkpoint(out, model_dir, variant):
    from vanilla_transformer.training.checkpoints import newest_sound_checkpoint, save_checkpoint

    root = Path(out) / "checkpoints"
    if variant == "old":
        accelerator = _accelerated()
        save_checkpoint(accelerator, root, 1, {})
        (save_checkpoint(accelerator, root, 2, {}) / "model.safetensors").write_bytes(b"cut short")
    else:
        newest_sound_checkpoint(root)


def _adapter(out, model_dir, variant):
    from peft import LoraConfig, get_peft_model

    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
    from vanilla_transformer.training.finetuning import save_adapter

    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=300))
    lora = LoraConfig(task_type="SEQ_2_SEQ_LM", r=4 if variant == "old" else 8, target_modules=["q_proj", "v_proj"])
    save_adapter(get_peft_model(model, lora), out, None)


def _next_run(out, model_dir, variant):
    """What a training run does first in its folder: lock it and sweep it and its checkpoints/."""
    from vanilla_transformer.training.run_folder import RunLock
    from vanilla_transformer.training.run_folder import take_folder

    lock = RunLock(out)
    take_folder(lock)
    lock.release()


@dataclass
class Writer:
    write: object  # write(out, model_dir, variant): "old" is the content before, "new" the write that is killed
    files: str  # what it publishes under `out` (a pattern): the old files whole, or none of them, after the kill
    kill_before: str  # the name whose rename the child does not live to do
    next_run: object = None  # the next run or save in that folder, called as `write`; None: the same writer again
    stages: bool = True  # False: a rename alone, nothing is staged


WRITERS = {
    "tokenizer": Writer(_tokenizer, "*", "*"),
    "model": Writer(_model_files, "*", "*"),
    "results": Writer(_results, "results.json", "results.json", _model_files),
    "card": Writer(_card, "README.md", "README.md", _model_files),
    "heat map": Writer(_card, "attention.png", "attention.png", _model_files),
    "retargeted card": Writer(_retarget, "README.md", "README.md"),
    "ctranslate2": Writer(_export, "ct2/*", "*"),
    "hypotheses": Writer(_hypotheses, "hypotheses.txt", "hypotheses.txt"),
    "explorer": Writer(_explorer, "explorer.html", "explorer.html"),
    "served page": Writer(_served_page, "explorer-*.html", "explorer-*.html"),
    "attention maps": Writer(_attention_maps, "maps/*", "*"),
    "tokenizer record": Writer(_tokenizer_record, "checkpoints/*", "tokenizer_options.json", _next_run),
    "run config": Writer(_run_config, "checkpoints/config.json", "config.json", _next_run),
    "training log": Writer(_training_log, "training_log.jsonl", "training_log.jsonl", _next_run),
    "checkpoint": Writer(_checkpoint, "checkpoints/*", "checkpoint-*", _next_run),
    "damaged checkpoint": Writer(_damaged_checkpoint, "checkpoints/*", "damaged-*", _next_run, stages=False),
    "adapter": Writer(_adapter, "adapter/*", "adapter", _next_run),
}


def _published(out: Path, files: str) -> dict[str, bytes]:
    """The files under `out` that match `files`, outside staging entries, with their bytes."""
    found = {}
    for path in sorted(out.rglob("*")):
        name = path.relative_to(out)
        if path.is_file() and fnmatch(str(name), files) and not any(part.startswith(STAGING_PREFIX) for part in name.parts):
            found[str(name)] = path.read_bytes()
    return found


def _staged(out: Path) -> list[Path]:
    return [path for path in out.rglob(f"{STAGING_PREFIX}*")]


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_writer_killed_before_it_publishes_leaves_the_old_files_and_the_next_run_sweeps(name, hub_tiny_folder, tmp_path):
    writer = WRITERS[name]
    out = tmp_path / "out"
    out.mkdir()
    if writer.write is _retarget:
        _card(out, hub_tiny_folder, "old")
    for foreign in FOREIGN:
        (out / foreign).write_text("mine")
    writer.write(out, hub_tiny_folder, "old")
    before = _published(out, writer.files)

    env = {**os.environ, "KILL_BEFORE": writer.kill_before, "HF_HUB_OFFLINE": "1"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), name, str(out), str(hub_tiny_folder)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert _published(out, writer.files) in (before, {})  # the old files whole, or none: never half of the new ones
    assert bool(_staged(out)) == writer.stages

    (writer.next_run or writer.write)(out, hub_tiny_folder, "new")
    assert _staged(out) == []
    assert all((out / foreign).read_text() == "mine" for foreign in FOREIGN)
