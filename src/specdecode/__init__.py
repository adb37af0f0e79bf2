"""specdecode: exact speculative decoding for Hugging Face causal language models."""

from specdecode.engine import GenerationResult, SpeculativeEngine, speculative_decode
from specdecode.errors import (
    InvalidArgumentError,
    ModelNotFoundError,
    PromptTooLongError,
    SpecDecodeError,
    VocabularyMismatchError,
)
from specdecode.sampling import SamplingParams
from specdecode.stats import GenerationStats

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "InvalidArgumentError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "SamplingParams",
    "SpecDecodeError",
    "SpeculativeEngine",
    "VocabularyMismatchError",
    "speculative_decode",
]
