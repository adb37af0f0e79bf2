"""Is speculative decoding exact in half precision on this GPU? (issue 12, item 5)

For each precision, 10 prompts decoded greedily by target-only decoding, then by prompt-lookup
speculation alone and batched (8 at a time): how many outputs equal target-only decoding
token for token. `auto` picks float32 on CUDA until this prints every output identical for a
half precision.

    python benchmarks/gpu_exactness.py --device cuda [--dtypes float32,bfloat16,float16] [--out FILE]

Prompts: the first 10 of the shipped Spec-Bench subset (copy-type ones draft the most).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from report import emit
from specdecode import CacheOptions, DrafterOptions, SpeculativeEngine
from specdecode.bench.prompts import default_prompt_file

NUM_PROMPTS = 10


def prompts() -> list[str]:
    with open(default_prompt_file()) as lines:
        rows = [json.loads(line) for line in lines]
    return [(row.get("turns") or [row.get("prompt")])[0] for row in rows[:NUM_PROMPTS]]


def check(dtype: str, device: str, new_tokens: int) -> list[str]:
    engine = SpeculativeEngine.from_pretrained(
        drafter="prompt-lookup",
        device=device,
        dtype=dtype,
        options=DrafterOptions(adaptive=False),
        cache=CacheOptions(response_cache=False, draft_store=False),  # every output decoded
    )
    texts = prompts()
    options = dict(max_new_tokens=new_tokens, chat=True)
    start = time.perf_counter()
    target_only = [engine.generate(t, speculative=False, **options)[0] for t in texts]
    alone = [engine.generate(t, **options)[0] for t in texts]
    batched = engine.generate_batched(texts, max_batch_size=8, **options)
    seconds = time.perf_counter() - start

    def same(results) -> int:
        return sum(r.token_ids == t.token_ids for r, t in zip(results, target_only, strict=True))

    accepted = sum(r.stats.accepted_tokens for r in alone)
    return [dtype, f"{same(alone)}/{len(texts)}", f"{same(batched)}/{len(texts)}", str(accepted), f"{seconds:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    rows = [check(dtype, args.device, args.new_tokens) for dtype in args.dtypes.split(",")]
    header = ["dtype", "speculative alone = target-only", "batched = target-only", "accepted drafts", "seconds"]
    lines = [
        f"Exactness of speculation on {name}, {args.new_tokens} greedy tokens",
        "",
        "| " + " | ".join(header) + " |",
    ]
    lines += ["|" + "---|" * len(header)] + ["| " + " | ".join(row) + " |" for row in rows]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
