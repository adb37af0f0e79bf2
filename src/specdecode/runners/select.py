"""Which runner runs a model: a fast path where one applies, else transformers'."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import PretrainedConfig, PreTrainedModel

from specdecode import precision
from specdecode.cpu import cpu_flags
from specdecode.errors import InvalidArgumentError
from specdecode.loading import load_config, quantization_of, resolve_device
from specdecode.runners import fast_gpt2, fast_llama
from specdecode.runners.base import ModelRunner
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.hf import HFModelRunner
from specdecode.runners.projection import onednn_supports

RUNNERS = ("auto", "fast", "transformers")


def runner_for(model: PreTrainedModel, runner: str = "auto", quantization: str | None = None) -> ModelRunner:
    """The fastest runner that supports the model: a lean fast path where one applies, else transformers'.

    A model quantized with bitsandbytes runs on transformers' runner: the fast paths read each
    layer's weight as a plain matrix, and bitsandbytes' layers hold packed 4-bit or int8 codes
    (docs/quantization.md has the measurement behind keeping it there)."""
    if runner not in RUNNERS:
        raise InvalidArgumentError(f"unknown runner '{runner}'; choose one of: {', '.join(RUNNERS)}")
    bnb = quantization_of(model)
    if bnb is not None:
        if runner == "fast" or quantization is not None:
            raise InvalidArgumentError(
                f"this model's layers are bitsandbytes {bnb}: it runs on the transformers runner "
                "(--runner auto or transformers), and cannot be quantized again"
            )
        return HFModelRunner(model)
    fast = _fast_runner_class(model) if runner != "transformers" else None
    if runner == "fast" and fast is None:
        raise InvalidArgumentError(
            f"the fast runner supports Llama-family (llama, mistral, qwen2) and GPT-2 models, "
            f"not {model.config.model_type}; use --runner auto"
        )
    if quantization is None:
        return fast(model) if fast is not None else HFModelRunner(model)
    if runner == "transformers":
        raise InvalidArgumentError(
            f"{quantization} quantizes the products of the Llama-family fast runner, which the transformers "
            "runner does not run: leave the runner at auto (or fast)",
            "quantization",
        )
    if fast is not FastLlamaRunner:
        raise InvalidArgumentError(
            f"{quantization} runs on the Llama-family fast runner, not on {model.config.model_type} models",
            "quantization",
        )
    return FastLlamaRunner(model, quantization)


def _fast_runner_class(model: PreTrainedModel) -> type | None:
    for module, runner_class in ((fast_llama, fast_llama.FastLlamaRunner), (fast_gpt2, fast_gpt2.FastGPT2Runner)):
        if module.supports(model):
            return runner_class
    return None


def auto_dtype(config: PretrainedConfig, device: torch.device, runner: str, quantization: str | None) -> torch.dtype:
    """What `--dtype auto` loads for this model: precision.resolve_dtype's rule, given whether a
    fast path runs it and whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX, and
    oneDNN's bfloat16 products)."""
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and onednn_supports(torch.bfloat16)
    fast = _fast_runner_class(SimpleNamespace(config=config)) is not None  # supports() reads the config alone
    return precision.resolve_dtype(
        "auto", device, fast_path=fast, runner=runner, quantization=quantization, native_bfloat16=native
    )


def chosen_dtype(
    dtype: str, target: str, device: str, runner: str, quantization: str | None, trust_remote_code: bool = False
) -> str:
    """dtype as loading takes it (its canonical name), with "auto" decided by auto_dtype from the
    target's config."""
    named = precision.dtype_named(dtype)
    if named is not None:
        return named.name
    config = load_config(target, trust_remote_code)
    return str(auto_dtype(config, resolve_device(device), runner, quantization)).removeprefix("torch.")
