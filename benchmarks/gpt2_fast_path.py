"""Target-only tokens/s of the fast path against transformers' `generate`, on GPT-2-sized models.

The GPU check of issue 5, runnable on any device: random-weight GPT-2 models shaped like
gpt2-medium (24 layers, 1024 wide, 16 heads) and distilgpt2 (6 layers, 768 wide, 12
heads); random weights time the same arithmetic as trained ones. Per model, greedy
decoding of the same prompt alternates between `generate` and this engine's fast path
(FastGPT2Runner, speculative=False), round after round, and the table gives the medians and their ratio. The
two outputs are compared token for token (they agree in float32; in half precision
they may part after a near-tie).

    .venv/bin/python benchmarks/gpt2_fast_path.py [--device cuda] [--dtype float16] [--max-new-tokens 128] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from specdecode import SpeculativeEngine, precision
from specdecode.bench.interleave import interleave, medians
from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.runners.fast_gpt2 import FastGPT2Runner

SHAPES = {
    "gpt2-medium-sized": dict(n_layer=24, n_embd=1024, n_head=16),
    "distilgpt2-sized": dict(n_layer=6, n_embd=768, n_head=12),
}
PROMPT_TOKENS = 32


def random_gpt2(shape: dict, device: str, dtype: torch.dtype) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=1024, eos_token_id=None, bos_token_id=None, **shape)
    return GPT2LMHeadModel(config).eval().to(device=device, dtype=dtype)


def measure(shape: dict, prompt: torch.Tensor, args, dtype: torch.dtype) -> list[str]:
    model = random_gpt2(shape, args.device, dtype)
    engine = SpeculativeEngine(FastGPT2Runner(model), num_speculative_tokens=0)
    inputs = prompt.to(args.device)

    def hf(_) -> list[int]:
        out = model.generate(inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0, PROMPT_TOKENS:].tolist()  # .tolist() waits for the device

    def fast(_) -> list[int]:
        return engine.generate(prompt.tolist(), max_new_tokens=args.max_new_tokens, speculative=False)[0].token_ids

    hf_tokens, fast_tokens = hf(None), fast(None)  # warm-up, and the outputs compared
    seconds = medians(interleave({"hf": hf, "fast": fast}, repeats=args.rounds))
    same = next((i for i, (a, b) in enumerate(zip(hf_tokens, fast_tokens)) if a != b), len(hf_tokens))
    n = args.max_new_tokens
    return [
        f"{n / seconds['hf']:.1f}",
        f"{n / seconds['fast']:.1f}",
        f"{seconds['hf'] / seconds['fast']:.2f}x",
        f"{same}/{n}",
    ]


def main() -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = script_parser(__doc__, device=default_device, dtype="auto", max_new_tokens=128, rounds=3)
    args = parser.parse_args()
    # a model loaded alone: "auto" is float32 (no fast path known, as loading.load_model resolves it)
    dtype = precision.resolve(args.dtype, where=precision.Circumstances(torch.device(args.device))).dtype
    prompt = torch.randint(0, 50257, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, shape in SHAPES.items():
        rows.append([name, *measure(shape, prompt, args, dtype)])
        print(rows[-1], flush=True)
    header = ["model", "transformers generate tok/s", "fast path tok/s", "x generate"]
    text = "\n".join(
        [
            f"# Fast path vs transformers generate, random GPT-2-sized models ({args.device}, {dtype})",
            "",
            f"Greedy, {args.max_new_tokens} new tokens after a {PROMPT_TOKENS}-token prompt, medians of "
            f"{args.rounds} alternated runs.",
            "",
            markdown_table([*header, "tokens equal before the first difference"], rows),
        ]
    )
    write_table(text, args.out)


if __name__ == "__main__":
    main()
