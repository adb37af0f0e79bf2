"""Errors a user can fix. Each message says what was wrong and how to fix it.

They subclass ValueError so library callers can catch them with plain Python; the CLI
prints their message on one line and exits with status 2, and the server answers them
with a 400 whose `param` is the error's `param` (the argument at fault, when there is one).
"""


class SpecDecodeError(ValueError):
    """Base class of every error caused by the user's input or setup."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # the argument at fault, by its API name (max_new_tokens, temperature, ...)


class InvalidArgumentError(SpecDecodeError):
    """A generation or engine argument is out of range."""


class ModelNotFoundError(SpecDecodeError):
    """A model name or path could not be resolved to weights."""


class VocabularyMismatchError(SpecDecodeError):
    """Draft and target do not share a vocabulary, so their tokens cannot be compared."""


class ContextLengthError(SpecDecodeError):
    """A sequence would not fit in max_model_len: its prompt, or its prompt with the tokens
    asked for (the server refuses those; the library stops at the context's end instead)."""


class PromptTooLongError(ContextLengthError):
    """The prompt alone does not fit in max_model_len (at least one new token must)."""
