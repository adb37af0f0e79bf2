"""specdecode: exact speculative decoding for Hugging Face causal language models."""

from specdecode.core.sampling import SamplingParams
from specdecode.core.stats import GenerationStats
from specdecode.drafters.factory import DrafterOptions
from specdecode.engine import CacheOptions, GenerationResult, SpeculativeEngine
from specdecode.errors import (
    ContextLengthError,
    InvalidArgumentError,
    ModelNotFoundError,
    PromptTooLongError,
    SpecDecodeError,
    VocabularyMismatchError,
)

__all__ = [
    "CacheOptions",
    "ContextLengthError",
    "DrafterOptions",
    "GenerationResult",
    "GenerationStats",
    "InvalidArgumentError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "SamplingParams",
    "SpecDecodeError",
    "SpeculativeEngine",
    "VocabularyMismatchError",
]
