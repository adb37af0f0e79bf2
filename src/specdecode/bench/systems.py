"""The systems a benchmark compares, all on the same loaded target and the same prompt ids:

(a) transformers' `generate`, target only;
(b) transformers' assisted generation: prompt lookup, or an assistant (draft) model;
(c) this engine, target only (the same loop with k = 0);
(d) this engine with a drafter and k: prompt lookup or a draft model (as (b) runs them), `auto`
    (the engine's default, adaptive k <= k) or `recycling` (trees of k nodes);
and where asked (`--system`, llamacpp.py), on the .gguf file the target was loaded from:
(e) llama.cpp's plain decoding;
(f) llama.cpp with llama-cpp-python's prompt-lookup drafter.

Every system is timed the same way, from prompt ids in to token ids out, so the
comparison covers prefill, decoding and all per-step overhead alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdecode.bench.llamacpp import LOOKUP, LOOKUP_TOKENS, PLAIN, LlamaCppCounts, LlamaCppWorker
from specdecode.core.stats import GenerationStats
from specdecode.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from specdecode.drafters.factory import DrafterOptions, make_drafter
from specdecode.engine import SpeculativeEngine
from specdecode.errors import VocabularyMismatchError
from specdecode.loading import check_same_vocabulary, load_model
from specdecode.runners import runner_for
from specdecode.runners.profiling import timed

HF, ENGINE, LLAMACPP = "hf", "specdecode", "llama.cpp"
# drafters whose state outlives a request (recycling's table, which auto holds): each timed
# generation gets a new one, so a later run cannot draft from what an earlier run of the same
# prompt taught it
STATEFUL_DRAFTERS = ("auto", "recycling")
HF_TWINS = ("prompt-lookup", "model")  # drafters transformers' assisted generation runs as well


@dataclass(frozen=True)
class SystemSpec:
    framework: str  # HF, ENGINE or LLAMACPP
    drafter: str = "none"  # "none", "prompt-lookup" or "model"
    k: int = 0  # tokens drafted per step; 0 for target-only
    draft: str | None = None  # the draft model, for drafter "model"
    quantization: str | None = None  # this engine's target, where quantized (BenchConfig.quantization)

    @property
    def speculative(self) -> bool:
        return self.drafter != "none"

    @property
    def adaptive(self) -> bool:
        """auto chooses k <= self.k each step, as it does by default; the others draft k."""
        return self.drafter == "auto"

    @property
    def group(self) -> str:
        """The issue's letter: a, b (transformers), c, d (this engine), e, f (llama.cpp)."""
        return {
            (HF, False): "a",
            (HF, True): "b",
            (ENGINE, False): "c",
            (ENGINE, True): "d",
            (LLAMACPP, False): "e",
            (LLAMACPP, True): "f",
        }[(self.framework, self.speculative)]

    @property
    def series(self) -> str:
        """The system without its k: one line in a tokens/s-versus-k plot."""
        framework = f"{self.framework} {self.quantization}" if self.quantization else self.framework
        if not self.speculative:
            return f"{framework} target-only"
        drafter = f"draft {Path(self.draft).name}" if self.drafter == "model" else self.drafter
        return f"{framework} {drafter}"

    @property
    def name(self) -> str:
        return self.series + (f" k{'<=' if self.adaptive else '='}{self.k}" if self.speculative else "")

    def on(self, framework: str) -> SystemSpec:
        """The same drafter and k run by the other framework: (b) for (d), (a) for (c)."""
        return replace(self, framework=framework, quantization=None)


def plan_systems(
    drafters: tuple[str, ...],
    drafts: tuple[str, ...],
    k_values: tuple[int, ...],
    llamacpp: tuple[str, ...] = (),
    quantization: str | None = None,
) -> list[SystemSpec]:
    """(a), then (b) for every drafter with a transformers twin and every k, (c), then (d) for
    every drafter and k, then the llama.cpp systems named in llamacpp: (e) and (f), whose k is the
    drafter's own setting. quantization: the engine's target's, for (c) and (d)."""
    speculative = [
        SystemSpec(ENGINE, drafter, k, draft, quantization)
        for drafter in drafters
        for draft in (drafts if drafter == "model" else (None,))
        for k in k_values
    ]
    llama = {PLAIN: SystemSpec(LLAMACPP), LOOKUP: SystemSpec(LLAMACPP, "prompt-lookup", LOOKUP_TOKENS)}
    return [
        SystemSpec(HF),
        *(s.on(HF) for s in speculative if s.drafter in HF_TWINS),
        SystemSpec(ENGINE, quantization=quantization),
        *speculative,
        *(llama[name] for name in (PLAIN, LOOKUP) if name in llamacpp),
    ]


@dataclass
class Output:
    token_ids: list[int]  # new tokens only
    wall_time_s: float
    stats: GenerationStats | LlamaCppCounts | None  # this engine's own counts, llama.cpp's; None for transformers


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

        token_ids, seconds = timed(run)
        return Output(token_ids, seconds, None)


class EngineSystem:
    """This engine, target-only or with one drafter and k; new_drafter, for STATEFUL_DRAFTERS:
    a fresh drafter for every generation, made before its timer starts."""

    def __init__(self, spec: SystemSpec, engine: SpeculativeEngine, new_drafter: Callable[[], Drafter] | None = None):
        self.spec = spec
        self.engine = engine
        self.new_drafter = new_drafter

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Output:
        if self.new_drafter is not None:
            self.engine = self.engine.with_drafter(self.new_drafter(), self.spec.k, adaptive=self.spec.adaptive)

        def run():
            return self.engine.generate(
                [prompt_ids],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=seed,
                speculative=self.spec.speculative,
            )[0]

        result, seconds = timed(run)
        return Output(result.token_ids, seconds, result.stats)


class LlamaCppSystem:
    """llama.cpp in a worker process of its own, on the target's .gguf file, greedy, with flash
    attention on (its faster setting: docs/benchmarks.md), with or without its prompt-lookup drafter."""

    def __init__(self, spec: SystemSpec, engine: SpeculativeEngine, gguf: Path, n_ctx: int):
        self.spec = spec
        self.stop = sorted(engine.eos_token_ids)  # the engine's end-of-sequence ids, as transformers gets them
        draft_tokens = spec.k if spec.speculative else None
        self.worker = LlamaCppWorker(gguf, torch.get_num_threads(), n_ctx, draft_tokens, flash_attn=True)
        self.options = {"model": str(gguf)} | {k: v for k, v in self.worker.info.items() if k != "ready"}
        if self.worker.info["n_vocab"] != engine.target_runner.vocab_size:
            self.worker.close()
            raise VocabularyMismatchError(
                f"llama.cpp reads {self.worker.info['n_vocab']} tokens from {gguf.name}, the engine's target "
                f"{engine.target_runner.vocab_size}: they cannot be fed the same token ids"
            )

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Output:
        # greedy only (config.validate): temperature and seed change nothing here
        answer = self.worker.generate(prompt_ids, max_new_tokens, self.stop)
        return Output(answer.token_ids, answer.seconds, answer.counts)

    def close(self) -> None:
        self.worker.close()


System = HFSystem | EngineSystem | LlamaCppSystem


def build_systems(
    specs: list[SystemSpec],
    engine: SpeculativeEngine,
    draft_models: dict[str, PreTrainedModel],
    gguf: Path | None = None,
    n_ctx: int = 0,
) -> list[System]:
    """Runnable systems that share the loaded target (and draft models): nothing is loaded twice,
    but for llama.cpp's, which load gguf (of n_ctx tokens' context) in processes of their own."""
    lookup = PromptLookupDrafter()
    # draft runners chosen as the engine chooses its own (the fast path where one applies)
    model_drafters = {name: ModelDrafter(runner_for(model)) for name, model in draft_models.items()}
    systems = []
    try:
        for spec in specs:
            if spec.framework == HF:
                systems.append(HFSystem(spec, engine, draft_models.get(spec.draft), lookup.max_ngram))
            elif spec.framework == LLAMACPP:
                systems.append(LlamaCppSystem(spec, engine, gguf, n_ctx))
            elif spec.drafter in STATEFUL_DRAFTERS:
                new = named_drafter(spec.drafter, engine)
                systems.append(EngineSystem(spec, engine.with_drafter(new(), spec.k, adaptive=spec.adaptive), new))
            else:
                # fixed k, so that k is what is measured
                drafter = lookup if spec.drafter == "prompt-lookup" else model_drafters.get(spec.draft)
                systems.append(EngineSystem(spec, engine.with_drafter(drafter, spec.k)))
    except BaseException:
        close_systems(systems)
        raise
    return systems


def named_drafter(name: str, engine: SpeculativeEngine) -> Callable[[], Drafter]:
    """Makes the drafter `name` as from_pretrained would (auto: with the head shipped for the
    target, if there is one), without the draft store: the benchmark times decoding, not what
    earlier requests left behind."""

    def new() -> Drafter:
        drafter = make_drafter(name, None, engine.target_runner, engine.tokenizer, None, "auto", DrafterOptions())
        assert drafter is not None  # only "none" makes none
        return drafter

    return new


def close_systems(systems: list[System]) -> None:
    """Stop the worker processes of the systems that have one."""
    for system in systems:
        if isinstance(system, LlamaCppSystem):
            system.close()


def load_draft(name: str, engine: SpeculativeEngine, device: str, dtype: str) -> PreTrainedModel:
    """A draft model on the target's device, checked to share the target's vocabulary."""
    model, tokenizer = load_model(name, device, dtype)
    model = model.to(engine.target_runner.model.device)
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    check_same_vocabulary(engine.tokenizer, tokenizer, engine.target_runner.vocab_size, vocab_size)
    return model
