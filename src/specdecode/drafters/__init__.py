"""Drafters propose tokens for the target to verify; see base.Drafter for the interface."""

from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "PromptLookupDrafter"]
