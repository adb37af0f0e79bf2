"""The parts of a drafter's cache identity (Drafter.cache_identity) that several drafters share:
a draft model's fingerprint and a tokenizer's digest."""

from __future__ import annotations

import hashlib
import weakref

from transformers import PreTrainedTokenizerBase

from specdecode.cache import model_fingerprint
from specdecode.runners import ModelRunner

# a draft runner's fingerprint, computed once (it reads every weight)
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runner_fingerprint(runner: ModelRunner) -> str | None:
    """What decides a draft model's outputs (cache.model_fingerprint: weights, runner, kernels);
    None for a runner without a model to read."""
    if runner not in _fingerprints:
        model = getattr(runner, "model", None)
        _fingerprints[runner] = model_fingerprint(model, runner, None) if model is not None else None
    return _fingerprints[runner]


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A fast tokenizer's whole definition (vocabulary, merges, normalizer): how it splits text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return hashlib.blake2b(backend.to_str().encode(), digest_size=16).hexdigest() if backend is not None else None
