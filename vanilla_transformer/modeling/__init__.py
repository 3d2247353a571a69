"""The model's code: the files copied into every saved model folder and loaded from it with
`trust_remote_code=True`. They import one another relatively and nothing else of this package.

This file is not copied: importing any of them through the package registers the model here, so that
whoever uses the classes gets both registrations below before loading or saving a model.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration, VanillaTransformerModel

# In this process the Auto classes know the model without trust_remote_code ...
AutoConfig.register(VanillaTransformerConfig.model_type, VanillaTransformerConfig, exist_ok=True)
AutoModel.register(VanillaTransformerConfig, VanillaTransformerModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(VanillaTransformerConfig, VanillaTransformerForConditionalGeneration, exist_ok=True)
# ... and save_pretrained copies the code files next to the weights and writes `auto_map`,
# so that a saved folder loads anywhere with trust_remote_code=True.
VanillaTransformerConfig.register_for_auto_class()
VanillaTransformerModel.register_for_auto_class("AutoModel")
VanillaTransformerForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
