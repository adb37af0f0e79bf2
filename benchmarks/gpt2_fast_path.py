"""Target-only tokens/s of the fast path against transformers' `generate`, on GPT-2-sized models.

The GPU check of issue 5, runnable on any device: random-weight GPT-2 models shaped like
gpt2-medium (24 layers, 1024 wide, 16 heads) and distilgpt2 (6 layers, 768 wide, 12
heads); random weights time the same arithmetic as trained ones. Per model, greedy
decoding of the same prompt alternates between `generate` and this engine's fast path
(FastGPT2Runner, speculative=False), and the table gives the medians and their ratio. The
two outputs are compared token for token (they agree in float32; in half precision
they may part after a near-tie).

    .venv/bin/python benchmarks/gpt2_fast_path.py [--device cuda] [--dtype float16] [--new-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from report import emit
from specdecode import SpeculativeEngine
from specdecode.loading import resolve_dtype
from specdecode.runners.fast_gpt2 import FastGPT2Runner

SHAPES = {
    "gpt2-medium-sized": dict(n_layer=24, n_embd=1024, n_head=16),
    "distilgpt2-sized": dict(n_layer=6, n_embd=768, n_head=12),
}


def random_gpt2(shape: dict, device: str, dtype: torch.dtype) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=1024, eos_token_id=None, bos_token_id=None, **shape)
    return GPT2LMHeadModel(config).eval().to(device=device, dtype=dtype)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, torch.device(args.device))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [
        f"# Fast path vs transformers generate, random GPT-2-sized models ({device_name}, {dtype})",
        "",
        f"Command: `.venv/bin/python benchmarks/gpt2_fast_path.py --device {args.device} --dtype {args.dtype} "
        f"--new-tokens {args.new_tokens}{f' --out {args.out}' if args.out else ''}`. Greedy, {args.new_tokens} new tokens after a 32-token prompt, "
        f"medians of {args.repeats} alternated runs.",
        "",
        "| model | transformers generate tok/s | fast path tok/s | x generate | tokens equal before the first difference |",
        "|---|---|---|---|---|",
    ]
    prompt = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(0))
    for name, shape in SHAPES.items():
        model = random_gpt2(shape, args.device, dtype)
        engine = SpeculativeEngine(FastGPT2Runner(model), num_speculative_tokens=0)
        inputs = prompt.to(args.device)

        def hf(model=model, inputs=inputs) -> list[int]:
            out = model.generate(inputs, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            return out[0, 32:].tolist()  # .tolist() waits for the device

        def fast(engine=engine) -> list[int]:
            return engine.generate(prompt.tolist(), max_new_tokens=args.new_tokens, speculative=False)[0].token_ids

        hf_tokens, fast_tokens = hf(), fast()  # warm-up, and the outputs compared
        runs = [(seconds(hf), seconds(fast)) for _ in range(args.repeats)]  # alternated: same machine state
        hf_s, fast_s = (statistics.median(times) for times in zip(*runs))
        same = next((i for i, (a, b) in enumerate(zip(hf_tokens, fast_tokens)) if a != b), len(hf_tokens))
        lines.append(
            f"| {name} | {args.new_tokens / hf_s:.1f} | {args.new_tokens / fast_s:.1f} | {hf_s / fast_s:.2f}x "
            f"| {same}/{args.new_tokens} |"
        )
        print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
