"""What one benchmark run measures: models, drafters, k values, prompts, generation length.

`BenchConfig.create` fills what the user left unset from the defaults, or from the quick
preset with `quick=True`, and checks everything that needs no model, so a mistake is
reported before a slow load.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from specdecode import precision
from specdecode.bench.llamacpp import LLAMACPP_SYSTEMS
from specdecode.core.sampling import SamplingParams
from specdecode.errors import InvalidArgumentError
from specdecode.loading import DEFAULT_TARGET

# prompt-lookup (a chain, as transformers' own) and model have a transformers twin (b); auto (the
# engine's default, adaptive k) and recycling (trees) run on this engine only
BENCH_DRAFTERS = ("prompt-lookup", "model", "auto", "recycling")

# One prompt from each Spec-Bench task (writing stands for the MT-bench ones), few tokens,
# two k values (six systems): a run of minutes on a small CPU (docs/benchmarks.md), and every plot has data.
QUICK = dict(
    categories=("writing", "translation", "summarization", "qa", "math_reasoning", "rag"),
    prompts_per_category=1,
    max_new_tokens=32,
    k_values=(2, 4),
    runs=1,
)


@dataclass(frozen=True)
class BenchConfig:
    target: str = DEFAULT_TARGET
    drafts: tuple[str, ...] = ()  # draft models, for the "model" drafter and HF assisted generation
    drafters: tuple[str, ...] = ()  # empty = prompt-lookup, plus model when drafts are given
    systems: tuple[str, ...] = ()  # systems beside (a)-(d): llama.cpp's (llamacpp.LLAMACPP_SYSTEMS)
    k_values: tuple[int, ...] = (2, 4, 6)
    prompts: str | None = None  # a JSONL file; None = the Spec-Bench subset shipped in the package
    categories: tuple[str, ...] = ()  # empty = all categories in the prompt file
    prompts_per_category: int = 0  # 0 = all
    max_new_tokens: int = 128
    temperature: float = 0.0
    runs: int = 1  # passes over the prompts; more passes average out machine noise
    seed: int = 0  # order of systems, and sampling seeds
    chat: bool | None = None  # None = use the chat template when the model has one
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # the engine's target, (c) and (d): w8a8, or bitsandbytes' (every system)
    output_dir: str = "bench-results"
    quick: bool = False

    @classmethod
    def create(cls, quick: bool = False, **given) -> BenchConfig:
        """Defaults (or the quick preset) overridden by the options the user gave.

        Options left unset are None (or empty lists, as the CLI passes them). List options
        take repeated values, comma-separated values, or both: `-k 2,4 -k 6`.
        """
        unknown = set(given) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown benchmark options: {sorted(unknown)}")
        values = dict(QUICK) if quick else {}
        if quick and given.get("prompts"):
            del values["categories"]  # the user's file has its own: quick takes the first prompt of each
        for name, value in given.items():
            if isinstance(value, (list, tuple)):
                value = _split_commas(value) or None
            if value is not None:
                values[name] = value
        if "k_values" in values:
            values["k_values"] = _k_values(values["k_values"])
        if "systems" in values:
            values["systems"] = tuple(dict.fromkeys(values["systems"]))  # each runs once
        config = cls(quick=quick, **values)
        config.validate()
        return config

    @property
    def active_drafters(self) -> tuple[str, ...]:
        if self.drafters:
            return self.drafters
        return ("prompt-lookup", "model") if self.drafts else ("prompt-lookup",)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        unknown = [d for d in self.drafters if d not in BENCH_DRAFTERS]
        if unknown:
            raise InvalidArgumentError(
                f"unknown drafter '{unknown[0]}' for bench; choose from: {', '.join(BENCH_DRAFTERS)} "
                "(target-only runs are always included)"
            )
        unknown = [s for s in self.systems if s not in LLAMACPP_SYSTEMS]
        if unknown:
            raise InvalidArgumentError(
                f"unknown system '{unknown[0]}' for bench; choose from: {', '.join(LLAMACPP_SYSTEMS)} "
                "((a)-(d) always run)"
            )
        if self.systems and self.temperature != 0:
            raise InvalidArgumentError(
                f"--system {self.systems[0]} decodes greedily only; use --temperature 0 or leave out --system"
            )
        if "model" in self.active_drafters and not self.drafts:
            raise InvalidArgumentError("drafter 'model' needs a draft model: pass --draft NAME")
        if self.drafts and "model" not in self.active_drafters:
            raise InvalidArgumentError("--draft was given but --drafter leaves out 'model'; add --drafter model")
        if not self.k_values or any(k < 1 for k in self.k_values):
            raise InvalidArgumentError(
                f"-k values must be >= 1 (target-only runs are always included), got {list(self.k_values)}"
            )
        if self.max_new_tokens < 1:
            raise InvalidArgumentError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.runs < 1:
            raise InvalidArgumentError(f"--runs must be at least 1, got {self.runs}")
        if self.prompts_per_category < 0:
            raise InvalidArgumentError(
                f"--prompts-per-category must be >= 0 (0 = all), got {self.prompts_per_category}"
            )
        SamplingParams(self.temperature)  # raises for a negative temperature
        precision.quantization_named(self.quantization, precision.TARGET)  # raises for an unknown name
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise InvalidArgumentError(f"--output-dir '{self.output_dir}' is a file; give a folder")

    def to_command(self) -> str:
        """The command line that repeats this run, every option spelled out."""
        options = [
            ("--target", self.target),
            *(("--draft", d) for d in self.drafts),
            *(("--drafter", d) for d in self.active_drafters),
            *(("--system", s) for s in self.systems),
            *(("-k", str(k)) for k in self.k_values),
            *([("--prompts", self.prompts)] if self.prompts else []),
            *(("--category", c) for c in self.categories),
            ("--prompts-per-category", str(self.prompts_per_category)),
            ("--max-new-tokens", str(self.max_new_tokens)),
            ("--temperature", f"{self.temperature:g}"),
            ("--runs", str(self.runs)),
            ("--seed", str(self.seed)),
            ("--device", self.device),
            ("--dtype", self.dtype),
            *([("--quantization", self.quantization)] if self.quantization else []),
            ("--output-dir", self.output_dir),
        ]
        chat = [] if self.chat is None else ["--chat" if self.chat else "--no-chat"]
        words = ["specdecode", "bench", *(w for pair in options for w in pair), *chat]
        return shlex.join(words)

    def to_dict(self) -> dict:
        return asdict(self) | {"drafters": list(self.active_drafters)}


def _split_commas(values) -> tuple[str, ...]:
    return tuple(part.strip() for value in values for part in str(value).split(",") if part.strip())


def _k_values(values: tuple) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(k) for k in values}))
    except ValueError:
        raise InvalidArgumentError(
            f"-k takes whole numbers, like -k 2,4 or -k 2 -k 4; got {', '.join(values)}"
        ) from None
