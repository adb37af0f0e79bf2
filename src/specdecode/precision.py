"""Every precision a model runs in, by name: one table of dtypes and quantizations, and the one
rule for `--dtype auto`.

Each name means one thing. Older spellings stay accepted as aliases, resolved by the option
that takes them: `--quantization int8` (the target) was and stays bitsandbytes' LLM.int8
(`llm-int8`), while `--quantize int8` (`specdecode profile`) and `--draft-quantization int8`
were and stay weight-only int8 on the fast path (`int8-weight-only`).

`--dtype auto` never picks a quantization: 8 bits are opted into by name (`--quantization
w8a8`). With one, auto still decides the dtype of what stays in float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.errors import InvalidArgumentError

AUTO = "auto"


@dataclass(frozen=True)
class Dtype:
    name: str
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()


DTYPES = (
    Dtype("float32", torch.float32, ("fp32",)),
    Dtype("bfloat16", torch.bfloat16, ("bf16",)),
    Dtype("float16", torch.float16, ("fp16",)),
)

# the options that take a quantization name
TARGET = "quantization"  # --quantization, from_pretrained(quantization=...): the target
PROFILE = "quantize"  # specdecode profile --quantize: the fast runner's products, to time them
DRAFT = "draft_quantization"  # --draft-quantization: the self-quantized drafter's copy


@dataclass(frozen=True)
class Quantization:
    name: str
    what: str
    runner: str  # "transformers" (bitsandbytes' layers) or "fast" (the Llama-family fast runner)
    options: tuple[str, ...]  # the options that take it (TARGET, PROFILE, DRAFT)
    aliases: tuple[str, ...] = ()  # older spellings, accepted by those options
    bitsandbytes: bool = False  # loaded quantized by bitsandbytes (else quantized by the runner)


QUANTIZATIONS = (
    Quantization("nf4", "bitsandbytes 4-bit NormalFloat, blocks of 64", "transformers", (TARGET, DRAFT), (), True),
    Quantization("fp4", "bitsandbytes 4-bit float, blocks of 64", "transformers", (TARGET, DRAFT), (), True),
    Quantization(
        "llm-int8",
        "bitsandbytes LLM.int8: int8 weights, input columns past an outlier threshold in float",
        "transformers",
        (TARGET,),
        ("int8",),
        True,
    ),
    Quantization(
        "w8a8",
        "int8 weights per output channel, int8 activations per row (smoothed; the output head's 16-bit on "
        "AVX512-VNNI), exact integer products",
        "fast",
        (TARGET, PROFILE),
    ),
    Quantization(
        "int8-weight-only",
        "int8 weights, one float scale per output row; activations in the dtype",
        "fast",
        (PROFILE, DRAFT),
        ("int8",),
    ),
)


def dtype_named(spelling: str) -> Dtype | None:
    """The dtype a --dtype spelling names; None for "auto". Raises naming the choices."""
    if spelling == AUTO:
        return None
    for entry in DTYPES:
        if spelling == entry.name or spelling in entry.aliases:
            return entry
    names = ", ".join([AUTO] + [d.name for d in DTYPES])
    raise InvalidArgumentError(f"unknown dtype '{spelling}'; use {names}", "dtype")


def quantization_named(spelling: str | None, option: str = TARGET) -> Quantization | None:
    """The quantization a spelling names for that option (aliases included); None for None."""
    if spelling is None:
        return None
    for entry in QUANTIZATIONS:
        if option in entry.options and (spelling == entry.name or spelling in entry.aliases):
            return entry
    choices = ", ".join(quantization_names(option))
    raise InvalidArgumentError(f"unknown quantization '{spelling}'; choose one of: {choices}", option)


def quantization_names(option: str = TARGET) -> tuple[str, ...]:
    """The names an option takes, without aliases (what help texts and errors list)."""
    return tuple(entry.name for entry in QUANTIZATIONS if option in entry.options)


def resolve_dtype(
    dtype: str,
    device: torch.device,
    *,
    fast_path: bool = False,
    runner: str = "auto",
    quantization: str | None = None,
    native_bfloat16: bool = False,
) -> torch.dtype:
    """The torch dtype a --dtype spelling loads. "auto" is the fastest dtype in which speculation
    is shown exact here: bfloat16 on a CPU that multiplies it natively (native_bfloat16:
    AVX512-BF16 or AMX, and oneDNN's bfloat16 products) for a model a fast path runs (fast_path;
    its verifications and batches give each token its one-token bits there), without the
    transformers runner; and for 4-bit bitsandbytes targets there (their layers compute in
    bfloat16 anyway; runners/rowwise.py makes their verification exact). float32 everywhere
    else: transformers' runner, LLM.int8 and CUDA are not shown exact in half precision, and a
    CPU without those instructions runs bfloat16 slower than float32. A quantization keeps
    auto's choice for what stays in float; auto itself never quantizes."""
    named = dtype_named(dtype)
    if named is not None:
        return named.dtype
    if device.type != "cpu" or not native_bfloat16:
        return torch.float32
    chosen = quantization_named(quantization, TARGET) if quantization is not None else None
    if chosen is not None and chosen.bitsandbytes:
        return torch.bfloat16 if chosen.name in ("nf4", "fp4") else torch.float32
    if runner == "transformers":
        return torch.float32
    return torch.bfloat16 if fast_path else torch.float32
