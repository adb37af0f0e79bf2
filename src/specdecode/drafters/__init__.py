"""Drafters propose tokens for the target to verify; see base.Drafter for the interface."""

from specdecode.drafters.auto import AutoDrafter, candidates_of
from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.recycling import RecyclingDrafter
from specdecode.drafters.self_quantized import self_quantized_drafter

__all__ = [
    "AutoDrafter",
    "CrossTokenizerDrafter",
    "Draft",
    "Drafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "RecyclingDrafter",
    "candidates_of",
    "self_quantized_drafter",
]
