"""The speculative decoding loop and the public `SpeculativeEngine` API.

One step: the drafter proposes up to k tokens, the target scores all of them in one
forward, `verify` keeps an exact prefix and adds one target token, and both caches roll
back to what was kept. Target-only decoding is the same loop with k = 0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from specdecode.errors import InvalidArgumentError, PromptTooLongError
from specdecode.kv_cache import CachedSequence, ModelRunner, runner_for
from specdecode.models import DEFAULT_TARGET, check_same_vocabulary, load_model
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.stats import GenerationStats
from specdecode.stopping import StoppingCriteria
from specdecode.verification import verify

DRAFTERS = ("auto", "model", "prompt-lookup", "none")


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
) -> tuple[list[int], str, GenerationStats]:
    """Generate after prompt_ids; returns the new tokens, the finish reason and the stats."""
    k = k if drafter is not None else 0
    stats = GenerationStats(drafter.name if drafter is not None and k > 0 else "none", k)
    if drafter is not None:
        drafter.begin(prompt_ids)
    tokens, generated = list(prompt_ids), []
    max_length = target.runner.max_length
    while True:
        room = min(stopping.max_new_tokens - len(generated), max_length - len(tokens))
        draft = Draft.empty()
        if k > 0 and room > 1:  # drafting past the budget would be wasted
            draft = drafter.propose(tokens, min(k, room - 1), params, generator)
        # p for the position after the last token and after each draft token
        p = logits_to_probs(target.logits(tokens + draft.tokens.tolist(), len(draft) + 1), params)
        verdict = verify(draft.tokens, draft.probs, p, generator)
        if drafter is not None:
            drafter.observe(len(draft), verdict.num_accepted)
        emitted = draft.tokens[: verdict.num_accepted].tolist() + [verdict.next_token]
        stats.record_step(len(draft), verdict.num_accepted)
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
    ) -> SpeculativeEngine:
        """Load target (and draft) by short name, folder, .gguf file or Hub id; pick the drafter.

        runner: "auto" runs supported architectures on the lean fast path (fast_llama.py) and
        the rest on transformers' modeling; "transformers" forces the latter.
        """
        if isinstance(drafter, str) and drafter not in DRAFTERS:
            raise InvalidArgumentError(f"unknown drafter '{drafter}'; choose one of: {', '.join(DRAFTERS)}")
        if drafter == "model" and draft is None:
            raise InvalidArgumentError("drafter 'model' needs a draft model: pass draft=NAME (--draft in the CLI)")
        model, tokenizer = load_model(target, device, dtype, trust_remote_code)
        engine = cls(model, tokenizer, None, num_speculative_tokens, runner)
        if isinstance(drafter, str):
            drafter = _make_drafter(drafter, draft, engine, device, dtype, trust_remote_code, runner)
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
        params = SamplingParams(temperature, top_k, top_p)
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        if stop_strings and self.tokenizer is None:
            raise InvalidArgumentError("stop strings need a tokenizer; this engine has none")
        if any(not s for s in stop_strings):
            raise InvalidArgumentError("stop strings must not be empty")
        prompt_ids = [self._prompt_ids(p, chat) for p in _as_prompt_list(prompts)]
        stopping = StoppingCriteria(
            max_new_tokens, self.eos_token_ids, stop_strings, self.decode if self.tokenizer else None
        )
        generator = torch.Generator()
        generator.manual_seed(seed) if seed is not None else generator.seed()
        k = self.num_speculative_tokens if speculative else 0
        return [self._generate_one(ids, k, params, stopping, generator) for ids in prompt_ids]

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
            target, self.drafter, prompt_ids, k, params, stopping, generator
        )
        stats.wall_time_s = time.perf_counter() - start
        text = None
        if self.tokenizer is not None:
            text = self.decode(token_ids)
            if reason == "stop" and stopping.stop_strings:
                text = _cut_at_stop_string(text, stopping.stop_strings)
        return GenerationResult(text, token_ids, prompt_ids, reason, stats)

    def _prompt_ids(self, prompt: str | Sequence[int], chat: bool) -> list[int]:
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
    device: str,
    dtype: str,
    trust_remote_code: bool,
    runner: str,
) -> Drafter | None:
    if name == "none":
        return None
    if name == "prompt-lookup" or (name == "auto" and draft is None):
        return PromptLookupDrafter()
    if isinstance(draft, PreTrainedModel):
        draft_model, draft_tokenizer = draft, None
    else:
        draft_model, draft_tokenizer = load_model(draft, device, dtype, trust_remote_code)
    draft_runner = runner_for(draft_model.to(engine.target_runner.device), runner)
    check_same_vocabulary(
        engine.tokenizer, draft_tokenizer, engine.target_runner.vocab_size, draft_runner.vocab_size
    )
    return ModelDrafter(draft_runner)
