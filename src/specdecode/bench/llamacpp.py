"""llama.cpp (through llama-cpp-python) as systems of `specdecode bench`, each in a process of its own.

A process of its own, because llama.cpp's threads (OpenMP) and torch's would otherwise live in
one process and compete for the same cores, and because a crash inside llama.cpp then ends only
that process: the bench says so in one line. The worker (llamacpp_worker.py) speaks JSON lines
over its stdin and stdout.

What it runs: the .gguf file the target itself was loaded from; the engine's own token ids of
each prompt (the chat template applied by the engine's tokenizer), so that every system sees the
same ids; the engine's stop tokens, the same max new tokens, greedy; as many threads as torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from specdecode.errors import InvalidArgumentError, SpecDecodeError
from specdecode.loading import OFFLINE_MODELS, cache_dir

PLAIN, LOOKUP = "llama.cpp", "llama.cpp+lookup"
LLAMACPP_SYSTEMS = (PLAIN, LOOKUP)  # the names `bench --system` takes
# llama-cpp-python's README: num_pred_tokens=2 on CPU-only machines (its default, 10, is for GPUs)
LOOKUP_TOKENS = 2
INSTALL = "pip install 'specdecode[llamacpp]'"
NOT_INSTALLED = f"llama.cpp: not installed ({INSTALL}); skipped"
WORKER = Path(__file__).with_name("llamacpp_worker.py")
START_TIMEOUT_S = 300.0  # far beyond a small .gguf's load: a hung load must not hang the bench
GENERATE_TIMEOUT_S = 3600.0
STOP_TIMEOUT_S = 30.0


class LlamaCppError(SpecDecodeError):
    """llama.cpp could not start, or stopped, in its worker process."""


def installed() -> bool:
    """Whether llama-cpp-python can be imported, found without importing it (which would load
    llama.cpp's library, and its threads, into this process)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except ValueError:  # a module of that name in sys.modules without a spec
        return False


# the .gguf types users download most (benchmarks/gguf_types.py measures each one)
GGUF_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
_QUANTIZE = (
    "import ctypes, sys, llama_cpp\n"
    "params = llama_cpp.llama_model_quantize_default_params()\n"
    "params.ftype = getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + sys.argv[3])\n"
    "params.allow_requantize = True\n"
    "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))\n"
)


def quantized_gguf(source: Path, kind: str) -> Path:
    """source requantized to kind (one of GGUF_TYPES) by llama.cpp's own quantizer, in a process
    of its own (this one keeps llama.cpp's library out); cached, and written whole or not at all.
    A tensor whose rows the kind's blocks do not divide gets llama.cpp's fallback type, as in
    the files users download."""
    if kind not in GGUF_TYPES:
        raise InvalidArgumentError(f"unknown .gguf type '{kind}'; choose one of: {', '.join(GGUF_TYPES)}")
    target = cache_dir() / "gguf" / f"{source.stem}-{source.stat().st_size}.{kind}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    done = subprocess.run(
        [sys.executable, "-c", _QUANTIZE, str(source), str(partial), kind], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise LlamaCppError(f"llama.cpp could not quantize {source.name} to {kind}: {done.stderr.strip()[-500:]}")
    partial.replace(target)
    return target


def gguf_file(target: str) -> Path:
    """The .gguf file the target loads from: an offline model's, or the target itself."""
    if target in OFFLINE_MODELS:
        return OFFLINE_MODELS[target].gguf_path()
    path = Path(target).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise InvalidArgumentError(
        f"--system {PLAIN} runs the target's own .gguf file, and '{target}' is none: give --target FILE.gguf "
        f"or one of: {', '.join(OFFLINE_MODELS)}"
    )


@dataclass
class LlamaCppCounts:
    """One generation's counts, named as the engine's GenerationStats names them."""

    generated_tokens: int
    target_forwards: int  # llama.cpp decode calls, the prompt's prefill included
    drafted_tokens: int  # tokens its prompt-lookup drafter proposed (0 without one)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LlamaCppAnswer:
    token_ids: list[int]  # new tokens only
    seconds: float  # timed inside the worker, from the prompt's ids in to the new ids out
    counts: LlamaCppCounts


class LlamaCppWorker:
    """One llama.cpp model and context in a worker process, started here and stopped by close()."""

    def __init__(self, model: Path, threads: int, n_ctx: int, num_pred_tokens: int | None, flash_attn: bool = True):
        # its stderr in a file, not a pipe: a pipe nobody reads could fill and block it
        self.errors = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        # -P: the worker's folder is not put on sys.path (its neighbours would shadow other modules)
        self.process = subprocess.Popen(
            [sys.executable, "-P", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
            encoding="utf-8",
            bufsize=1,
            env=_worker_environment(threads),
        )
        settings = dict(
            model=str(model), threads=threads, n_ctx=n_ctx, num_pred_tokens=num_pred_tokens, flash_attn=flash_attn
        )
        try:
            self.info = self._ask(settings, START_TIMEOUT_S, "start")  # its version and settings, as created
        except BaseException:
            self.close()
            raise

    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop: list[int]) -> LlamaCppAnswer:
        request = dict(prompt=prompt_ids, max_new_tokens=max_new_tokens, stop=stop)
        answer = self._ask(request, GENERATE_TIMEOUT_S, "generate")
        counts = LlamaCppCounts(len(answer["tokens"]), answer["forwards"], answer["drafted"])
        return LlamaCppAnswer(answer["tokens"], answer["seconds"], counts)

    def close(self) -> int:
        """End the worker (end of its input), killing it if it does not end; its exit status."""
        with contextlib.suppress(OSError):  # a broken pipe: it had stopped already
            self.process.stdin.close()
        status = self._wait()
        self.process.stdout.close()
        self.errors.close()
        return status

    def _wait(self) -> int:
        """Its exit status, once it has ended, by itself within STOP_TIMEOUT_S or killed."""
        try:
            return self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def _ask(self, message: dict, timeout: float, doing: str) -> dict:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except OSError:
            raise self._failure(doing) from None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            self.process.kill()
            raise LlamaCppError(f"llama.cpp did not answer within {timeout:.0f} s ({doing}); it was stopped")
        line = self.process.stdout.readline()
        if not line:
            raise self._failure(doing)
        answer = json.loads(line)
        if "error" in answer:
            self._wait()  # it ends after saying why
            raise LlamaCppError(f"llama.cpp failed ({doing}): {answer['error']}")
        return answer

    def _failure(self, doing: str) -> LlamaCppError:
        status = self._wait()
        self.errors.seek(0)
        lines = [line.strip() for line in self.errors.read().splitlines() if line.strip()]
        said = f": {lines[-1]}" if lines else ""
        return LlamaCppError(f"llama.cpp's worker stopped with exit status {status} ({doing}){said}")


def _worker_environment(threads: int) -> dict[str, str]:
    # llama.cpp's OpenMP threads, as many as torch's, as ggml is asked for
    return os.environ | {"OMP_NUM_THREADS": str(threads)}
