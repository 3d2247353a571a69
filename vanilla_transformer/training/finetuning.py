"""Fine-tuning what trains: freezing parts of a model (`freeze`) and LoRA's low-rank adapters (`add_lora`), whose
adapter a LoRA run keeps beside its merged model (`save_adapter`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate.logging import get_logger

from ..errors import BadInput
from ..model_card import adapter_card
from ..staging import publish_files, publish_folder, staging_folder
from .run_folder import ADAPTER_DIR

__all__ = ["ADAPTER_FILES", "add_lora", "freeze", "save_adapter"]

logger = get_logger(__name__)


def freeze(model, encoder: bool = False, embeddings: bool = False) -> None:
    """Stop training the encoder's layers and/or the embeddings (token, tied output and position), before the
    optimiser is built. The token embeddings are the decoder's and the output layer's too: `encoder` leaves them."""
    shared = {id(p) for p in (*model.get_input_embeddings().parameters(), *model.get_output_embeddings().parameters())}
    frozen = {}
    if embeddings:
        for module in (model.get_encoder().embeddings, model.get_decoder().embeddings, model.get_output_embeddings()):
            frozen.update((id(p), p) for p in module.parameters())
    if encoder:
        frozen.update((id(p), p) for p in model.get_encoder().parameters() if id(p) not in shared)
    for p in frozen.values():
        p.requires_grad_(False)
    if frozen:
        parts = [what for what, asked in (("the encoder's layers", encoder), ("the embeddings", embeddings)) if asked]
        left = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info(f"frozen: {' and '.join(parts)} ({sum(p.numel() for p in frozen.values()):,} parameters); "
                    f"{left:,} train")


def add_lora(model, rank: int, alpha: float, dropout: float, target_modules: list[str]):
    """LoRA (Hu et al., 2021) with PEFT: the weights stay as they are and low-rank adapters of `target_modules`
    train; `finish` merges them into the weights, so the saved folder is a plain model, and keeps the adapter
    beside it (`save_adapter`)."""
    from peft import LoraConfig, TaskType, get_peft_model

    target_modules = [name.strip() for name in target_modules]
    widths = {name: min(module.in_features, module.out_features) for name, module in model.named_modules()
              if name.rsplit(".", 1)[-1] in target_modules and isinstance(module, torch.nn.Linear)}
    narrowest = min(widths, key=widths.get, default=None)
    if narrowest is not None and rank > widths[narrowest]:  # before PEFT allocates adapters wider than the layers
        raise BadInput(f"`lora_rank` must be at most {widths[narrowest]}, the width of {narrowest}; got {rank}.")
    config = LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules)
    try:
        model = get_peft_model(model, config)
    except ValueError as err:  # no layer of that name
        raise BadInput(f"`lora_target_modules`: {err}") from None
    trained, total = model.get_nb_trainable_parameters()
    logger.info(f"LoRA rank {rank}, alpha {alpha} on {', '.join(target_modules)}: {trained:,} of {total:,} "
                "parameters train")
    return model


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")  # what PEFT and the card write


def save_adapter(model, output_dir: str | os.PathLike, base: str | None) -> Path:
    """A LoRA run's adapter as PEFT saves it (adapter_config.json, adapter_model.safetensors) in
    `output_dir/adapter`, written whole: `PeftModel.from_pretrained(base model, that folder)` loads it. Its
    config names the `base` model (`model_name_or_path`), a local folder by its absolute path."""
    folder = Path(output_dir) / ADAPTER_DIR
    foreign = sorted(entry.name for entry in folder.iterdir() if entry.name not in ADAPTER_FILES) if folder.is_dir() else []
    if foreign:  # an earlier finish's adapter is replaced whole: never with files a user put beside it
        raise BadInput(f"{folder} holds {', '.join(foreign)}, which no run wrote there; move them out, then run the "
                       "same command with --resume to save the adapter")
    if base is not None:  # None: a model trained from a preset, which no folder holds
        model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve()) if Path(base).is_dir() else base
    lora = model.peft_config["default"]
    with staging_folder(output_dir, ADAPTER_DIR, folder) as staging:
        model.save_pretrained(staging, save_embedding_layers=False)  # LoRA trains no embeddings
        card = adapter_card(base, lora.r, lora.lora_alpha, lora.lora_dropout, sorted(lora.target_modules),
                            Path(output_dir).name)
        (staging / "README.md").write_text(card, encoding="utf-8")  # in place of PEFT's empty template
        publish_files(staging)
        publish_folder(staging, folder)  # in place of an earlier finish of this run's
    return folder
