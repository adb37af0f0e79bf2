"""Every precision a model runs in, by name, and the one rule that resolves a request into one.

A precision is a dtype (what the weights left in float are held in) and at most one
quantization. Each has one name, spelled the same by every command and by the Python API:
`--dtype` (dtype=) takes the dtypes, `--quantization` (quantization=) the quantizations, and
`--draft-quantization` the self-quantized drafter's copy (bfloat16 or a quantization).

Older spellings stay accepted, each with the meaning it had where it was taken, and a one-line
deprecation warning naming the one spelling: `int8` is `llm-int8` for a target's
`--quantization`, and `int8-weight-only` for `--draft-quantization`, for the fast runner's
products (runner_for, FastLlamaRunner) and for `specdecode profile`, whose `--quantize` is the
older spelling of its `--quantization`.

`resolve` turns a request (the dtype and quantization spellings) and the circumstances (the
device, this CPU, whether a fast path runs the model: runners.select.resolve_precision gathers
them) into a `Precision`, once. Loaders and runners read its fields, not names.
`--dtype auto` picks one quantization, `w8a8`, where its measured recipe runs the model on a CPU
with its kernels (`resolve`); otherwise 8 bits are opted into by name (`--quantization w8a8`).
With one, auto still decides the dtype of what stays in float.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)
AUTO = "auto"


@dataclass(frozen=True)
class Dtype:
    name: str
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()  # short spellings, as good as the name (not deprecated)


DTYPES = (
    Dtype("float32", torch.float32, ("fp32",)),
    Dtype("bfloat16", torch.bfloat16, ("bf16",)),
    Dtype("float16", torch.float16, ("fp16",)),
)

# who takes a quantization name; each is also the argument an error names
TARGET = "quantization"  # --quantization, from_pretrained(quantization=...): the target
RUNNER = "runner_quantization"  # the fast runner's products: runner_for, FastLlamaRunner, `profile --quantization`
DRAFT = "draft_quantization"  # --draft-quantization: the self-quantized drafter's copy
PARAMS = {TARGET: "quantization", RUNNER: "quantization", DRAFT: "draft_quantization"}
# how a warning names who took an older spelling (a target's and the runner's "int8" differ)
SPELLED_BY = {TARGET: "--quantization", RUNNER: "the fast runner's quantization", DRAFT: "--draft-quantization"}


@dataclass(frozen=True)
class Quantization:
    name: str
    what: str
    runner: str  # "transformers" (bitsandbytes' layers) or "fast" (the Llama-family fast runner)
    options: tuple[str, ...]  # who takes it (TARGET, RUNNER, DRAFT)
    bitsandbytes: bool = False  # loaded quantized by bitsandbytes (else quantized by the runner)


NF4 = Quantization("nf4", "bitsandbytes 4-bit NormalFloat, blocks of 64", "transformers", (TARGET, DRAFT), True)
FP4 = Quantization("fp4", "bitsandbytes 4-bit float, blocks of 64", "transformers", (TARGET, DRAFT), True)
LLM_INT8 = Quantization(
    "llm-int8",
    "bitsandbytes LLM.int8: int8 weights, input columns past an outlier threshold in float",
    "transformers",
    (TARGET,),
    True,
)
W8A8 = Quantization(
    "w8a8",
    "int8 weights per output channel, int8 activations per row (smoothed; the output head's 16-bit on "
    "AVX512-VNNI), exact integer products",
    "fast",
    (TARGET, RUNNER),
)
INT8_WEIGHT_ONLY = Quantization(
    "int8-weight-only",
    "int8 weights, one float scale per output row; activations in the dtype",
    "fast",
    (RUNNER, DRAFT),
)
QUANTIZATIONS = (NF4, FP4, LLM_INT8, W8A8, INT8_WEIGHT_ONLY)
BNB_4BIT = (NF4, FP4)

# older spellings, each with the meaning it had where it was taken: (who takes it, spelling) -> name
OLDER_SPELLINGS = {
    (TARGET, "int8"): LLM_INT8,
    (RUNNER, "int8"): INT8_WEIGHT_ONLY,
    (DRAFT, "int8"): INT8_WEIGHT_ONLY,
}


# --dtype auto gives up at most about 1.5% of perplexity against bfloat16 for speed: w8a8 on the
# Llama runner costs +0.8% on 2,048 tokens of docs/design.md and +1.4% on Spec-Bench summarization
# (docs/quantization.md, with the commands); on the generic runner, without smoothing, about
# +3.5% on Gemma-3-270M (docs/benchmarks.md), so auto leaves that in float
AUTO_W8A8_NOTE = (
    "--dtype auto: the fastest exact path on this CPU, +0.8% perplexity against bfloat16 as measured "
    "on SmolLM2; --dtype bfloat16 runs the checkpoint's own arithmetic"
)


@dataclass(frozen=True)
class Circumstances:
    """What `--dtype auto` decides on besides the request (runners.select.resolve_precision reads
    them off the model's config and this CPU)."""

    device: torch.device = torch.device("cpu")
    native_bfloat16: bool = False  # AVX512-BF16 or AMX, and oneDNN's bfloat16 products
    fast_path: bool = False  # a fast runner will run the model (one supports it; not --runner transformers)
    # w8a8 with its measured recipe will run the model here: the hand-written Llama runner's (its
    # cost measured within AUTO_W8A8_BUDGET) on a CPU that runs the own int8 kernel
    w8a8_by_default: bool = False


@dataclass(frozen=True)
class Precision:
    """A model's precision, resolved once (`resolve`): the dtype of what stays in float and at
    most one quantization. Loaders read `loaded_quantized` and `dtype`; the fast runner reads
    `runner_quantization`."""

    dtype: torch.dtype
    quantization: Quantization | None = None
    chosen: bool = False  # --dtype auto chose the dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def name(self) -> str:
        """Stable: "bfloat16", or "w8a8, bfloat16 elsewhere"."""
        if self.quantization is None:
            return self.dtype_name
        return f"{self.quantization.name}, {self.dtype_name} elsewhere"

    @property
    def loaded_quantized(self) -> Quantization | None:
        """What bitsandbytes quantizes as the model loads (None: every weight loads in dtype)."""
        return self.quantization if self.quantization is not None and self.quantization.bitsandbytes else None

    @property
    def runner_quantization(self) -> Quantization | None:
        """What the fast runner quantizes from the float weights (None: its products stay in dtype)."""
        return self.quantization if self.quantization is not None and not self.quantization.bitsandbytes else None

    def in_float(self) -> Precision:
        """This precision without its quantization (what a draft model loads in beside the target)."""
        return Precision(self.dtype, None, self.chosen)


def dtype_named(spelling: str) -> Dtype | None:
    """The dtype a --dtype spelling names; None for "auto". Raises naming the choices."""
    if spelling == AUTO:
        return None
    for entry in DTYPES:
        if spelling == entry.name or spelling in entry.aliases:
            return entry
    raise InvalidArgumentError(f"unknown dtype '{spelling}'; use {', '.join(dtype_names())}", "dtype")


def dtype_names() -> tuple[str, ...]:
    """What --dtype takes, auto first (help texts and errors list these)."""
    return (AUTO, *(d.name for d in DTYPES))


def quantization_named(spelling: str | Quantization | None, option: str = TARGET) -> Quantization | None:
    """The quantization a spelling names for that option (older spellings warned of, once);
    None for None; a Quantization as it is, if that option takes it."""
    if spelling is None:
        return None
    if isinstance(spelling, Quantization):
        if option not in spelling.options:
            raise _unknown(spelling.name, option)
        return spelling
    for entry in QUANTIZATIONS:
        if option in entry.options and spelling == entry.name:
            return entry
    older = OLDER_SPELLINGS.get((option, spelling))
    if older is None:
        raise _unknown(spelling, option)
    by = SPELLED_BY[option]
    warn_older_spelling(f"{by} {spelling}", f"{by} {older.name}")
    return older


def quantization_names(option: str = TARGET) -> tuple[str, ...]:
    """The names an option takes, without older spellings (what help texts and errors list)."""
    return tuple(entry.name for entry in QUANTIZATIONS if option in entry.options)


def draft_precision_named(spelling: str | Dtype | Quantization | None) -> Dtype | Quantization:
    """What --draft-quantization names: the bfloat16 copy (a dtype), or a quantization of the
    copy; None: bfloat16."""
    if spelling is None or spelling == _BFLOAT16 or spelling in (_BFLOAT16.name, *_BFLOAT16.aliases):
        return _BFLOAT16
    if not isinstance(spelling, Dtype):
        try:
            return quantization_named(spelling, DRAFT) or _BFLOAT16
        except InvalidArgumentError:
            pass  # refused below, with bfloat16 among the choices
    shown = spelling if isinstance(spelling, str) else spelling.name
    choices = ", ".join(draft_precision_names())
    raise InvalidArgumentError(f"unknown draft quantization '{shown}'; choose one of: {choices}", PARAMS[DRAFT])


def draft_precision_names() -> tuple[str, ...]:
    return (_BFLOAT16.name, *quantization_names(DRAFT))


def resolve(
    dtype: str = AUTO,
    quantization: str | Quantization | None = None,
    where: Circumstances = Circumstances(),
    option: str = TARGET,
) -> Precision:
    """The precision a request names, decided once. "auto" is the fastest precision in which
    speculation is shown exact here, within about 1.5% of perplexity: `w8a8` where its
    measured recipe runs the model on a CPU that runs its kernels (where.w8a8_by_default), in the
    dtype below for what stays in float. The dtype: bfloat16 on a CPU that multiplies it natively
    (where.native_bfloat16) for a model a fast path runs (where.fast_path; its verifications and
    batches give each token its one-token bits there); and for 4-bit bitsandbytes targets there
    (their layers compute in bfloat16 anyway; runners/rowwise.py makes their verification
    exact). float32 everywhere else: transformers' runner, LLM.int8 and CUDA are not shown exact
    in half precision (benchmarks/gpu_exactness.py checks it), and a CPU without those
    instructions runs bfloat16 slower than float32. A named dtype is the checkpoint's own
    arithmetic in it: nothing quantized that the request does not name."""
    named = quantization_named(quantization, option)
    chosen = dtype_named(dtype)
    if chosen is not None:
        return Precision(chosen.dtype, named)
    if named is None and option == TARGET and where.w8a8_by_default:
        named = W8A8
    return Precision(_auto_dtype(named, where), named, chosen=True)


def _auto_dtype(quantization: Quantization | None, where: Circumstances) -> torch.dtype:
    if where.device.type != "cpu" or not where.native_bfloat16:
        return torch.float32
    if quantization is not None and quantization.bitsandbytes:
        return torch.bfloat16 if quantization in BNB_4BIT else torch.float32
    return torch.bfloat16 if where.fast_path else torch.float32


_BFLOAT16 = DTYPES[1]
_warned: set[str] = set()


def _unknown(spelling: str, option: str) -> InvalidArgumentError:
    choices = ", ".join(quantization_names(option))
    return InvalidArgumentError(f"unknown quantization '{spelling}'; choose one of: {choices}", PARAMS[option])


def warn_older_spelling(older: str, name: str) -> None:
    """One line, once a process per spelling: a config resolved again (a server's replicas, a
    benchmark's systems) does not repeat it."""
    message = f"{older} is an older spelling of {name} (the same); it will be removed"
    if message in _warned:
        return
    _warned.add(message)
    logger.warning(message)
