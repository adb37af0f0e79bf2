"""The speculative decoding loop and the public `SpeculativeEngine` API.

One step: the drafter proposes up to k tokens, the target scores all of them in one
forward, `verify` keeps an exact prefix and adds one target token, and both caches roll
back to what was kept. Target-only decoding is the same loop with k = 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.adaptive import AdaptiveDrafter, StepCosts
from specdecode.drafters import (
    AutoDrafter,
    CrossTokenizerDrafter,
    Draft,
    Drafter,
    ModelDrafter,
    PromptLookupDrafter,
    self_quantized_drafter,
)
from specdecode.errors import InvalidArgumentError, PromptTooLongError, VocabularyMismatchError
from specdecode.kv_cache import CachedSequence, ModelRunner, runner_for
from specdecode.models import DEFAULT_TARGET, check_same_vocabulary, load_model
from specdecode.sampling import SamplingParams
from specdecode.stats import GenerationStats
from specdecode.stopping import StoppingCriteria
from specdecode.verification import verify_logits

DRAFTERS = ("auto", "model", "prompt-lookup", "self-quantized", "cross-tokenizer", "none")


@dataclass(frozen=True)
class DrafterOptions:
    """How a drafter named in from_pretrained (or the CLI) is built."""

    adaptive: bool = True  # choose k <= num_speculative_tokens per step from measurements (adaptive.py)
    min_ngram: int = 1  # prompt lookup: shortest n-gram matched
    max_ngram: int = 3  # prompt lookup: longest n-gram matched, tried first
    max_continuation: int | None = None  # prompt lookup: most tokens copied per step (None: k)
    lookup_history: bool = False  # prompt lookup also searches earlier requests' text
    quantization: str = "bfloat16"  # self-quantized: "bfloat16" or "int8" (weight-only)
    min_confidence: float = 0.0  # model drafters stop after a token they give less probability


@dataclass
class GenerationResult:
    text: str | None  # None when the engine has no tokenizer
    token_ids: list[int]  # new tokens only
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats


def speculative_decode(
    target: CachedSequence,
    drafter: Drafter | None,
    prompt_ids: list[int],
    k: int,
    params: SamplingParams,
    stopping: StoppingCriteria,
    generator: torch.Generator | None,
    step_costs: StepCosts | None = None,
) -> tuple[list[int], str, GenerationStats]:
    """Generate after prompt_ids; returns the new tokens, the finish reason and the stats.

    step_costs, if given, receives the seconds of every verification step but the first
    (which prefills the prompt), by tokens verified: what adaptive drafters weigh k against.
    """
    k = k if drafter is not None else 0
    name = drafter.name if drafter is not None and k > 0 else "none"
    stats = GenerationStats(name, k, getattr(drafter, "k_policy", "fixed") if k > 0 else "fixed")
    if drafter is not None:
        drafter.begin(prompt_ids)
    tokens, generated = list(prompt_ids), []
    max_length = target.runner.max_length
    while True:
        room = min(stopping.max_new_tokens - len(generated), max_length - len(tokens))
        draft = Draft.empty()
        # the first step prefills the prompt alone, as target-only decoding does: then the
        # prompt's cache, and every logit after it, is computed the same way in both
        # (FastLlamaRunner's half precision relies on it); drafting past the budget is waste
        if k > 0 and generated and room > 1:
            draft = drafter.propose(tokens, min(k, room - 1), params, generator)
        start = time.perf_counter()
        # p for the position after the last token and after each draft token
        logits = target.logits(tokens + draft.tokens.tolist(), len(draft) + 1)
        verdict = verify_logits(draft.tokens, draft.probs, logits, params, generator)
        if step_costs is not None and generated:
            step_costs.record(len(draft) + 1, time.perf_counter() - start)
        if drafter is not None:
            drafter.observe(len(draft), verdict.num_accepted)
        emitted = draft.tokens[: verdict.num_accepted].tolist() + [verdict.next_token]
        stats.record_step(len(draft), verdict.num_accepted, draft.source)
        tokens += emitted
        generated += emitted
        stop = stopping.check(generated, len(emitted), context_full=len(tokens) >= max_length)
        if stop is not None:
            generated = generated[: stop.keep]
            stats.generated_tokens = len(generated)
            return generated, stop.reason, stats


class SpeculativeEngine:
    """A target model, an optional drafter, and the loop that runs them."""

    def __init__(
        self,
        target: PreTrainedModel | ModelRunner,
        tokenizer: PreTrainedTokenizerBase | None = None,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 4,
        runner: str = "auto",
    ):
        if num_speculative_tokens < 0:
            raise InvalidArgumentError(
                f"num_speculative_tokens (k) must be >= 0 (0 = target-only), got {num_speculative_tokens}"
            )
        self.target_runner = runner_for(target, runner) if isinstance(target, PreTrainedModel) else target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.eos_token_ids = _eos_token_ids(target, tokenizer)
        self.step_costs = StepCosts()  # measured by every generation, read by adaptive drafters

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
    ) -> SpeculativeEngine:
        """Load target (and draft) by short name, folder, .gguf file or Hub id; pick the drafter.

        runner: "auto" runs supported architectures on the lean fast path (fast_llama.py) and
        the rest on transformers' modeling; "transformers" forces the latter.
        drafter "auto": prompt lookup, then the draft model if one is given, each step the first
        that proposes; adaptive drafters propose only while they pay.
        """
        if isinstance(drafter, str) and drafter not in DRAFTERS:
            raise InvalidArgumentError(f"unknown drafter '{drafter}'; choose one of: {', '.join(DRAFTERS)}")
        if drafter in ("model", "cross-tokenizer") and draft is None:
            raise InvalidArgumentError(f"drafter '{drafter}' needs a draft model: pass draft=NAME (--draft in the CLI)")
        model, tokenizer = load_model(target, device, dtype, trust_remote_code)
        engine = cls(model, tokenizer, None, num_speculative_tokens, runner)
        if isinstance(drafter, str):
            load = lambda name: load_model(name, device, dtype, trust_remote_code)  # noqa: E731
            drafter = _make_drafter(drafter, draft, engine, load, runner, options or DrafterOptions())
        engine.drafter = drafter
        return engine

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgumentError("this engine has no tokenizer: pass prompts as lists of token ids")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidArgumentError("this model has no chat template; generate without chat (--no-chat)")
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer(prompt, add_special_tokens=False).input_ids
        return self.tokenizer(prompt).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        speculative: bool = True,
        chat: bool = False,
    ) -> list[GenerationResult]:
        """Generate for each prompt; one GenerationResult per prompt, in order."""
        params, stopping, generator = self.sampling_setup(max_new_tokens, temperature, top_k, top_p, seed, stop)
        prompt_ids = [self.prompt_token_ids(p, chat) for p in _as_prompt_list(prompts)]
        # adaptive k follows the clock; a seed must repeat its samples, so seeded sampling drafts k every step
        self.step_costs.fixed_k = seed is not None and not params.greedy
        k = self.num_speculative_tokens if speculative else 0
        return [self._generate_one(ids, k, params, stopping, generator) for ids in prompt_ids]

    def generate_batched(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        chat: bool = False,
        max_batch_size: int = 8,
    ) -> list[GenerationResult]:
        """As `generate`, but up to max_batch_size prompts decode together (continuous batching,
        batching.py): one target forward per step verifies every sequence's draft. Each prompt
        gets its own generator, seeded seed + its index when a seed is given."""
        from specdecode.batching import BatchSequence, decode_all

        params, stopping, _ = self.sampling_setup(max_new_tokens, temperature, top_k, top_p, seed, stop)
        prompt_ids = [self.prompt_token_ids(p, chat) for p in _as_prompt_list(prompts)]
        decoder = self.batch_decoder(max_batch_size)
        fixed_k = seed is not None and not params.greedy  # seeded samples must not depend on the batch
        order = [
            BatchSequence(ids, params, stopping, _generator(None if seed is None else seed + i), self.sequence_drafter(), fixed_k)
            for i, ids in enumerate(prompt_ids)
        ]
        decode_all(decoder, order)
        return [self.result(s.prompt_ids, s.generated, s.finish.reason, s.stats, stopping) for s in order]

    def sampling_setup(
        self,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        stop: str | Sequence[str] | None,
    ) -> tuple[SamplingParams, StoppingCriteria, torch.Generator]:
        """Check a request's settings; its sampling params, stopping criteria and generator."""
        params = SamplingParams(temperature, top_k, top_p)
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        if stop_strings and self.tokenizer is None:
            raise InvalidArgumentError("stop strings need a tokenizer; this engine has none")
        if any(not s for s in stop_strings):
            raise InvalidArgumentError("stop strings must not be empty")
        stopping = StoppingCriteria(
            max_new_tokens, self.eos_token_ids, stop_strings, self.decode if self.tokenizer else None
        )
        return params, stopping, _generator(seed)

    def batch_decoder(self, max_batch_size: int):
        """A BatchDecoder over this engine's target with max_batch_size slots (1 when the drafter
        cannot be forked per sequence); k adapts when this engine's drafter is adaptive."""
        from specdecode.batch_runner import BatchRunner
        from specdecode.batching import BatchDecoder

        if max_batch_size < 1:
            raise InvalidArgumentError(f"max_batch_size must be at least 1, got {max_batch_size}")
        runner = BatchRunner(self.target_runner, max_batch_size if self.drafts_in_batches else 1)
        adaptive = getattr(self.drafter, "k_policy", "fixed") != "fixed"
        return BatchDecoder(runner, self.num_speculative_tokens, adaptive)

    @property
    def drafts_in_batches(self) -> bool:
        """Whether each sequence of a batch can have a drafter of its own. A draft model holds
        one cache, so with one the batch size is 1 (batching draft models is still to do)."""
        return self.drafter is None or hasattr(self._base_drafter, "fork")

    def sequence_drafter(self) -> Drafter | None:
        """The drafter for one more sequence of a batch: a fork of this engine's drafter when
        it has forks, else the drafter itself (then batches hold one sequence)."""
        fork = getattr(self._base_drafter, "fork", None)
        return fork() if fork is not None else self.drafter

    @property
    def _base_drafter(self) -> Drafter | None:
        # the batch decoder chooses k for every sequence itself, so it forks the drafter inside
        return self.drafter.inner if isinstance(self.drafter, AdaptiveDrafter) else self.drafter

    def _generate_one(
        self,
        prompt_ids: list[int],
        k: int,
        params: SamplingParams,
        stopping: StoppingCriteria,
        generator: torch.Generator,
    ) -> GenerationResult:
        start = time.perf_counter()
        target = CachedSequence(self.target_runner)
        token_ids, reason, stats = speculative_decode(
            target, self.drafter, prompt_ids, k, params, stopping, generator, self.step_costs
        )
        stats.wall_time_s = time.perf_counter() - start
        return self.result(prompt_ids, token_ids, reason, stats, stopping)

    def result(
        self, prompt_ids: list[int], token_ids: list[int], reason: str, stats: GenerationStats, stopping: StoppingCriteria
    ) -> GenerationResult:
        text = None
        if self.tokenizer is not None:
            text = self.decode(token_ids)
            if reason == "stop" and stopping.stop_strings:
                text = _cut_at_stop_string(text, stopping.stop_strings)
        return GenerationResult(text, token_ids, prompt_ids, reason, stats)

    def prompt_token_ids(self, prompt: str | Sequence[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidArgumentError("the prompt is empty; give some text to continue")
            ids = self.encode(prompt, chat)
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise InvalidArgumentError("a prompt of token ids is empty; give at least one token")
            vocab = self.target_runner.vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise InvalidArgumentError(f"prompt token ids must be in [0, {vocab}), got {ids}")
        if len(ids) >= self.target_runner.max_length:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but the model's context holds {self.target_runner.max_length}; "
                "shorten the prompt"
            )
        return ids


def _generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # fresh entropy
    else:
        generator.manual_seed(seed)
    return generator


def _as_prompt_list(prompts: str | Sequence) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidArgumentError("no prompts given; pass a string or a non-empty list")
    if all(isinstance(t, int) for t in prompts):
        raise InvalidArgumentError("pass token ids as a list of lists (one list per prompt)")
    return prompts


def _cut_at_stop_string(text: str, stop_strings: Sequence[str]) -> str:
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


def _make_drafter(
    name: str,
    draft: str | PreTrainedModel | None,
    engine: SpeculativeEngine,
    load: Callable[[str], tuple[PreTrainedModel, PreTrainedTokenizerBase]],
    runner: str,
    options: DrafterOptions,
) -> Drafter | None:
    if name == "none":
        return None
    wrap = (lambda d: AdaptiveDrafter(d, engine.step_costs)) if options.adaptive else (lambda d: d)
    lookup = PromptLookupDrafter(options.min_ngram, options.max_ngram, options.max_continuation, options.lookup_history)
    if name == "prompt-lookup":
        return wrap(lookup)
    if name == "self-quantized":
        return wrap(self_quantized_drafter(engine.target_runner.model, options.quantization, options.min_confidence))
    model_drafter = _draft_model_drafter(name, draft, engine, load, runner, options) if draft is not None else None
    if name == "auto":
        candidates = [wrap(d) for d in (lookup, model_drafter) if d is not None]
        return AutoDrafter(candidates) if len(candidates) > 1 else candidates[0]
    return wrap(model_drafter)


def _draft_model_drafter(
    name: str,
    draft: str | PreTrainedModel,
    engine: SpeculativeEngine,
    load: Callable[[str], tuple[PreTrainedModel, PreTrainedTokenizerBase]],
    runner: str,
    options: DrafterOptions,
) -> ModelDrafter | CrossTokenizerDrafter:
    """A "cross-tokenizer" drafter if asked for, else a "model" drafter with the target's tokenizer."""
    draft_model, draft_tokenizer = (draft, None) if isinstance(draft, PreTrainedModel) else load(draft)
    draft_runner = runner_for(draft_model.to(engine.target_runner.device), runner)
    if name == "cross-tokenizer":
        if engine.tokenizer is None or draft_tokenizer is None:
            raise InvalidArgumentError("drafter 'cross-tokenizer' needs the target's and the draft's tokenizers")
        return CrossTokenizerDrafter(draft_runner, draft_tokenizer, engine.tokenizer)
    try:
        check_same_vocabulary(engine.tokenizer, draft_tokenizer, engine.target_runner.vocab_size, draft_runner.vocab_size)
    except VocabularyMismatchError as error:
        raise VocabularyMismatchError(f"{error}, or draft through text with drafter 'cross-tokenizer'") from None
    return ModelDrafter(draft_runner, options.min_confidence)
