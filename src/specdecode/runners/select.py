"""Which runner runs a model: a fast path where one applies, else transformers'."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import PretrainedConfig, PreTrainedModel

from specdecode import precision
from specdecode.cpu import cpu_flags
from specdecode.errors import InvalidArgumentError
from specdecode.loading import load_config, quantization_of, resolve_device
from specdecode.runners import fast_gpt2, fast_llama, fast_transformers
from specdecode.runners.base import ModelRunner
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.fast_transformers import FastTransformersRunner
from specdecode.runners.hf import HFModelRunner
from specdecode.runners.projection import int8_supported, onednn_supports, own_kernel

RUNNERS = ("auto", "fast", "transformers")


def runner_for(
    model: PreTrainedModel, runner: str = "auto", quantization: str | precision.Quantization | None = None
) -> ModelRunner:
    """The fastest runner that supports the model: a lean fast path where one applies, else transformers'.
    quantization: what the fast runner does to its products (w8a8 or int8-weight-only; a
    Precision's runner_quantization, or its name).

    A model quantized with bitsandbytes runs on transformers' runner: the fast paths read each
    layer's weight as a plain matrix, and bitsandbytes' layers hold packed 4-bit or int8 codes
    (docs/quantization.md has the measurement behind keeping it there)."""
    if runner not in RUNNERS:
        raise InvalidArgumentError(f"unknown runner '{runner}'; choose one of: {', '.join(RUNNERS)}")
    quantization = precision.quantization_named(quantization, precision.RUNNER)
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
            f"no fast runner runs {model.config.model_type} models exactly "
            f"({fast_transformers.unsupported(model)}); use --runner auto"
        )
    if quantization is None:
        return fast(model) if fast is not None else HFModelRunner(model)
    if runner == "transformers":
        raise InvalidArgumentError(
            f"{quantization.name} quantizes the products of the fast runners, which the transformers "
            "runner does not run: leave the runner at auto (or fast)",
            "quantization",
        )
    if fast not in (FastLlamaRunner, FastTransformersRunner):
        raise InvalidArgumentError(
            f"{quantization.name} runs on the fast runners, not on {model.config.model_type} models "
            f"({fast_transformers.unsupported(model) or 'GPT-2 runs on its own'})",
            "quantization",
        )
    return fast(model, quantization)


RUNNER_LABELS = {
    FastLlamaRunner: "fast Llama runner",
    fast_gpt2.FastGPT2Runner: "fast GPT-2 runner",
    FastTransformersRunner: "transformers' modeling on the fast kernels",
    HFModelRunner: "transformers' runner",
}


def runner_label(runner: ModelRunner) -> str:
    """Which runner runs a target, in words (the stats line names it)."""
    return next((label for cls, label in RUNNER_LABELS.items() if isinstance(runner, cls)), type(runner).__name__)


def _fast_runner_class(model: PreTrainedModel) -> type | None:
    """The hand-written runners where they apply (Llama family, GPT-2), else transformers'
    modeling code on the engine's kernels (fast_transformers.py), else None."""
    for module, runner_class in ((fast_llama, fast_llama.FastLlamaRunner), (fast_gpt2, fast_gpt2.FastGPT2Runner)):
        if module.supports(model):
            return runner_class
    if fast_transformers.supports(model):
        return FastTransformersRunner
    return None


def resolve_precision(
    target: str,
    device: str | torch.device = "auto",
    dtype: str = precision.AUTO,
    quantization: str | precision.Quantization | None = None,
    runner: str = "auto",
    trust_remote_code: bool = False,
    option: str = precision.TARGET,
) -> precision.Precision:
    """The target's precision, resolved once (precision.resolve) before it loads: for
    `--dtype auto`, from its config (whether a fast path runs it) and this CPU (whether it
    multiplies bfloat16 natively: AVX512-BF16 or AMX, and oneDNN's bfloat16 products). An
    unknown name is refused before the config is read."""
    named = precision.quantization_named(quantization, option)
    torch_device = resolve_device(device) if isinstance(device, str) else device
    where = precision.Circumstances(torch_device)
    if precision.dtype_named(dtype) is None:  # auto: decided on the model and this CPU
        where = circumstances(load_config(target, trust_remote_code), torch_device, runner)
    return precision.resolve(dtype, named, where, option)


def circumstances(config: PretrainedConfig, device: torch.device, runner: str) -> precision.Circumstances:
    """What --dtype auto decides on, for a model of this config run by that runner choice."""
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and onednn_supports(torch.bfloat16)
    # the hand-written runners' supports() read the config alone; the generic one, the model class's
    shape = SimpleNamespace(config=config)
    llama = runner != "transformers" and fast_llama.supports(shape)
    fast = llama or (
        runner != "transformers" and (fast_gpt2.supports(shape) or fast_transformers.supports_config(config))
    )
    w8a8 = llama and device.type == "cpu" and int8_supported() and own_kernel() is not None
    return precision.Circumstances(device, native_bfloat16=native, fast_path=fast, w8a8_by_default=w8a8)
