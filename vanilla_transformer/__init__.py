"""vanilla-transformer: the Transformer of "Attention Is All You Need" for the Hugging Face ecosystem."""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from .modeling.modeling_vanilla_transformer import (
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerModel,
    VanillaTransformerPreTrainedModel,
)
from .modeling.pipeline_vanilla_transformer import TranslationPipeline

__version__ = "0.1.0"

# In this process the Auto classes know the model without trust_remote_code ...
AutoConfig.register(VanillaTransformerConfig.model_type, VanillaTransformerConfig, exist_ok=True)
AutoModel.register(VanillaTransformerConfig, VanillaTransformerModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(VanillaTransformerConfig, VanillaTransformerForConditionalGeneration, exist_ok=True)
# ... and save_pretrained copies the code files next to the weights and writes `auto_map`,
# so that a saved folder loads anywhere with trust_remote_code=True.
VanillaTransformerConfig.register_for_auto_class()
VanillaTransformerModel.register_for_auto_class("AutoModel")
VanillaTransformerForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")

__all__ = [
    "TranslationPipeline",
    "VanillaTransformerConfig",
    "VanillaTransformerForConditionalGeneration",
    "VanillaTransformerModel",
    "VanillaTransformerPreTrainedModel",
]
