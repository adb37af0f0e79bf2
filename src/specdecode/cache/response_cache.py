"""An exact response cache: a deterministic request answered again without a forward.

Deterministic: greedy, or sampled with a seed (then everything that decides the drafts is in
the key too: a seeded sample depends on what was drafted, though its law does not; see
`EngineCaches.key` in cache/engine_caches.py). The key is a digest of everything else that decides the output: the
model fingerprint (its weights, the runner and the kernels that compute it, the tokenizer,
the package version), the prompt's token ids, the sampling parameters, the seed, the stop
strings and EOS ids, the token budget, and torch's thread count at the time of the request.

A value is the output's token ids and finish reason behind a digest of key and payload:
bytes altered, cut, or copied from another key or model fail the check and count as a miss.
With the operator's secret (`SPECDECODE_CACHE_SECRET`), the digest is an HMAC: whoever can
write to Redis but lacks the secret cannot forge an entry. Without one, an entry that fits
the request (no more tokens than it allows, ids of the vocabulary, a finish reason its tokens
can have) is served as it is: the Redis must then be trusted. The caller serves from the cache
only where outputs do not depend on the batch (`ModelRunner.batch_invariant`), so a stored
answer is the answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from array import array
from collections import Counter
from importlib import metadata

import torch

from specdecode import cpu
from specdecode.cache.backends import Backend

DIGEST_BYTES = 16
# what an answer's tokens are, in the key: 2, through the token that completes a stop string
# (1 kept only the tokens before it), so no entry of one meaning is read as the other
ANSWER_FORMAT = 2
REASONS = ("stop", "length")
CONFIG_IGNORED = ("_name_or_path", "_commit_hash", "transformers_version")  # where it was loaded from, not what


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a request allows its answer: an entry that does not fit is refused, key or not."""

    max_tokens: int  # min(max_new_tokens, room left in the context): "length" ends exactly there
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: bool = False  # "stop" may then end anywhere (a stop string's text is cut)


def model_fingerprint(model: torch.nn.Module, runner, tokenizer) -> str:
    """A digest of what decides a model's outputs, bit for bit: every weight's bytes, the dtype,
    the architecture (config and module classes), the tokenizer's vocabulary, this package's
    version, the runner and its variant (runner_variant), and the kernels (kernel_fingerprint)."""
    digest = hashlib.blake2b(weights_fingerprint(model, tokenizer).encode(), digest_size=16)
    digest.update(json.dumps([runner_variant(runner), kernel_fingerprint(), ANSWER_FORMAT], default=str).encode())
    return digest.hexdigest()


def weights_fingerprint(model: torch.nn.Module, tokenizer) -> str:
    """What the model is, whatever runs it: its weights, dtype, architecture and vocabulary.
    The draft store's namespace: drafts are verified, so any kernels may share them."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        if isinstance(tensor, torch.Tensor):
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    config = getattr(model, "config", None)
    config = {k: v for k, v in config.to_dict().items() if k not in CONFIG_IGNORED} if config is not None else {}
    modules = sorted(Counter(type(m).__name__ for m in model.modules()).items())
    dtype = str(next(model.parameters()).dtype)
    digest.update(json.dumps([dtype, vocab, config, modules, _version()], sort_keys=True, default=str).encode())
    return digest.hexdigest()


def runner_variant(runner) -> list:
    """How a runner computes: its class, dtype and device, and on the fast runners each
    product's kernel (oneDNN's reordered layout, weight-only int8, w8a8, w8a16, the padded one-row product),
    the attention (one query at a time or batched) and whether it is compiled. A string: a
    runner's name alone (what callers outside the engine may have)."""
    if isinstance(runner, str):
        return [runner]
    from specdecode.kernels.int8_kernel import WEIGHT_LIMIT, WIDE_ACTIVATION_LIMIT
    from specdecode.runners.projection import Int8Projection, Projection, W8A16Projection

    products: Counter = Counter()

    def visit(value, depth: int = 0) -> None:
        if isinstance(value, Projection):
            kind = (
                "int8" if value.scales is not None else "reordered" if value.reordered else "plain",
                value.pad_one_row,
            )
            products[(*kind, str(value.weight.dtype))] += 1
        elif isinstance(value, Int8Projection):  # w8a8: the weight codes' range decides the bits
            products[("w8a8", value.limit, str(None if value.bias is None else value.bias.dtype))] += 1
        elif isinstance(value, W8A16Projection):  # int8 weights, 16-bit activations: other bits than w8a8's
            bias = str(None if value.bias is None else value.bias.dtype)
            products[("w8a16", WEIGHT_LIMIT, WIDE_ACTIVATION_LIMIT, bias)] += 1
        elif depth < 3 and isinstance(value, list | tuple):
            for item in value:
                visit(item, depth + 1)
        elif depth < 3 and dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name), depth + 1)

    for value in vars(runner).values():
        visit(value)
    device = getattr(runner, "device", None)
    return [
        type(runner).__name__,
        str(getattr(runner, "dtype", None)),
        getattr(device, "type", str(device)),
        getattr(runner, "per_query_attention", None),
        getattr(runner, "attention_kernel", None),  # the tree attention kernel's source, or "sdpa"
        getattr(runner, "layer_kernel", None),  # w8a8's decoder layers in C (int8_layer.py): other bits
        getattr(runner, "embedding_kind", None),  # w8a8 may read a tied embedding from the head's codes
        getattr(runner, "_compiled_layers", None) is not None,
        sorted(products.items()),
    ]


def kernel_fingerprint() -> list:
    """What chooses the kernels and how they sum, beyond the weights: torch's and transformers'
    versions, torch's build (its oneDNN and MKL versions, the CPU capability ATen dispatches
    to: torch.__config__.show()), the float32 matmul precision, torch's thread count (float32
    products split their sums by threads, so another count can give other bits), the CPU's model,
    instruction-set extensions and the variables that cap them (cpu.kernel_choices), and which
    build of this package's int8 kernels runs (cpu.kernel_isa: AMX, AVX512-VNNI, AVX2 or portable; the
    builds give the same bits, tested, and the key still names the one that ran)."""
    import transformers

    return [
        torch.__version__,
        transformers.__version__,
        torch.__config__.show(),
        torch.get_float32_matmul_precision(),
        torch.get_num_threads(),
        cpu.kernel_choices(),
        cpu.kernel_isa(),
    ]


class ResponseCache:
    def __init__(
        self,
        backend: Backend,
        fingerprint: str,
        vocab_size: int,
        ttl_s: int | None = 7 * 24 * 3600,
        secret: str | bytes | None = None,
    ):
        """secret: the operator's key; entries are then HMACs that only holders of it can write."""
        self.backend, self.fingerprint, self.vocab_size, self.ttl_s = backend, fingerprint, vocab_size, ttl_s
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self.hits = self.misses = self.rejected = 0  # rejected: entries that failed their check

    @property
    def keyed(self) -> bool:
        return bool(self._secret)

    def key(self, prompt_ids: list[int], **request) -> str:
        """The key of a request: its prompt ids and every other setting that decides its output,
        and torch's thread count now (it may change after the fingerprint was taken)."""
        request["threads"] = torch.get_num_threads()
        payload = json.dumps([self.fingerprint, prompt_ids, sorted(request.items())], default=repr).encode()
        return f"{self.fingerprint}:resp:{self._mac(payload, 20).hex()}"

    def get(self, key: str, bounds: Bounds | None = None) -> tuple[list[int], str] | None:
        """The entry under key if it passes its check and fits bounds (the request's), else None."""
        value = self.backend.get(key)
        found = self._unpack(key, value, bounds) if value is not None else None
        self.rejected += value is not None and found is None
        self.hits += found is not None
        self.misses += found is None
        return found

    def put(self, key: str, token_ids: list[int], finish_reason: str) -> None:
        payload = bytes([REASONS.index(finish_reason)]) + array("i", token_ids).tobytes()
        self.backend.set(key, self._digest(key, payload) + payload, self.ttl_s)

    def _unpack(self, key: str, value: bytes, bounds: Bounds | None) -> tuple[list[int], str] | None:
        digest, payload = value[:DIGEST_BYTES], value[DIGEST_BYTES:]
        if len(payload) < 1 or (len(payload) - 1) % 4 or payload[0] >= len(REASONS):
            return None
        if bounds is not None and (len(payload) - 1) // 4 > bounds.max_tokens:
            return None  # more tokens than the request allows: refused before reading them
        if not hmac.compare_digest(digest, self._digest(key, payload)):
            return None
        token_ids, reason = array("i", payload[1:]).tolist(), REASONS[payload[0]]
        if not all(0 <= t < self.vocab_size for t in token_ids):
            return None
        if bounds is not None and not _fits(token_ids, reason, bounds):
            return None
        return token_ids, reason

    def _digest(self, key: str, payload: bytes) -> bytes:
        return self._mac(key.encode() + payload, DIGEST_BYTES)

    def _mac(self, data: bytes, size: int) -> bytes:
        """An HMAC with the secret; without one, a plain digest (integrity, not authenticity)."""
        if self._secret:
            return hmac.new(self._secret, data, hashlib.sha256).digest()[:size]
        return hashlib.blake2b(data, digest_size=size).digest()


def _fits(token_ids: list[int], reason: str, bounds: Bounds) -> bool:
    """Whether a generation could have ended so (core/stopping.py): at the first EOS, which it
    keeps ("stop"); at a stop string, anywhere ("stop"); else exactly at the budget ("length")."""
    eos = bounds.eos_token_ids
    if any(t in eos for t in token_ids[:-1]):
        return False  # generation ends at the first EOS
    if reason == "length":
        return len(token_ids) == bounds.max_tokens and not (token_ids and token_ids[-1] in eos)
    return bounds.stop_strings or bool(token_ids and token_ids[-1] in eos)


def _version() -> str:
    try:
        return metadata.version("specdecode")
    except metadata.PackageNotFoundError:
        return "unknown"
