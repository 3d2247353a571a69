"""vanilla-transformer: the Transformer of "Attention Is All You Need" for the Hugging Face ecosystem.

The model classes are imported on first use, so that `import vanilla_transformer` (and with it the
command line's `--help`) does not wait for torch and transformers. Importing them registers them with
the Auto classes (see `modeling/__init__.py`).
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "TranslationPipeline": ".modeling.pipeline_vanilla_transformer",
    "VanillaTransformerConfig": ".modeling.configuration_vanilla_transformer",
    "VanillaTransformerForConditionalGeneration": ".modeling.modeling_vanilla_transformer",
    "VanillaTransformerModel": ".modeling.modeling_vanilla_transformer",
    "VanillaTransformerPreTrainedModel": ".modeling.modeling_vanilla_transformer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
