"""A LoRA adapter saved in a model folder (adapter_config.json, adapter_model.safetensors), checked as the
weights are before anything is built, then merged into the weights.

transformers applies adapter files it finds beside config.json on its own, whatever they say: a rank of
300,000 allocates gigabytes before it fails, and a base model named elsewhere is ignored. Here an adapter
is applied only when the folder was saved with it (`base_model_name_or_path` names the folder itself), and
only after its config and the shapes in its safetensors header are found to fit the model; it is then merged
into the weights, so that every command (translate, serve, export, a fine-tune) sees a plain model.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..errors import BadInput

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BEYOND_LOW_RANK", "MAX_ADAPTER_CONFIG_BYTES", "check_adapter_files", "merge_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_ADAPTER_CONFIG_BYTES = 1024 * 1024  # PEFT writes about a kilobyte; read whole, so bounded first
# LoraConfig's fields that go past low-rank updates of one rank: saved whole layers, copied layers, per-layer ranks
# and scales, DoRA's magnitudes. None of them is read from a model folder.
BEYOND_LOW_RANK = ("modules_to_save", "layer_replication", "rank_pattern", "alpha_pattern", "use_dora")


def check_adapter_files(folder: str | os.PathLike, config) -> bool:
    """Whether `folder` holds an adapter to apply (False: none), or a ValueError naming the file and field that does
    not fit the model `config` describes (its layers' widths) or this folder."""
    from .files import check_inside, read_json

    folder = Path(folder)
    weights = [name for name in (ADAPTER_WEIGHTS, "adapter_model.bin") if (folder / name).exists()]
    if not (folder / ADAPTER_CONFIG).exists():
        if weights:
            raise BadInput(f"{folder / weights[0]} is an adapter's weights without its {ADAPTER_CONFIG}; remove it, "
                           "or put back the adapter_config.json saved with it")
        return False
    for name in (ADAPTER_CONFIG, *weights):
        check_inside(folder / name)
    path = folder / ADAPTER_CONFIG
    if not path.is_file() or path.stat().st_size > MAX_ADAPTER_CONFIG_BYTES:
        raise BadInput(f"{path} is not an adapter's settings: not a file of at most {MAX_ADAPTER_CONFIG_BYTES:,} bytes")
    adapter = read_json(path)
    if not isinstance(adapter, dict):
        raise BadInput(f"{path} does not hold an adapter's settings (a JSON object)")
    _check_base(adapter, path, folder)
    widths = _check_lora(adapter, path, _linear_widths(config))
    if ADAPTER_WEIGHTS not in weights:
        raise BadInput(f"{path}: the folder has no {ADAPTER_WEIGHTS} (a pickled adapter_model.bin is not read); "
                       "save the adapter with safetensors")
    _check_adapter_weights(folder / ADAPTER_WEIGHTS, adapter["r"], widths)
    return True


def _check_base(adapter: dict, path: Path, folder: Path) -> None:
    """The adapter was saved with this folder's model: its `base_model_name_or_path` names the folder."""
    base = adapter.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise BadInput(f"{path}: `base_model_name_or_path` must name the model the adapter was trained on; got "
                       f"{base!r}")
    if not (Path(base).is_dir() and Path(base).resolve() == folder.resolve()):
        raise BadInput(f"{path}: `base_model_name_or_path` is {base!r}, not this folder, so the adapter was trained "
                       f"on another model; it is not applied. Move the adapter files out of {folder}, or load them "
                       "onto their base model with PeftModel.from_pretrained")


def _check_lora(adapter: dict, path: Path, linear: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """A LoRA adapter's fields against the model's linear layers (name -> (in, out)); the layers it adapts."""
    if adapter.get("peft_type") != "LORA":
        raise BadInput(f"{path}: `peft_type` must be 'LORA', the only adapter a model folder may hold; got "
                       f"{adapter.get('peft_type')!r}")
    targets = adapter.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not (isinstance(targets, list) and targets and all(isinstance(name, str) for name in targets)):
        raise BadInput(f"{path}: `target_modules` must be a list of layer names; got {adapter.get('target_modules')!r}")
    adapted = {name: sizes for name, sizes in linear.items() if name.rsplit(".", 1)[-1] in targets or name in targets}
    missing = sorted(name for name in targets if not any(n.rsplit(".", 1)[-1] == name or n == name for n in adapted))
    if missing:
        raise BadInput(f"{path}: `target_modules` names {', '.join(missing)}, which the model has no linear layer of")
    narrowest = min(min(sizes) for sizes in adapted.values())
    rank = adapter.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= narrowest:
        raise BadInput(f"{path}: `r` must be an integer from 1 to {narrowest}, the width of the narrowest layer it "
                       f"adapts; got {rank!r}")
    alpha, dropout = adapter.get("lora_alpha", 8), adapter.get("lora_dropout", 0.0)
    if not _finite(alpha) or alpha <= 0:
        raise BadInput(f"{path}: `lora_alpha` must be a positive number; got {alpha!r}")
    if not _finite(dropout) or not 0 <= dropout < 1:
        raise BadInput(f"{path}: `lora_dropout` must be a number in [0, 1); got {dropout!r}")
    beyond = [name for name in BEYOND_LOW_RANK if adapter.get(name)]
    if beyond:  # each would change the model past one rank's updates: whole layers, more layers, other ranks
        raise BadInput(f"{path}: `{beyond[0]}` is {adapter[beyond[0]]!r}; an adapter in a model folder holds low-rank "
                       f"updates of one rank alone, so {', '.join(BEYOND_LOW_RANK)} must be empty or false")
    return adapted


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _linear_widths(config) -> dict[str, tuple[int, int]]:
    """The model's linear layers, by name, with their (in, out) features, from a model built on the meta device."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(config, trust_remote_code=False)
    return {name: (module.in_features, module.out_features) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)}


def _check_adapter_weights(path: Path, rank: int, adapted: dict[str, tuple[int, int]]) -> None:
    """Every tensor in the adapter's safetensors header is the A or B matrix of an adapted layer, of its shape."""
    from safetensors import safe_open

    from .files import check_weights_file

    check_weights_file(path)
    with safe_open(str(path), framework="pt") as weights:  # the header alone: nothing is loaded
        shapes = {key: weights.get_slice(key).get_shape() for key in weights.keys()}
    for key, shape in shapes.items():
        layer, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        sizes = adapted.get(layer)
        expected = {"A.weight": [rank, sizes[0]], "B.weight": [sizes[1], rank]}.get(kind) if sizes else None
        if list(shape) != expected:
            raise BadInput(f"{path}: {key} is {list(shape)}, which is no LoRA matrix of rank {rank} of a layer the "
                           "adapter_config.json adapts; put back the adapter files saved together")


def merge_adapter(model):
    """The model with the adapter transformers applied merged into its weights: plain linear layers again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    model._hf_peft_config_loaded = False  # transformers' flag: no adapter left to save, enable or disable
    return model
