"""The public API: `SpeculativeEngine` loads a target and a drafter and runs the decoder.

Every generation, one prompt or many, runs through the one decode loop (decoder.py) by one
path, `generate`: a single prompt is a batch of one. The engine keeps one `Decoder`, so step
costs and acceptance measured by one call choose k in the next. A request's settings are
checked by core/checks.py (which the CLI and the server call too, before a load or a queue),
and what needs the model (token ids, the context) here; the errors name the argument
(errors.py). The caches' part of a request (its key, a stored answer) is cache/engine_caches.py's.

k, the most tokens drafted per step, is `num_speculative_tokens` in every signature (the
OpenAI-style field of the server's requests; `-k` on the command line).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace
from typing import cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode import precision
from specdecode.cache import DraftStore, ResponseCache
from specdecode.cache.backends import Backend
from specdecode.cache.engine_caches import CacheOptions, EngineCaches
from specdecode.core.adjustments import NO_ADJUSTMENTS, Adjustments
from specdecode.core.checks import (
    DEFAULT_SPECULATIVE_TOKENS,
    check_k,
    check_max_batch_size,
    check_max_model_len,
    check_prompt_text,
    check_request,
    check_seed,
    check_stop_token_ids,
    seeds_for,
)
from specdecode.core.constraints import Constraint, Grammars
from specdecode.core.logprobs import TokenLogprob
from specdecode.core.sampling import SamplingParams
from specdecode.core.stats import GenerationStats
from specdecode.core.stopping import StoppingCriteria
from specdecode.decoder import Decoder, SequenceState, decode_all
from specdecode.drafters import Drafter, candidates_of
from specdecode.drafters.factory import (
    DRAFTERS,
    DrafterOptions,
    check_drafter_name,
    check_drafter_options,
    drafter_identity,
    make_drafter,
)
from specdecode.errors import InvalidArgumentError, PromptTooLongError
from specdecode.loading import DEFAULT_TARGET, load_model, precision_of
from specdecode.runners import ModelRunner, runner_for
from specdecode.runners.base import CompilableRunner
from specdecode.runners.select import resolve_precision, runner_label

__all__ = ["DRAFTERS", "CacheOptions", "DrafterOptions", "GenerationResult", "SpeculativeEngine"]


@dataclass
class GenerationResult:
    text: str | None  # None when the engine has no tokenizer
    token_ids: list[int]  # new tokens only
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked (core/logprobs.py)


@dataclass(frozen=True)
class RequestSettings:
    """A request's checked settings, shared by the sequences it starts (one per prompt or choice)."""

    params: SamplingParams
    stopping: StoppingCriteria
    seed: int | None
    num_speculative_tokens: int
    constraint: Constraint | None = None  # a grammar the answer must follow (core/constraints.py)
    adjustments: Adjustments = NO_ADJUSTMENTS  # logit bias and penalties (core/adjustments.py)
    logprobs: int | None = None  # None: no log-probabilities; n: each token's and the n likeliest

    def with_budget(self, max_new_tokens: int) -> RequestSettings:
        """These settings with another most new tokens: the server checks a request before it
        tokenizes the prompt, and bounds its answer by the room the prompt leaves."""
        return replace(self, stopping=replace(self.stopping, max_new_tokens=max_new_tokens))

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
        drafter: Drafter | None = None,
        *,
        num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
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
        self.num_speculative_tokens = check_k(num_speculative_tokens)
        self.target_runner = runner_for(target, runner) if isinstance(target, PreTrainedModel) else target
        check_max_model_len(max_model_len, self.target_runner.max_length)
        self.max_model_len = self.target_runner.max_length if max_model_len is None else max_model_len
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.eos_token_ids = _eos_token_ids(target, tokenizer)
        model = getattr(self.target_runner, "model", None)
        # the target's precision, named in every result's stats: "float32", "nf4 (bitsandbytes, ...)"
        self.precision = (
            precision_of(model, self.target_runner)
            if model is not None
            else str(self.target_runner.dtype).removeprefix("torch.")
        )
        # the target's quantization as resolved (from_pretrained: --dtype auto may choose w8a8)
        self.quantization: precision.Quantization | None = None
        self.decoder = Decoder(self.target_runner, adaptive, self.max_model_len)
        self.caches = EngineCaches(self.target_runner, tokenizer, self.max_model_len)
        self._grammars: Grammars | None = None  # made on the first constrained request
        if response_cache is not None:
            self.caches.use(response_cache)

    @classmethod
    def from_pretrained(
        cls,
        target: str = DEFAULT_TARGET,
        *,
        draft: str | PreTrainedModel | None = None,
        drafter: str | Drafter = "auto",
        num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
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
        What can be checked without the model is, before it loads.

        runner: "auto" runs supported architectures on the lean fast path (runners/fast_llama.py)
        and the rest on transformers' modeling; "transformers" forces the latter.
        drafter "auto": prompt lookup, then the draft store (`suffix`, when cache.draft_store is on),
        then the draft model if one is given; each step the first that proposes, tried best first
        by measured tokens per second with adaptive k, under which each proposes only while it
        pays. Where the target verifies trees (the fast runner's `verifies_trees`): `recycling`
        (the target's own past predictions, prompt lookup's continuations first), then a
        prompt-lookup tree (for seeded samples, which skip recycling), then the draft model's trees.
        max_model_len: the most tokens a sequence may hold (default: the model's context).
        cache: the response cache and the draft store, in process or on Redis (default: both in
        process; `CacheOptions(response_cache=False, draft_store=False)` for neither).
        quantization: "nf4", "fp4" or "llm-int8" (older spelling "int8", deprecated) quantizes the target with
        bitsandbytes as it loads (embeddings, output head and, in 4 bits, the MLPs' down projections
        stay in dtype); it then runs on transformers' runner, exact relative to the quantized model
        (runners/rowwise.py). "w8a8": int8 weights and per-row int8 activations on the
        Llama-family fast runner, exact relative to that 8-bit model. docs/quantization.md has both.
        None: every weight in dtype.
        dtype "auto": w8a8 where the Llama runner runs the model on a CPU with the own int8 kernel
        (+0.8% perplexity against bfloat16, measured), and for what stays in float bfloat16 where
        this CPU multiplies it natively and speculation is exact in it, else float32
        (precision.resolve; runners.select.resolve_precision); `engine.precision` says which. A
        named dtype quantizes nothing the request does not name.
        keep_model_weights: the fast runners hold the weights in a layout of their own; by default
        the transformers model's copies are freed once the drafter is made (one copy in memory,
        not two), and `target_runner.model` can no longer run. True keeps it runnable.
        compile: run the target's forwards for one sequence compiled by torch.compile (Llama-family
        fast runner; the first forward of each size compiles before it runs, which is slow). Exact
        as eager, but the response cache stays off.
        """
        options = options or DrafterOptions()
        check_k(num_speculative_tokens)
        check_max_model_len(max_model_len)
        if isinstance(drafter, str):
            check_drafter_name(drafter, draft)
            check_drafter_options(drafter, options)
        # the one resolution of the target's precision; the loader and the runner read its fields
        chosen = resolve_precision(target, device, dtype, quantization, runner, trust_remote_code)
        model, tokenizer = load_model(target, device, chosen, trust_remote_code)
        # bitsandbytes quantized it as it loaded; w8a8 is the fast runner's own, from the float weights
        by_runner = chosen.runner_quantization
        engine = cls(
            runner_for(model, runner, by_runner) if by_runner else model,
            tokenizer,
            num_speculative_tokens=num_speculative_tokens,
            runner=runner,
            adaptive=options.adaptive,
            max_model_len=max_model_len,
        )
        engine.quantization = chosen.quantization
        if chosen.chosen and quantization is None and chosen.quantization is not None:
            engine.precision += f" ({precision.AUTO_W8A8_NOTE})"
        elif chosen.chosen:
            engine.precision += " (--dtype auto)"
        if compile:
            engine._compile_target()
        store = engine.open_caches(cache or CacheOptions())
        picked: Drafter | None = None if isinstance(drafter, str) else drafter
        if isinstance(drafter, str):
            # a draft model loads in the target's dtype, unquantized
            load = lambda name: load_model(name, device, chosen.in_float(), trust_remote_code)  # noqa: E731
            picked = make_drafter(drafter, draft, engine.target_runner, tokenizer, load, runner, options, store)
        engine.drafter = picked
        if engine.response_cache is not None:  # a draft model's fingerprint reads its weights: now, not in a request
            engine.drafts_identity(candidates_of(picked))
        if not keep_model_weights:
            engine.model_fingerprint()  # read the weights now, for caches opened later
            engine.target_runner.release_model_weights()
        return engine

    def _compile_target(self) -> None:
        if not self.target_runner.compilable:
            raise InvalidArgumentError(
                f"compile runs on the Llama-family fast runner; {type(self.target_runner).__name__} "
                "runs this target: leave compile out",
                "compile",
            )
        cast(CompilableRunner, self.target_runner).compile()  # compilable: it has compile()
        self.precision += ", compiled"

    # --- the caches (cache/engine_caches.py) ---

    def open_caches(self, options: CacheOptions) -> DraftStore | None:
        """Open the backend, turn the response cache on where it is exact, and prefix reuse
        on or off (on where exact unless asked otherwise); the draft store."""
        self.decoder.slots.reuse_prefixes(options.prefix_cache)
        return self.caches.open(options)

    def use_response_cache(self, cache: ResponseCache) -> None:
        """Serve repeated deterministic requests from cache, where exact (see cache_note)."""
        self.caches.use(cache)

    def model_fingerprint(self) -> str:
        """What the caches key entries by (EngineCaches.fingerprint); computed once."""
        return self.caches.fingerprint()

    @property
    def response_cache(self) -> ResponseCache | None:
        return self.caches.response_cache

    @response_cache.setter
    def response_cache(self, cache: ResponseCache | None) -> None:
        self.caches.response_cache = cache

    @property
    def cache_note(self) -> str:
        """Why the response cache is on or off."""
        return self.caches.note

    @cache_note.setter
    def cache_note(self, note: str) -> None:
        self.caches.note = note

    @property
    def cache_backend(self) -> Backend | None:
        """Where the response cache and draft store live (None until open_caches)."""
        return self.caches.backend

    def drafts_identity(self, candidates: tuple[Drafter, ...]) -> list | None:
        """What decides the drafts of these candidates (factory.drafter_identity, each), for
        the key of a seeded sample; None if one of them cannot be described."""
        identities = [drafter_identity(d) for d in candidates]
        return None if None in identities else identities

    @property
    def adaptive(self) -> bool:
        return self.decoder.adaptive

    def with_drafter(
        self,
        drafter: Drafter | None,
        num_speculative_tokens: int,
        *,
        adaptive: bool = False,
        response_cache: bool = False,
    ) -> SpeculativeEngine:
        """This engine's target and tokenizer (shared, not copied) with another drafter, k and
        a decoder of its own: a system to compare with this one in the same process. The decoder
        shares this one's measured step costs (the runner's, on this machine), not its drafters'
        acceptance. It answers from this engine's response cache only if asked: a comparison
        would time the cache."""
        view = copy.copy(self)
        view.drafter, view.num_speculative_tokens = drafter, check_k(num_speculative_tokens)
        reuses = self.decoder.slots.reuses_prefixes
        view.decoder = Decoder(self.target_runner, adaptive, self.max_model_len, reuses, self.decoder.costs)
        view.caches = copy.copy(self.caches)  # the same backend and cache, switched off alone
        if not response_cache:
            view.response_cache = None
        return view

    @property
    def drafts_in_batches(self) -> bool:
        """Whether each sequence of a batch can have a drafter of its own. A draft model holds
        one cache, so with one the batch size is 1 (batching draft models is still to do)."""
        return all(d.per_sequence for d in candidates_of(self.drafter))

    # --- requests ---

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgumentError("this engine has no tokenizer: pass prompts as lists of token ids", "prompt")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidArgumentError("this model has no chat template; generate without chat (--no-chat)", "chat")
            text = self.chat_prompt([{"role": "user", "content": prompt}])
            return self.tokenizer(text, add_special_tokens=False).input_ids  # the template wrote them
        return self.tokenizer(prompt).input_ids

    def chat_prompt(self, conversation: list[dict], tools: list | None = None) -> str:
        """A conversation rendered by the model's chat template, ready for the assistant's answer:
        text with the template's special tokens in it, to encode without adding more."""
        if self.tokenizer is None:
            raise InvalidArgumentError("this engine has no tokenizer: pass prompts as lists of token ids", "prompt")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as error:  # templates raise on what they do not accept (roles out of order, ...)
            raise InvalidArgumentError(f"the model's chat template refused the messages: {error}", "messages") from None
        assert isinstance(text, str)  # tokenize=False, one conversation: its text
        return text

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise InvalidArgumentError("this engine has no tokenizer: its results are token ids only", "token_ids")
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids: one string
        return text

    def generate(
        self,
        prompts: str | SequenceOf[str] | SequenceOf[SequenceOf[int]],
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        stop: str | SequenceOf[str] | None = None,
        stop_token_ids: SequenceOf[int] | None = None,
        chat: bool = False,
        num_speculative_tokens: int | None = None,
        speculative: bool = True,
        max_batch_size: int = 1,
        constraint: Constraint | None = None,
        logit_bias: Mapping[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logprobs: int | None = None,
    ) -> list[GenerationResult]:
        """One GenerationResult per prompt, in order. Up to max_batch_size prompts decode
        together (continuous batching, decoder.py: one target forward per step verifies every
        sequence's draft; 1, the default: one after the other); a drafter that cannot be forked
        (a draft model) decodes one at a time. num_speculative_tokens: this call's most k
        (default: the engine's; 0 or speculative=False: target-only). With a seed, prompt i
        gets a generator of its own seeded seed + i (core.checks.seeds_for), as the server's
        choices do: each prompt's sample is its own, the same alone, in a batch or from the
        response cache. constraint: a grammar the answers follow (structured outputs: JSON, a
        JSON schema, a regular expression, choices, a Lark grammar); logit_bias and the
        penalties: OpenAI's and transformers' (core/adjustments.py); stop_token_ids: tokens that
        end an answer as EOS does; logprobs: n gives each new token's log-probability and the n
        likeliest tokens there (core/logprobs.py). Every option is exact under speculation."""
        settings = self.settings(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            num_speculative_tokens=num_speculative_tokens if speculative else 0,
            constraint=constraint,
            adjustments=Adjustments.of(logit_bias, presence_penalty, frequency_penalty, repetition_penalty),
            logprobs=logprobs,
        )
        capacity = self.batch_capacity(max_batch_size)
        prompt_ids = [self.prompt_token_ids(p, chat) for p in _as_prompt_list(prompts)]
        sequences = [
            self.sequence(ids, settings, make_generator(s), seed=s)
            for ids, s in zip(prompt_ids, seeds_for(seed, len(prompt_ids)), strict=True)
        ]
        return self._decode(sequences, capacity)

    def _decode(self, sequences: list[SequenceState], capacity: int) -> list[GenerationResult]:
        """Each sequence's result: from the response cache where it has one, else decoded."""
        todo = [seq for seq in sequences if not self.caches.answer(seq)]
        self.decoder.capacity = capacity
        decode_all(self.decoder, todo)
        for seq in todo:
            self.caches.remember(seq)
        return [self.result(seq) for seq in sequences]

    def settings(
        self,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        stop: str | SequenceOf[str] | None = None,
        stop_token_ids: SequenceOf[int] | None = None,
        num_speculative_tokens: int | None = None,
        constraint: Constraint | None = None,
        adjustments: Adjustments = NO_ADJUSTMENTS,
        logprobs: int | None = None,
    ) -> RequestSettings:
        """Check a request's settings (core.checks.check_request, and a k at most this engine's,
        token ids within its vocabulary); every error names the argument at fault."""
        params, stop_strings = check_request(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            stop=stop,
            num_speculative_tokens=num_speculative_tokens,
            most_k=self.num_speculative_tokens,
            logprobs=logprobs,
        )
        check_stop_token_ids(stop_token_ids, self.target_runner.vocab_size)
        adjustments.check_vocabulary(self.target_runner.vocab_size)
        if stop_strings and self.tokenizer is None:
            raise InvalidArgumentError("stop strings need a tokenizer; this engine has none", "stop")
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        decode = self.decode if self.tokenizer else None
        if constraint is not None:
            self.grammars.grammar(constraint)  # checked here: a bad one is this request's error
        stops = self.eos_token_ids | frozenset(stop_token_ids or ())
        stopping = StoppingCriteria(max_new_tokens, stops, stop_strings, decode)
        return RequestSettings(params, stopping, seed, k, constraint, adjustments, logprobs)

    @property
    def grammars(self) -> Grammars:
        """The grammars of constrained requests, compiled for this engine's tokenizer."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidArgumentError("structured outputs need a tokenizer; this engine has none", "constraint")
            if not self.eos_token_ids:
                raise InvalidArgumentError(
                    "structured outputs need the model's end-of-sequence token, which ends a finished answer; "
                    "this model has none",
                    "constraint",
                )
            self._grammars = Grammars(self.tokenizer, self.target_runner.vocab_size, self.eos_token_ids)
        return self._grammars

    def sequence(
        self,
        prompt_ids: list[int],
        settings: RequestSettings,
        generator: torch.Generator,
        *,
        fork: bool = True,
        tag=None,
        seed: int | None = None,
        cacheable: bool = True,
    ) -> SequenceState:
        """A sequence for the decoder, with drafters of its own where they can be forked
        (fork=False: the engine's own). seed: the one its generator was seeded with, if not
        settings.seed; cacheable=False: its output is not a function of its request alone (a
        generator shared with earlier sequences)."""
        drafter = self.drafter
        if fork and drafter is not None and drafter.per_sequence:
            drafter = drafter.fork()
        candidates = candidates_of(drafter)
        if settings.fixed_k:  # a seeded sample must not depend on what earlier requests left behind
            candidates = tuple(d for d in candidates if not d.depends_on_history)
        k = settings.num_speculative_tokens if candidates else 0
        name = drafter.name if drafter is not None else "none"
        seed = settings.seed if seed is None else seed
        key = None
        if cacheable:
            drafts = lambda: self.drafts_identity(candidates)  # noqa: E731 - only seeded samples need it
            key = self.caches.key(prompt_ids, settings, seed, k, self.adaptive, drafts)
        matcher = self.grammars.matcher(settings.constraint) if settings.constraint is not None else None
        return SequenceState(
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
            matcher=matcher,
            adjustments=settings.adjustments,
            top_logprobs=settings.logprobs,
        )

    def batch_capacity(self, max_batch_size: int) -> int:
        """Sequences decoded together: max_batch_size, or 1 when the drafter cannot be forked."""
        check_max_batch_size(max_batch_size)
        return max_batch_size if self.drafts_in_batches else 1

    def result(self, seq: SequenceState) -> GenerationResult:
        finish, stats = seq.finish, seq.stats
        assert finish is not None and stats is not None, "result() of a sequence the decoder has not finished"
        text = None
        if self.tokenizer is not None:
            text = self.decode(seq.generated)
            if finish.reason == "stop" and seq.stopping.stop_strings:
                text = _cut_at_stop_string(text, seq.stopping.stop_strings)
        stats.target_precision = self.precision
        stats.target_runner = runner_label(self.target_runner)
        logprobs = list(seq.logprobs) if seq.top_logprobs is not None else None
        return GenerationResult(text, list(seq.generated), seq.prompt_ids, finish.reason, stats, logprobs)

    def prompt_token_ids(self, prompt: str | SequenceOf[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            check_prompt_text(prompt)
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


def make_generator(seed: int | None) -> torch.Generator:
    """A generator of its own for a sequence: seeded, or from fresh entropy."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
        return generator
    check_seed(seed)
    generator.manual_seed(seed)
    return generator


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
