"""What makes a saved model folder load anywhere with `trust_remote_code=True`, however it was saved
(`save_pretrained`, `Trainer.save_model`, PEFT's `merge_and_unload()`, `push_to_hub`): the Auto classes
and the `translation` pipeline named in config.json, and the code files beside the weights.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library and the pipeline file beside it. The models take `save_pretrained` from `CustomCodeMixin`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# The pipeline that config.json names; imported, so that transformers copies its file with the model's code
from .pipeline_vanilla_transformer import CUSTOM_PIPELINES

# Every Auto class that can load a saved folder. `register_for_auto_class` records only the class
# that is being saved, so a folder saved from the seq2seq model would not load with AutoModel.
AUTO_MAP = {
    "AutoConfig": "configuration_vanilla_transformer.VanillaTransformerConfig",
    "AutoModel": "modeling_vanilla_transformer.VanillaTransformerModel",
    "AutoModelForSeq2SeqLM": "modeling_vanilla_transformer.VanillaTransformerForConditionalGeneration",
}
# The model's code, saved beside its weights. transformers copies a model file and what it imports
# relatively when it loads or saves custom code, but not when the model came from a Hub repository:
# `copy_code_files` copies them itself.
CODE_FILES = (
    "configuration_vanilla_transformer.py",
    "modeling_vanilla_transformer.py",
    "attention.py",
    "attention_variants.py",
    "input_checks.py",
    "value_checks.py",
    "saving.py",
    "fast_modeling.py",
    "generation.py",
    "search.py",
    "pipeline_vanilla_transformer.py",
)


def set_auto_map_and_pipelines(config) -> None:
    """Write the Auto classes (`auto_map`) and the `translation` pipeline (`custom_pipelines`) into `config`."""
    config.auto_map = {**(getattr(config, "auto_map", None) or {}), **AUTO_MAP}
    config.custom_pipelines = CUSTOM_PIPELINES


def copy_code_files(save_directory) -> None:
    """Copy the code files that are not in `save_directory` yet into it."""
    here = Path(__file__).parent
    for name in CODE_FILES:
        if not (Path(save_directory) / name).is_file():
            shutil.copyfile(here / name, Path(save_directory) / name)


class CustomCodeMixin:
    """The models' `save_pretrained`: transformers' own (the next class in the model's bases), then the Auto
    classes and the pipeline in config.json and the code files beside the weights, whichever way the folder
    is saved (transformers' `Trainer`, PEFT's `merge_and_unload()` and `push_to_hub` call it too)."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        set_auto_map_and_pipelines(self.config)
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            copy_code_files(save_directory)
        return result
