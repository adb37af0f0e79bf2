"""The w8a8 fast path against bfloat16: perplexity, forward cost, memory, one run.

Candidates (all built from the default model's bfloat16 weights, int8 weights per output
channel, activations quantized per row): every product in int8 (the head too); the output head
in bfloat16; the head and the MLPs' down projections in bfloat16; SmoothQuant's smoothing
(alpha 0.5), calibrated on 512 random token ids (the default recipe's calibration: no text
needed) or on README.md; and the head with 16-bit activations ("w8a16", the default recipe on
AVX512-VNNI). For each:
- perplexity on a fixed text: the first --tokens tokens of docs/design.md (the project's own
  prose; the text's digest is printed), and, for reporting only, of Spec-Bench's summarization
  turns (--specbench FILE), as issue 26's fake-quantized figures were;
- the median time of a forward over 1, 8 and 16 new tokens (logits for all) after --prefix
  cached tokens, the candidates interleaved in one process, alternated every repeat;
- resident memory added by loading the model, building the runner and freeing the float
  weights it replaced, in a fresh process per candidate (--memory).
--paths adds the default recipe on slower paths: its decoder layers in torch's operations around
the C products (other bits: the C layers' norms and silu are not torch's), and, with the same
bits as that, on the products' slower paths: torch's
operations around oneDNN's int8 product (quantize, product, scale, round, bias: about 11
operations a product), and the C quantization and epilogue around oneDNN's product (3 calls);
the default candidates run this package's int8 kernel where the CPU has AVX512-VNNI (1 call
after the quantization; int8_kernel.py).

    .venv/bin/python benchmarks/int8.py [--tokens 2048] [--specbench ../shared/specbench/question.jsonl]
        [--repeats 15] [--prefix 200] [--memory] [--paths] [--out FILE]
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.kernels import int8_kernel
from specdecode.loading import DEFAULT_TARGET, give_freed_memory_back, load_model
from specdecode.runners.fast_llama import FastLlamaRunner, Int8Recipe

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "docs" / "design.md"  # what perplexity is measured on
CALIBRATION = ROOT / "README.md"  # what smoothing is calibrated on: another text
CANDIDATES = {
    "bfloat16": None,
    "w8a8, every product": Int8Recipe(keep_float=(), smoothing=0.0),
    "w8a8, head bf16": Int8Recipe(keep_float=("head",), smoothing=0.0),
    "w8a8, down + head bf16": Int8Recipe(keep_float=("down", "head"), smoothing=0.0),
    "w8a8, every product, smoothed 0.5 (random tokens)": Int8Recipe(keep_float=()),
    "w8a8, head bf16, smoothed 0.5 (random tokens)": Int8Recipe(keep_float=("head",)),
    # the default on AVX512-VNNI (elsewhere the head stays in bfloat16: the recipe above)
    "w8a8 default: head w8a16, smoothed 0.5 (random tokens)": Int8Recipe(keep_float=(), w8a16=("head",)),
}
SMOOTHED = {  # SmoothQuant's alpha, calibrated on CALIBRATION_TOKENS tokens of README.md
    "w8a8, head bf16, smoothed 0.5 (README.md)": (("head",), 0.5),
    "w8a8, down + head bf16, smoothed 0.5 (README.md)": (("down", "head"), 0.5),
}
CALIBRATION_TOKENS = 512
SIZES = (1, 8, 16)


@dataclasses.dataclass(frozen=True)
class OnPath:
    """The default recipe on one of the slower paths: "layers" (this package's product kernel, the
    rest of each layer in torch's operations, as before kernels/csrc/int8_layer.c), "torch"
    (torch's operations around oneDNN's product) or "onednn" (the C quantization and epilogue
    around it)."""

    path: str


PATHS = {
    "w8a8 default, layers in torch operations (C products only)": OnPath("layers"),
    "w8a8 default, torch operations around oneDNN (before)": OnPath("torch"),
    "w8a8 default, C quantization + epilogue around oneDNN": OnPath("onednn"),
}


@contextlib.contextmanager
def without_kernel():
    """int8_kernel.load() answers None meanwhile: products built are oneDNN's, calls run torch's."""
    kept = list(int8_kernel._ready)
    int8_kernel._ready[:] = [None]
    try:
        yield
    finally:
        int8_kernel._ready[:] = kept


class PathRunner:
    """A runner whose products were built for oneDNN and whose calls run on `path`."""

    def __init__(self, model, path: str):
        with without_kernel():
            self.runner = FastLlamaRunner(model, "w8a8", Int8Recipe())
        self.path = path

    def __getattr__(self, name: str):
        value = getattr(self.runner, name)
        if not callable(value) or self.path != "torch":
            return value

        def call(*args, **kwargs):
            with without_kernel():
                return value(*args, **kwargs)

        return call


def runner_of(model, recipe: Int8Recipe | OnPath | None):
    int8_kernel.load()  # built before a path switches it off
    if isinstance(recipe, OnPath) and recipe.path == "layers":
        runner = FastLlamaRunner(model, "w8a8", Int8Recipe())
        runner._int8_layers = None  # as where int8_layer.load() gives None
        return runner
    if isinstance(recipe, OnPath):
        return PathRunner(model, recipe.path)
    return FastLlamaRunner(model) if recipe is None else FastLlamaRunner(model, "w8a8", recipe)


def add_smoothed(tokenizer) -> None:
    """The smoothed candidates, calibrated on README.md's first tokens."""
    calibration = tuple(tokenizer(CALIBRATION.read_text()).input_ids[:CALIBRATION_TOKENS])
    for name, (keep, alpha) in SMOOTHED.items():
        CANDIDATES[name] = Int8Recipe(keep_float=keep, smoothing=alpha, calibration=calibration)


def perplexity_of(runner: FastLlamaRunner, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[2:], in one prefill: asking for all but one row's
    logits keeps the prefill's batched attention (all rows would run the per-query kernel, whose
    cost grows with the square of a 2048-token text)."""
    runner.reset()
    logits = runner.forward(torch.tensor(ids), len(ids) - 1)[:-1]  # [n - 2, vocab]: after tokens 1 .. n - 2
    return float(torch.exp(F.cross_entropy(logits.double(), torch.tensor(ids[2:]))))


def specbench_text(path: Path) -> str:
    turns = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return "\n\n".join(q["turns"][0] for q in turns if q["category"] == "summarization")


def forward_ms(runners: dict[str, FastLlamaRunner], prefix: list[int], repeats: int) -> dict[tuple[str, int], float]:
    """Median ms of a forward over n new tokens after the prefix, per runner and n, interleaved."""
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in runners for n in SIZES}
    names = list(runners)
    new = torch.arange(100, 100 + max(SIZES))
    for repeat in range(repeats + 1):  # the first pass warms up, untimed
        for name in names if repeat % 2 else names[::-1]:
            runner = runners[name]
            runner.reset()
            runner.forward(torch.tensor(prefix), 1)
            for n in SIZES:
                runner.crop(len(prefix))
                start = time.perf_counter()
                runner.forward(new[:n], n)
                if repeat:
                    times[name, n].append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def memory_of(name: str) -> None:
    """In this process: RSS added by loading, building the runner, freeing what it replaced and
    one 16-token forward; printed as JSON."""
    before = rss()
    model, tokenizer = load_model(DEFAULT_TARGET, "cpu", "bfloat16")
    add_smoothed(tokenizer)
    CANDIDATES.update(PATHS)
    runner = runner_of(model, CANDIDATES[name])
    runner.release_model_weights()
    runner.forward(torch.arange(16), 16)
    give_freed_memory_back()
    print(json.dumps({"rss": rss() - before, "kv_cache": runner.cache.nbytes}))


def memories() -> dict[str, dict]:
    found = {}
    for name in CANDIDATES:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-of", name], capture_output=True, text=True, check=True
        ).stdout
        found[name] = json.loads(out.strip().splitlines()[-1])
        print(f"memory {name}: {found[name]}", flush=True)
    return found


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--specbench", type=Path, help="Spec-Bench's question.jsonl, to report its perplexity too")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--memory", action="store_true", help="also measure resident memory, a process each")
    parser.add_argument("--no-speed", action="store_true", help="perplexity (and memory) only")
    parser.add_argument("--only", nargs="*", help="these candidates (and bfloat16) only")
    parser.add_argument("--paths", action="store_true", help="also the default recipe on the slower product paths")
    parser.add_argument("--memory-of", help=argparse_hidden())
    args = parser.parse_args()
    if args.memory_of:
        memory_of(args.memory_of)
        return
    model, tokenizer = load_model(DEFAULT_TARGET, "cpu", "bfloat16")
    add_smoothed(tokenizer)
    if args.paths:
        CANDIDATES.update(PATHS)
    for name in [n for n in CANDIDATES if args.only and n not in ("bfloat16", *PATHS) and n not in args.only]:
        del CANDIDATES[name]
    texts = {"design.md": TEXT.read_text()}
    if args.specbench:
        texts["Spec-Bench summarization"] = specbench_text(args.specbench)
    ids = {name: tokenizer(text).input_ids[: args.tokens] for name, text in texts.items()}
    runners = {name: runner_of(model, recipe) for name, recipe in CANDIDATES.items()}
    perplexity = {}
    for (c, r), t in itertools.product(runners.items(), ids):
        perplexity[c, t] = perplexity_of(r, ids[t])
        print(f"perplexity {c}, {t}: {perplexity[c, t]:.3f}", flush=True)
    prefix = ids["design.md"][: args.prefix]
    ms = forward_ms(runners, prefix, args.repeats) if not args.no_speed else {}
    print(f"forward ms: {ms}", flush=True)
    mem = memories() if args.memory else {}
    rows = []
    for name in CANDIDATES:
        row = [name]
        for t in ids:
            value = perplexity[name, t]
            row.append(f"{value:.3f} ({value / perplexity['bfloat16', t] - 1:+.1%})")
        if ms:
            row += [f"{ms[name, n]:.2f}" for n in SIZES] + [f"{ms[name, 16] / ms[name, 1]:.2f}"]
            row += [f"{ms[name, 1] / ms['bfloat16', 1]:.2f}"]
        if mem:
            row += [f"{mem[name]['rss'] / 2**20:.0f}", f"{mem[name]['rss'] / mem['bfloat16']['rss']:.2f}"]
        rows.append(row)
    header = ["precision"] + [f"perplexity, {t} ({len(ids[t])} tokens)" for t in ids]
    header += [f"forward {n} ms" for n in SIZES] + ["16 / 1", "1 token x bf16"] if ms else []
    header += ["RSS added MB", "x bf16"] if mem else []
    digest = hashlib.sha256(texts["design.md"].encode()).hexdigest()[:12]
    note = f"design.md sha256 {digest}; prefix {args.prefix} tokens; medians of {args.repeats}, {torch.get_num_threads()} threads"
    write_table(markdown_table(header, rows) + f"\n\n{note}", args.out)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
