"""Errors a user can fix. Each message says what was wrong and how to fix it.

They subclass ValueError so library callers can catch them with plain Python;
the CLI prints their message on one line and exits with status 2.
"""


class SpecDecodeError(ValueError):
    """Base class of every error caused by the user's input or setup."""


class InvalidArgumentError(SpecDecodeError):
    """A generation or engine argument is out of range."""


class ModelNotFoundError(SpecDecodeError):
    """A model name or path could not be resolved to weights."""


class VocabularyMismatchError(SpecDecodeError):
    """Draft and target do not share a vocabulary, so their tokens cannot be compared."""


class PromptTooLongError(SpecDecodeError):
    """The prompt does not fit in the model's context window."""
