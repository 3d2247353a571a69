"""The model card (README.md) of a saved model: built in card.py (with the template.md beside it), and
pointed at the repository it is pushed to in retarget.py."""

from .card import METRICS, TEMPLATE, adapter_card, build_model_card, metrics_from_results
from .retarget import card_repo_id, retarget_card

__all__ = ["METRICS", "TEMPLATE", "adapter_card", "build_model_card", "card_repo_id", "metrics_from_results",
           "retarget_card"]
