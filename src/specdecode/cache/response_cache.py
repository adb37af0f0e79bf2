"""An exact response cache: a deterministic request answered again without a forward.

Deterministic: greedy, or sampled with a seed (then the drafter and k are in the key too: a
seeded sample depends on what was drafted, though its law does not). The key is a digest
of everything else that decides the output: the model fingerprint (its weights' bytes,
dtype, runner, tokenizer, package version), the prompt's token ids, the sampling
parameters, the seed, the stop strings and EOS ids, and the token budget.

A value is the output's token ids and finish reason behind a digest of key and payload:
bytes altered, cut, or copied from another key or model fail the check and count as a miss.
The caller serves from the cache only where outputs do not depend on the batch
(`ModelRunner.batch_invariant`), so a stored answer is the answer.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from importlib import metadata

import torch

from specdecode.cache.backends import Backend

DIGEST_BYTES = 16
REASONS = ("stop", "length")


def model_fingerprint(model: torch.nn.Module, runner_name: str, tokenizer) -> str:
    """A digest of what decides a model's outputs: every weight's bytes, the dtype, the runner,
    the tokenizer's vocabulary, and this package's version."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    digest.update(json.dumps([str(next(model.parameters()).dtype), runner_name, vocab, _version()]).encode())
    return digest.hexdigest()


class ResponseCache:
    def __init__(self, backend: Backend, fingerprint: str, vocab_size: int, ttl_s: int | None = 7 * 24 * 3600):
        self.backend, self.fingerprint, self.vocab_size, self.ttl_s = backend, fingerprint, vocab_size, ttl_s
        self.hits = self.misses = self.rejected = 0  # rejected: entries that failed their check

    def key(self, prompt_ids: list[int], **request) -> str:
        """The key of a request: its prompt ids and every other setting that decides its output."""
        payload = json.dumps([self.fingerprint, prompt_ids, sorted(request.items())], default=repr)
        return f"{self.fingerprint}:resp:{hashlib.blake2b(payload.encode(), digest_size=20).hexdigest()}"

    def get(self, key: str) -> tuple[list[int], str] | None:
        value = self.backend.get(key)
        found = self._unpack(key, value) if value is not None else None
        self.rejected += value is not None and found is None
        self.hits += found is not None
        self.misses += found is None
        return found

    def put(self, key: str, token_ids: list[int], finish_reason: str) -> None:
        payload = bytes([REASONS.index(finish_reason)]) + array("i", token_ids).tobytes()
        self.backend.set(key, _digest(key, payload) + payload, self.ttl_s)

    def _unpack(self, key: str, value: bytes) -> tuple[list[int], str] | None:
        digest, payload = value[:DIGEST_BYTES], value[DIGEST_BYTES:]
        if len(payload) < 1 or (len(payload) - 1) % 4 or digest != _digest(key, payload) or payload[0] >= len(REASONS):
            return None
        token_ids = array("i", payload[1:]).tolist()
        if not all(0 <= t < self.vocab_size for t in token_ids):
            return None
        return token_ids, REASONS[payload[0]]


def _digest(key: str, payload: bytes) -> bytes:
    return hashlib.blake2b(key.encode() + payload, digest_size=DIGEST_BYTES).digest()


def _version() -> str:
    try:
        return metadata.version("specdecode")
    except metadata.PackageNotFoundError:
        return "unknown"
