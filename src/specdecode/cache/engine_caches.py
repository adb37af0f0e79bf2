"""The caches as an engine uses them: where they live, when the response cache is on, the key
of a request, and answering a sequence from it or remembering its answer.

A layer below the decoder and the engine, so the sequence (decoder.SequenceState) and the request's
settings (engine.RequestSettings) are read by their fields, not imported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import astuple, dataclass, field

from specdecode.cache.backends import Backend, RedisBackend, mask_password, open_backend
from specdecode.cache.draft_store import DraftStore
from specdecode.cache.response_cache import Bounds, ResponseCache, model_fingerprint, weights_fingerprint
from specdecode.core.stats import GenerationStats
from specdecode.core.stopping import Stop
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger("specdecode.cache")
SECRET_ENV = "SPECDECODE_CACHE_SECRET"  # the operator's key for the shared caches' entries


@dataclass(frozen=True)
class CacheOptions:
    """What the engine remembers across requests (cache/): where, and which parts."""

    url: str | None = None  # redis://HOST:PORT/DB (or rediss://) to share with other processes; None: this one
    response_cache: bool = True  # answer repeated deterministic requests without a forward (where exact)
    draft_store: bool = True  # earlier requests' text drafts for `suffix` and `auto`
    max_mb: int = 256  # the in-process backend's bound
    # a finished sequence's KV cache kept in its slot for a later prompt that starts with the same
    # tokens (where exact: runners/slots.py, "prefix reuse"); in this process only
    prefix_cache: bool = True
    require_backend: bool = (
        False  # a Redis that does not answer at start is an error (generate), not a fallback (serve)
    )
    # the operator's key: entries and draft records are HMACs of it, so that only its holders can
    # write what is served (None: $SPECDECODE_CACHE_SECRET, if set). Never printed.
    secret: str | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        url = None if self.url is None else mask_password(self.url)
        keyed = "set" if self.secret else None
        return (
            f"CacheOptions(url={url!r}, response_cache={self.response_cache}, draft_store={self.draft_store}, "
            f"prefix_cache={self.prefix_cache}, max_mb={self.max_mb}, require_backend={self.require_backend}, secret={keyed})"
        )

    @property
    def secret_in_use(self) -> str | None:
        """The secret in use: this one's, else the environment's (empty: none)."""
        return self.secret or os.environ.get(SECRET_ENV) or None


class EngineCaches:
    """One engine's backend, response cache and fingerprints. `runner` is the target's
    (ModelRunner); `max_length` the most tokens a sequence holds (the engine's max_model_len)."""

    def __init__(self, runner, tokenizer, max_length: int):
        self.runner, self.tokenizer, self.max_length = runner, tokenizer, max_length
        self.backend: Backend | None = None  # where the response cache and draft store live (open)
        self.response_cache: ResponseCache | None = None
        self.note = "no response cache"  # why the response cache is on or off
        self._fingerprint: str | None = None
        self._weights_fingerprint: str | None = None

    def fingerprint(self) -> str:
        """What the caches key entries by: a digest of the target's weights and what else
        decides its outputs (cache.model_fingerprint); computed once, while the weights are there."""
        if self._fingerprint is None:
            model = getattr(self.runner, "model", None)
            if model is None:
                raise InvalidArgumentError(
                    f"the caches key entries by the target's weights, and {type(self.runner).__name__} has no "
                    "`model` to read them from: open no caches (CacheOptions(response_cache=False, draft_store=False))",
                    "cache",
                )
            self._fingerprint = model_fingerprint(model, self.runner, self.tokenizer)
            self._weights_fingerprint = weights_fingerprint(model, self.tokenizer)
        return self._fingerprint

    def open(self, options: CacheOptions) -> DraftStore | None:
        """Open the backend, turn the response cache on where it is exact; the draft store."""
        if not (options.response_cache or options.draft_store):
            return None
        backend = open_backend(options.url, options.max_mb << 20)  # Redis exactly when options.url is set
        self.backend = backend
        if isinstance(backend, RedisBackend) and options.require_backend and not backend.ping():
            raise InvalidArgumentError(
                f"no Redis answered at --cache-url {backend.masked_url}; start it or leave the option out",
                "cache_url",
            )
        secret = options.secret_in_use
        if options.url is not None and secret is None:
            logger.warning(
                "the caches on Redis at %s have no key (set %s, CacheOptions.secret or --cache-secret-file): "
                "whoever can write to that Redis can change the answers it serves; it must be trusted",
                mask_password(options.url),
                SECRET_ENV,
            )
        vocab = self.runner.vocab_size
        if options.response_cache:
            self.use(ResponseCache(backend, self.fingerprint(), vocab, secret=secret))
        if not options.draft_store:
            return None
        self.fingerprint()  # drafts are verified: any runner and kernels of this model may share them
        namespace = self._weights_fingerprint
        assert namespace is not None  # fingerprint() sets both
        return DraftStore(backend, namespace, vocab, max_record_tokens=self.max_length, secret=secret)

    def use(self, cache: ResponseCache) -> None:
        """Serve repeated deterministic requests from cache, where outputs do not depend on the
        batch; elsewhere a cached answer could differ from a fresh one by rounding, and the
        cache stays off (note says why)."""
        if self.runner.batch_invariant:
            self.response_cache, self.note = cache, "response cache on"
            return
        self.note = (
            f"response cache off: {type(self.runner).__name__} in {self.runner.dtype} "
            "does not give a sequence the same bits in every batch (only the fast paths on the CPU do)"
        )

    def key(
        self,
        prompt_ids: list[int],
        settings,
        seed: int | None,
        k: int,
        adaptive: bool,
        drafts: Callable[[], list | None],
    ) -> str | None:
        """A response-cache key for deterministic requests: greedy ones, or seeded samples (whose
        tokens depend on the drafts, so everything that decides them counts too: drafts(), the
        identity of each drafter's kind, settings and draft model, k and the policy); None for
        the others, for seeded samples of drafters that cannot be described (drafts() None), and
        for requests of log-probabilities (which the cache does not keep)."""
        params, stopping = settings.params, settings.stopping
        if self.response_cache is None or not (params.greedy or seed is not None) or settings.logprobs is not None:
            return None
        request = dict(
            max_new_tokens=stopping.max_new_tokens,
            stop=list(stopping.stop_strings),
            eos=sorted(stopping.eos_token_ids),
            max_length=self.max_length,
        )
        if settings.constraint is not None:  # the answer follows its grammar
            request |= dict(constraint=[settings.constraint.kind, settings.constraint.value])
        if settings.adjustments.active:  # bias and penalties change the greedy answer too
            request |= dict(adjustments=astuple(settings.adjustments))
        if not params.greedy:
            identities = drafts() if k else []  # target-only: no drafter decides
            if identities is None:
                return None
            request |= dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed)
            if params.min_p:
                request |= dict(min_p=params.min_p)
            request |= dict(drafts=identities, k=k, adaptive=adaptive, fixed_k=settings.fixed_k)
        return self.response_cache.key(prompt_ids, **request)

    def answer(self, seq) -> bool:
        """Fill seq (a decoder.SequenceState) with the stored answer of a request seen before, if the
        response cache has a valid one; whether it did."""
        if self.response_cache is None or seq.cache_key is None:
            return False
        room = min(seq.stopping.max_new_tokens, self.max_length - len(seq.prompt_ids))
        bounds = Bounds(room, frozenset(seq.stopping.eos_token_ids), bool(seq.stopping.stop_strings))
        found = self.response_cache.get(seq.cache_key, bounds)
        if found is None:
            return False
        seq.generated, reason = found
        seq.finish = Stop(len(seq.generated), reason)
        seq.stats = GenerationStats(seq.drafter_name if seq.k_max else "none", seq.k_max, cached=True)
        seq.stats.generated_tokens = len(seq.generated)
        return True

    def remember(self, seq) -> None:
        """Store a finished sequence's answer for the next identical request."""
        if self.response_cache is not None and seq.cache_key is not None and seq.finish is not None:
            self.response_cache.put(seq.cache_key, seq.generated, seq.finish.reason)
