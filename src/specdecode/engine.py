"""The public API: `SpeculativeEngine` loads a target and a drafter and runs the decoder.

Every generation, one prompt or many, runs through the one decode loop (decoder.py): a
single prompt is a batch of one. The engine keeps one `Decoder`, so step costs and
acceptance measured by one call choose k in the next. Every argument a request can get
wrong is checked here, once; the errors name the argument (errors.py), so the CLI and the
server report them without checking again.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.cache import DraftStore, ResponseCache, model_fingerprint, open_backend
from specdecode.cache.backends import mask_password
from specdecode.cache.response_cache import Bounds, weights_fingerprint
from specdecode.core.adaptive import MAX_SPECULATIVE_TOKENS
from specdecode.core.sampling import SamplingParams
from specdecode.core.stats import GenerationStats
from specdecode.core.stopping import Stop, StoppingCriteria
from specdecode.decoder import Decoder, Sequence, decode_all
from specdecode.drafters import AutoDrafter, Drafter, candidates_of
from specdecode.drafters.factory import (
    DRAFTERS,
    DrafterOptions,
    check_drafter_name,
    check_drafter_options,
    drafter_identity,
    make_drafter,
)
from specdecode.errors import InvalidArgumentError, PromptTooLongError
from specdecode.loading import DEFAULT_TARGET, QUANTIZATIONS, load_model, precision_of
from specdecode.runners import ModelRunner, runner_for
from specdecode.runners.select import chosen_dtype

__all__ = ["DRAFTERS", "CacheOptions", "DrafterOptions", "GenerationResult", "SpeculativeEngine"]

logger = logging.getLogger("specdecode.cache")
SECRET_ENV = "SPECDECODE_CACHE_SECRET"  # the operator's key for the shared caches' entries

# a request's stop strings: as many as OpenAI allows, each of a bounded length (the check
# after every step searches the new text and the longest stop string's length before it)
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 1024


@dataclass
class GenerationResult:
    text: str | None  # None when the engine has no tokenizer
    token_ids: list[int]  # new tokens only
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats


@dataclass(frozen=True)
class CacheOptions:
    """What the engine remembers across requests (cache/): where, and which parts."""

    url: str | None = None  # redis://HOST:PORT/DB (or rediss://) to share with other processes; None: this one
    response_cache: bool = True  # answer repeated deterministic requests without a forward (where exact)
    draft_store: bool = True  # earlier requests' text drafts for `suffix` and `auto`
    max_mb: int = 256  # the in-process backend's bound
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
            f"max_mb={self.max_mb}, require_backend={self.require_backend}, secret={keyed})"
        )

    @property
    def secret_in_use(self) -> str | None:
        """The secret in use: this one's, else the environment's (empty: none)."""
        return self.secret or os.environ.get(SECRET_ENV) or None


@dataclass(frozen=True)
class RequestSettings:
    """A request's checked settings, shared by the sequences it starts (one per prompt or choice)."""

    params: SamplingParams
    stopping: StoppingCriteria
    seed: int | None
    num_speculative_tokens: int

    @property
    def fixed_k(self) -> bool:
        # adaptive k follows the clock; a seed must repeat its samples, so seeded sampling
        # drafts the most k every step
        return self.seed is not None and not self.params.greedy


class SpeculativeEngine:
    """A target model, an optional drafter, and the decoder that runs them."""

    def __init__(
        self,
        target: PreTrainedModel | ModelRunner,
        tokenizer: PreTrainedTokenizerBase | None = None,
        drafter: Drafter | AutoDrafter | None = None,
        num_speculative_tokens: int = 4,
        runner: str = "auto",
        adaptive: bool = False,
        response_cache: ResponseCache | None = None,
        max_model_len: int | None = None,
    ):
        """adaptive: choose k <= num_speculative_tokens each step from measured acceptance and
        costs (core/adaptive.py); False drafts num_speculative_tokens every step.
        response_cache: answers deterministic requests seen before without a forward; used
        only if the runner's outputs do not depend on the batch (else ignored: see cache_note).
        max_model_len: the most tokens, prompt and generated, a sequence may hold (default and
        upper bound: the model's context length); a longer prompt is refused, and generation
        ends there with finish reason "length". Slot caches never grow past it."""
        self.num_speculative_tokens = _checked_k(num_speculative_tokens)
        self.target_runner = runner_for(target, runner) if isinstance(target, PreTrainedModel) else target
        self.max_model_len = _checked_max_model_len(max_model_len, self.target_runner.max_length)
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.eos_token_ids = _eos_token_ids(target, tokenizer)
        model = getattr(self.target_runner, "model", None)
        # the target's precision, named in every result's stats: "float32", "nf4 (bitsandbytes, ...)"
        self.precision = (
            precision_of(model) if model is not None else str(self.target_runner.dtype).removeprefix("torch.")
        )
        self.cache_backend = None  # where the response cache and draft store live (open_caches)
        self.decoder = Decoder(self.target_runner, adaptive, self.max_model_len)
        self.response_cache, self.cache_note = None, "no response cache"
        self._fingerprint: str | None = None
        self._weights_fingerprint: str | None = None
        if response_cache is not None:
            self.use_response_cache(response_cache)

    @classmethod
    def from_pretrained(
        cls,
        target: str = DEFAULT_TARGET,
        draft: str | PreTrainedModel | None = None,
        drafter: str | Drafter = "auto",
        num_speculative_tokens: int = 4,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        runner: str = "auto",
        options: DrafterOptions | None = None,
        max_model_len: int | None = None,
        cache: CacheOptions | None = None,
        quantization: str | None = None,
        keep_model_weights: bool = False,
        compile: bool = False,
    ) -> SpeculativeEngine:
        """Load target (and draft) by short name, folder, .gguf file or Hub id; pick the drafter.

        runner: "auto" runs supported architectures on the lean fast path (runners/fast_llama.py)
        and the rest on transformers' modeling; "transformers" forces the latter.
        drafter "auto": prompt lookup, then the draft store (`suffix`, when cache.draft_store is on),
        then the draft model if one is given; each step the first that proposes; with adaptive k
        each proposes only while it pays. Where the target verifies trees (the fast runner's
        `verifies_trees`): `recycling` (the target's own past predictions, prompt lookup's
        continuations first), then a prompt-lookup tree (for seeded samples, which skip
        recycling), then the draft model's trees.
        max_model_len: the most tokens a sequence may hold (default: the model's context).
        cache: the response cache and the draft store, in process or on Redis (default: both in
        process; `CacheOptions(response_cache=False, draft_store=False)` for neither).
        quantization: "nf4", "fp4" or "int8" quantizes the target with bitsandbytes as it loads
        (embeddings, output head and, in 4 bits, the MLPs' down projections stay in dtype); it then
        runs on transformers' runner, exact relative to the quantized model (runners/rowwise.py;
        docs/quantization.md). None: every weight in dtype.
        dtype "auto": bfloat16 where this CPU multiplies it natively and speculation is exact in
        it (runners.select.auto_dtype), else float32; `engine.precision` says which.
        keep_model_weights: the fast runners hold the weights in a layout of their own; by default
        the transformers model's copies are freed once the drafter is made (one copy in memory,
        not two), and `target_runner.model` can no longer run. True keeps it runnable.
        compile: run the target's forwards for one sequence compiled by torch.compile (Llama-family
        fast runner; the first forward of each size compiles, about a minute each for the
        default model on 2 CPU cores). Exact as eager, but the response cache stays off.
        """
        options = options or DrafterOptions()
        if isinstance(drafter, str):
            check_drafter_name(drafter, draft)
            check_drafter_options(drafter, options)
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise InvalidArgumentError(
                f"unknown quantization '{quantization}'; choose one of: {', '.join(QUANTIZATIONS)}", "quantization"
            )
        chosen = dtype == "auto"
        dtype = chosen_dtype(dtype, target, device, runner, quantization, trust_remote_code)
        model, tokenizer = load_model(target, device, dtype, trust_remote_code, quantization)
        engine = cls(
            model,
            tokenizer,
            None,
            num_speculative_tokens,
            runner,
            adaptive=options.adaptive,
            max_model_len=max_model_len,
        )
        if chosen:
            engine.precision += " (--dtype auto)"
        if compile:
            if not engine.target_runner.compilable:
                raise InvalidArgumentError(
                    f"compile runs on the Llama-family fast runner; {type(engine.target_runner).__name__} "
                    "runs this target: leave compile out",
                    "compile",
                )
            engine.target_runner.compile()
            engine.precision += ", compiled"
        store = engine.open_caches(cache or CacheOptions())
        if isinstance(drafter, str):
            load = lambda name: load_model(name, device, dtype, trust_remote_code)  # noqa: E731
            drafter = make_drafter(drafter, draft, engine.target_runner, tokenizer, load, runner, options, store)
        engine.drafter = drafter
        if engine.response_cache is not None:  # a draft model's fingerprint reads its weights: now, not in a request
            engine.drafts_identity(candidates_of(drafter))
        if not keep_model_weights:
            engine.model_fingerprint()  # read the weights now, for caches opened later
            engine.target_runner.release_model_weights()
        return engine

    def open_caches(self, options: CacheOptions) -> DraftStore | None:
        """Open the backend, turn the response cache on where it is exact; the draft store."""
        if not (options.response_cache or options.draft_store):
            return None
        self.cache_backend = open_backend(options.url, options.max_mb << 20)
        if options.url is not None and options.require_backend and not self.cache_backend.ping():
            raise InvalidArgumentError(
                f"no Redis answered at --cache-url {mask_password(options.url)}; start it or leave the option out",
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
        vocab = self.target_runner.vocab_size
        if options.response_cache:
            self.use_response_cache(ResponseCache(self.cache_backend, self.model_fingerprint(), vocab, secret=secret))
        if not options.draft_store:
            return None
        # drafts are verified: any runner and kernels of this model may share them
        self.model_fingerprint()
        namespace = self._weights_fingerprint
        return DraftStore(self.cache_backend, namespace, vocab, max_record_tokens=self.max_model_len, secret=secret)

    def model_fingerprint(self) -> str:
        """What the caches key entries by: a digest of the target's weights and what else
        decides its outputs (cache.model_fingerprint); computed once, while the weights are there."""
        if self._fingerprint is None:
            model = getattr(self.target_runner, "model", None)
            self._fingerprint = model_fingerprint(model, self.target_runner, self.tokenizer)
            self._weights_fingerprint = weights_fingerprint(model, self.tokenizer)
        return self._fingerprint

    def drafts_identity(self, candidates: tuple[Drafter, ...]) -> list | None:
        """What decides the drafts of these candidates (factory.drafter_identity, each), for
        the key of a seeded sample; None if one of them cannot be described."""
        identities = [drafter_identity(d) for d in candidates]
        return None if None in identities else identities

    @property
    def adaptive(self) -> bool:
        return self.decoder.adaptive

    def use_response_cache(self, cache: ResponseCache) -> None:
        """Serve repeated deterministic requests from cache, where outputs do not depend on the
        batch; elsewhere a cached answer could differ from a fresh one by rounding, and the
        cache stays off (cache_note says why)."""
        if self.target_runner.batch_invariant:
            self.response_cache, self.cache_note = cache, "response cache on"
            return
        self.cache_note = (
            f"response cache off: {type(self.target_runner).__name__} in {self.target_runner.dtype} "
            "does not give a sequence the same bits in every batch (only the fast paths on the CPU do)"
        )

    def with_drafter(
        self,
        drafter: Drafter | AutoDrafter | None,
        num_speculative_tokens: int,
        adaptive: bool = False,
        response_cache: bool = False,
    ) -> SpeculativeEngine:
        """This engine's target and tokenizer (shared, not copied) with another drafter, k and
        a decoder of its own: a system to compare with this one in the same process. It answers
        from this engine's response cache only if asked: a comparison would time the cache."""
        view = copy.copy(self)
        view.drafter, view.num_speculative_tokens = drafter, _checked_k(num_speculative_tokens)
        view.decoder = Decoder(self.target_runner, adaptive, self.max_model_len)
        if not response_cache:
            view.response_cache = None
        return view

    @property
    def drafts_in_batches(self) -> bool:
        """Whether each sequence of a batch can have a drafter of its own. A draft model holds
        one cache, so with one the batch size is 1 (batching draft models is still to do)."""
        return all(d.per_sequence for d in candidates_of(self.drafter))

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgumentError("this engine has no tokenizer: pass prompts as lists of token ids", "prompt")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidArgumentError("this model has no chat template; generate without chat (--no-chat)", "chat")
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer(prompt, add_special_tokens=False).input_ids
        return self.tokenizer(prompt).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: str | SequenceOf[str] | SequenceOf[SequenceOf[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | SequenceOf[str] | None = None,
        speculative: bool = True,
        chat: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> list[GenerationResult]:
        """Generate for each prompt, one after the other; one GenerationResult per prompt, in
        order. num_speculative_tokens: this call's most k (default: the engine's; 0 or
        speculative=False: target-only). With a seed, prompt i gets a generator of its own
        seeded seed + i, as in generate_batched and the server's choices: each prompt's sample
        is its own, the same alone, in a batch or from the response cache."""
        k = num_speculative_tokens if speculative else 0
        settings = self.settings(max_new_tokens, temperature, top_k, top_p, seed, stop, k)
        prompt_ids = [self.prompt_token_ids(p, chat) for p in _as_prompt_list(prompts)]
        seeds = _prompt_seeds(seed, len(prompt_ids))
        sequences = [
            self.sequence(ids, settings, make_generator(s), fork=False, seed=s)
            for ids, s in zip(prompt_ids, seeds, strict=True)
        ]
        return self._decode(sequences, capacity=1)

    def generate_batched(
        self,
        prompts: str | SequenceOf[str] | SequenceOf[SequenceOf[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | SequenceOf[str] | None = None,
        chat: bool = False,
        max_batch_size: int = 8,
        num_speculative_tokens: int | None = None,
    ) -> list[GenerationResult]:
        """As `generate`, but up to max_batch_size prompts decode together (continuous batching,
        decoder.py): one target forward per step verifies every sequence's draft. Each prompt
        gets its own generator, seeded seed + its index when a seed is given."""
        settings = self.settings(max_new_tokens, temperature, top_k, top_p, seed, stop, num_speculative_tokens)
        prompt_ids = [self.prompt_token_ids(p, chat) for p in _as_prompt_list(prompts)]
        seeds = _prompt_seeds(seed, len(prompt_ids))
        sequences = [
            self.sequence(ids, settings, make_generator(s), seed=s) for ids, s in zip(prompt_ids, seeds, strict=True)
        ]
        return self._decode(sequences, capacity=self.batch_capacity(max_batch_size))

    def _decode(self, sequences: list[Sequence], capacity: int) -> list[GenerationResult]:
        """Each sequence's result: from the response cache where it has one, else decoded."""
        cached = {id(seq): hit for seq in sequences if (hit := self.cached_result(seq)) is not None}
        todo = [seq for seq in sequences if id(seq) not in cached]
        self.decoder.capacity = capacity
        decode_all(self.decoder, todo)
        for seq in todo:
            self.remember(seq)
        return [cached.get(id(seq)) or self.result(seq) for seq in sequences]

    def cached_result(self, seq: Sequence) -> GenerationResult | None:
        """The stored answer of a request seen before, if the response cache has a valid one."""
        if self.response_cache is None or seq.cache_key is None:
            return None
        room = min(seq.stopping.max_new_tokens, self.decoder.max_length - len(seq.prompt_ids))
        bounds = Bounds(room, frozenset(seq.stopping.eos_token_ids), bool(seq.stopping.stop_strings))
        found = self.response_cache.get(seq.cache_key, bounds)
        if found is None:
            return None
        seq.generated, reason = found
        seq.finish = Stop(len(seq.generated), reason)
        seq.stats = GenerationStats(seq.drafter_name if seq.k_max else "none", seq.k_max, cached=True)
        seq.stats.generated_tokens = len(seq.generated)
        return self.result(seq)

    def remember(self, seq: Sequence) -> None:
        """Store a finished sequence's answer for the next identical request."""
        if self.response_cache is not None and seq.cache_key is not None and seq.finish is not None:
            self.response_cache.put(seq.cache_key, seq.generated, seq.finish.reason)

    def settings(
        self,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        stop: str | SequenceOf[str] | None,
        num_speculative_tokens: int | None = None,
    ) -> RequestSettings:
        """Check a request's settings; every error names the argument at fault."""
        params = SamplingParams(temperature, top_k, top_p)
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, got {max_new_tokens}", "max_new_tokens")
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        if stop_strings and self.tokenizer is None:
            raise InvalidArgumentError("stop strings need a tokenizer; this engine has none", "stop")
        if any(not s for s in stop_strings):
            raise InvalidArgumentError("stop strings must not be empty", "stop")
        if len(stop_strings) > MAX_STOP_STRINGS:
            raise InvalidArgumentError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop_strings)}", "stop")
        longest = max((len(s) for s in stop_strings), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidArgumentError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}", "stop"
            )
        make_generator(seed)  # checks the seed
        k = self.num_speculative_tokens
        if num_speculative_tokens is not None:
            k = _checked_k(num_speculative_tokens, k, "the k this engine was loaded with; load it with a larger -k")
        decode = self.decode if self.tokenizer else None
        return RequestSettings(
            params, StoppingCriteria(max_new_tokens, self.eos_token_ids, stop_strings, decode), seed, k
        )

    def sequence(
        self,
        prompt_ids: list[int],
        settings: RequestSettings,
        generator: torch.Generator,
        fork: bool = True,
        tag=None,
        seed: int | None = None,
        cacheable: bool = True,
    ) -> Sequence:
        """A sequence for the decoder, with drafters of its own where they can be forked
        (fork=False: the engine's own, as for one generation at a time). seed: the one its
        generator was seeded with, if not settings.seed; cacheable=False: its output is not a
        function of its request alone (a generator shared with earlier sequences)."""
        drafter = self.drafter
        if fork and drafter is not None and drafter.per_sequence:
            drafter = drafter.fork()
        candidates = candidates_of(drafter)
        if settings.fixed_k:  # a seeded sample must not depend on what earlier requests left behind
            candidates = tuple(d for d in candidates if not d.depends_on_history)
        k = settings.num_speculative_tokens if candidates else 0
        name = drafter.name if drafter is not None else "none"
        seed = settings.seed if seed is None else seed
        key = self._cache_key(prompt_ids, settings, seed, candidates, k) if cacheable else None
        return Sequence(
            prompt_ids,
            settings.params,
            settings.stopping,
            generator,
            candidates,
            k,
            settings.fixed_k,
            name,
            tag=tag,
            cache_key=key,
        )

    def _cache_key(
        self, prompt_ids: list[int], settings: RequestSettings, seed: int | None, candidates: tuple, k: int
    ) -> str | None:
        """A response-cache key for deterministic requests: greedy ones, or seeded samples (whose
        tokens depend on the drafts, so everything that decides them counts too: each drafter's
        kind, settings and draft model, k and the policy); None for the others, and for seeded
        samples of drafters that cannot be described (drafts_identity)."""
        if self.response_cache is None or not (settings.params.greedy or seed is not None):
            return None
        stopping, params = settings.stopping, settings.params
        request = dict(
            max_new_tokens=stopping.max_new_tokens,
            stop=list(stopping.stop_strings),
            eos=sorted(stopping.eos_token_ids),
            max_length=self.decoder.max_length,
        )
        if not params.greedy:
            drafts = self.drafts_identity(candidates) if k else []  # target-only: no drafter decides
            if drafts is None:
                return None
            request |= dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed)
            request |= dict(drafts=drafts, k=k, adaptive=self.adaptive, fixed_k=settings.fixed_k)
        return self.response_cache.key(prompt_ids, **request)

    def batch_capacity(self, max_batch_size: int) -> int:
        """Sequences decoded together: max_batch_size, or 1 when the drafter cannot be forked."""
        if max_batch_size < 1:
            raise InvalidArgumentError(f"max_batch_size must be at least 1, got {max_batch_size}", "max_batch_size")
        return max_batch_size if self.drafts_in_batches else 1

    def result(self, seq: Sequence) -> GenerationResult:
        text = None
        if self.tokenizer is not None:
            text = self.decode(seq.generated)
            if seq.finish.reason == "stop" and seq.stopping.stop_strings:
                text = _cut_at_stop_string(text, seq.stopping.stop_strings)
        seq.stats.target_precision = self.precision
        return GenerationResult(text, list(seq.generated), seq.prompt_ids, seq.finish.reason, seq.stats)

    def prompt_token_ids(self, prompt: str | SequenceOf[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidArgumentError("the prompt is empty; give some text to continue", "prompt")
            ids = self.encode(prompt, chat)
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise InvalidArgumentError("a prompt of token ids is empty; give at least one token", "prompt")
            vocab = self.target_runner.vocab_size
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
            if bad is not None:  # named by position: echoing every id back would make the error as long as the prompt
                raise InvalidArgumentError(
                    f"prompt token ids must be in [0, {vocab}), got {ids[bad]} at position {bad}", "prompt"
                )
        if len(ids) >= self.max_model_len:
            limit = self.max_model_len
            holds = f"the model's context holds {limit}"
            if limit < self.target_runner.max_length:
                holds = f"max_model_len is {limit}"
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens but {holds}; shorten the prompt", "prompt")
        return ids


def _prompt_seeds(seed: int | None, count: int) -> list[int | None]:
    """The one seeding rule: prompt (or choice) i is seeded seed + i."""
    return [None if seed is None else seed + i for i in range(count)]


def make_generator(seed: int | None) -> torch.Generator:
    """A generator of its own for a sequence: seeded, or from fresh entropy."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
        return generator
    try:
        generator.manual_seed(seed)
    except (RuntimeError, ValueError, OverflowError, TypeError):
        raise InvalidArgumentError(f"seed must be an integer in [-2**63, 2**64), got {seed}", "seed") from None
    return generator


def _checked_k(k: int, most: int = MAX_SPECULATIVE_TOKENS, why: str = "drafting more per step never pays") -> int:
    """k within [0, most]: an engine's at most MAX_SPECULATIVE_TOKENS, a request's at most its
    engine's (whose policy, stats and metrics were sized for it)."""
    if not isinstance(k, int) or not 0 <= k <= most:
        raise InvalidArgumentError(
            f"num_speculative_tokens (k) must be an integer >= 0 (0 = target-only) and at most {most} ({why}), got {k}",
            "num_speculative_tokens",
        )
    return k


def _checked_max_model_len(max_model_len: int | None, context: int) -> int:
    if max_model_len is None:
        return context
    if not isinstance(max_model_len, int) or not 2 <= max_model_len <= context:
        raise InvalidArgumentError(
            f"max_model_len must be in [2, {context}] (the model's context length; one prompt token and one "
            f"new one at least), got {max_model_len}",
            "max_model_len",
        )
    return max_model_len


def _as_prompt_list(prompts: str | SequenceOf) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidArgumentError("no prompts given; pass a string or a non-empty list", "prompt")
    if all(isinstance(t, int) for t in prompts):
        raise InvalidArgumentError("pass token ids as a list of lists (one list per prompt)", "prompt")
    return prompts


def _cut_at_stop_string(text: str, stop_strings: SequenceOf[str]) -> str:
    return text[: min((text.find(s) for s in stop_strings if s in text), default=len(text))]


def _eos_token_ids(target: PreTrainedModel | ModelRunner, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The end-of-sequence ids transformers' generate would stop on."""
    config = getattr(target, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
