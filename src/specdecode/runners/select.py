"""Which runner runs a model: a fast path where one applies, else transformers'."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import PretrainedConfig, PreTrainedModel

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
    if fast is not FastLlamaRunner:
        raise InvalidArgumentError(
            f"--quantize {quantization} runs on the Llama-family fast runner, not on {model.config.model_type} models"
        )
    return FastLlamaRunner(model, quantization)


def _fast_runner_class(model: PreTrainedModel) -> type | None:
    for module, runner_class in ((fast_llama, fast_llama.FastLlamaRunner), (fast_gpt2, fast_gpt2.FastGPT2Runner)):
        if module.supports(model):
            return runner_class
    return None


def auto_dtype(config: PretrainedConfig, device: torch.device, runner: str, quantization: str | None) -> torch.dtype:
    """What `--dtype auto` loads: the fastest precision in which speculation is shown exact here.
    bfloat16 on a CPU that multiplies it natively (AVX512-BF16 or AMX), for models a fast path
    runs: their verifications and batches give each token its one-token logits bit for bit
    there (tests/test_fast_runners.py), and bfloat16 reads half the bytes (benchmarks/fast_path.py:
    74.9 against 49.2 tokens/s on an AMD EPYC with AVX512-BF16). And bfloat16 for 4-bit
    bitsandbytes targets there: their layers compute in bfloat16 anyway, and rowwise.py makes
    their verification exact (tests/test_real_model.py). float32 everywhere else: transformers'
    runner, LLM.int8 and CUDA are not shown exact in half precision, and a CPU without those
    instructions runs bfloat16 slower than float32."""
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and onednn_supports(torch.bfloat16)
    if device.type != "cpu" or not native:
        return torch.float32
    if quantization is not None:
        return torch.bfloat16 if quantization in ("nf4", "fp4") else torch.float32
    if runner == "transformers":
        return torch.float32
    fast = _fast_runner_class(SimpleNamespace(config=config))  # supports() reads the config alone
    return torch.bfloat16 if fast is not None else torch.float32


def chosen_dtype(
    dtype: str, target: str, device: str, runner: str, quantization: str | None, trust_remote_code: bool = False
) -> str:
    """dtype as loading takes it, with "auto" decided by auto_dtype from the target's config."""
    if dtype != "auto":
        return dtype
    config = load_config(target, trust_remote_code)
    return str(auto_dtype(config, resolve_device(device), runner, quantization)).removeprefix("torch.")
