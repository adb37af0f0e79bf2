"""The systems a benchmark compares, all on the same loaded target and the same prompt ids:

(a) transformers' `generate`, target only;
(b) transformers' assisted generation: prompt lookup, or an assistant (draft) model;
(c) this engine, target only (the same loop with k = 0);
(d) this engine with a drafter and k.

Every system is timed the same way, from prompt ids in to token ids out, so the
comparison covers prefill, decoding and all per-step overhead alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdecode.core.stats import GenerationStats
from specdecode.drafters import ModelDrafter, PromptLookupDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.loading import check_same_vocabulary, load_model
from specdecode.runners import runner_for

HF, ENGINE = "hf", "specdecode"


@dataclass(frozen=True)
class SystemSpec:
    framework: str  # HF or ENGINE
    drafter: str = "none"  # "none", "prompt-lookup" or "model"
    k: int = 0  # tokens drafted per step; 0 for target-only
    draft: str | None = None  # the draft model, for drafter "model"

    @property
    def speculative(self) -> bool:
        return self.drafter != "none"

    @property
    def group(self) -> str:
        """The issue's letter: a, b (transformers), c, d (this engine)."""
        return {(HF, False): "a", (HF, True): "b", (ENGINE, False): "c", (ENGINE, True): "d"}[
            (self.framework, self.speculative)
        ]

    @property
    def series(self) -> str:
        """The system without its k: one line in a tokens/s-versus-k plot."""
        if not self.speculative:
            return f"{self.framework} target-only"
        drafter = f"draft {Path(self.draft).name}" if self.drafter == "model" else self.drafter
        return f"{self.framework} {drafter}"

    @property
    def name(self) -> str:
        return self.series + (f" k={self.k}" if self.speculative else "")

    def on(self, framework: str) -> SystemSpec:
        """The same drafter and k run by the other framework: (b) for (d), (a) for (c)."""
        return replace(self, framework=framework)


def plan_systems(drafters: tuple[str, ...], drafts: tuple[str, ...], k_values: tuple[int, ...]) -> list[SystemSpec]:
    """(a), then (b) for every drafter and k, (c), then (d) for every drafter and k."""
    speculative = [
        SystemSpec(ENGINE, drafter, k, draft)
        for drafter in drafters
        for draft in (drafts if drafter == "model" else (None,))
        for k in k_values
    ]
    return [SystemSpec(HF), *(s.on(HF) for s in speculative), SystemSpec(ENGINE), *speculative]


@dataclass
class Output:
    token_ids: list[int]  # new tokens only
    wall_time_s: float
    stats: GenerationStats | None  # this engine's own counts; None for transformers


class HFSystem:
    """transformers' generate, with prompt lookup or an assistant model for (b)."""

    def __init__(self, spec: SystemSpec, engine: SpeculativeEngine, assistant: PreTrainedModel | None, max_ngram: int):
        self.spec = spec
        self.model = engine.target_runner.model
        eos = sorted(engine.eos_token_ids)
        # the engine's end-of-sequence ids, so both stop at the same tokens
        self.options = dict(eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
        if spec.drafter == "prompt-lookup":
            # the same n-gram sizes as our drafter, so the two differ only in implementation
            self.options |= dict(prompt_lookup_num_tokens=spec.k, max_matching_ngram_size=max_ngram)
        elif spec.drafter == "model":
            # exactly k drafts a step: no adaptive schedule, no early stop on low draft confidence
            self.options |= dict(
                assistant_model=assistant,
                num_assistant_tokens=spec.k,
                num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0,
            )

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Output:
        sampling = dict(do_sample=False)
        if temperature > 0:
            # top_k=0 and top_p=1 turn off transformers' default top-k of 50, as in the engine
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        input_ids = torch.tensor([prompt_ids], device=self.model.device)
        options = self.options | sampling | dict(max_new_tokens=max_new_tokens)

        def run() -> list[int]:
            with torch.inference_mode():
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **options)
            return out[0, len(prompt_ids) :].tolist()

        token_ids, seconds = _timed(run)
        return Output(token_ids, seconds, None)


class EngineSystem:
    """This engine, target-only or with one drafter and k."""

    def __init__(self, spec: SystemSpec, engine: SpeculativeEngine):
        self.spec = spec
        self.engine = engine

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Output:
        def run():
            return self.engine.generate(
                [prompt_ids], max_new_tokens, temperature, seed=seed, speculative=self.spec.speculative
            )[0]

        result, seconds = _timed(run)
        return Output(result.token_ids, seconds, result.stats)


def build_systems(
    specs: list[SystemSpec], engine: SpeculativeEngine, draft_models: dict[str, PreTrainedModel]
) -> list[HFSystem | EngineSystem]:
    """Runnable systems that share the loaded target (and draft models): nothing is loaded twice."""
    lookup = PromptLookupDrafter()
    # draft runners chosen as the engine chooses its own (the fast path where one applies)
    model_drafters = {name: ModelDrafter(runner_for(model)) for name, model in draft_models.items()}
    systems = []
    for spec in specs:
        drafter = lookup if spec.drafter == "prompt-lookup" else model_drafters.get(spec.draft)
        if spec.framework == HF:
            systems.append(HFSystem(spec, engine, draft_models.get(spec.draft), lookup.max_ngram))
        else:
            # fixed k, so that k is what is measured
            systems.append(EngineSystem(spec, engine.with_drafter(drafter, spec.k)))
    return systems


def load_draft(name: str, engine: SpeculativeEngine, device: str, dtype: str) -> PreTrainedModel:
    """A draft model on the target's device, checked to share the target's vocabulary."""
    model, tokenizer = load_model(name, device, dtype)
    model = model.to(engine.target_runner.model.device)
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    check_same_vocabulary(engine.tokenizer, tokenizer, engine.target_runner.vocab_size, vocab_size)
    return model


def _timed(run):
    """run()'s result and its wall time; on a GPU, queued kernels are waited for on both sides."""
    _synchronize()
    start = time.perf_counter()
    result = run()
    _synchronize()
    return result, time.perf_counter() - start


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
