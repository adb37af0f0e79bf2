"""Is speculative decoding exact in half precision on this GPU? (issue 12, item 5)

For each precision, 10 prompts decoded greedily by target-only decoding, then by prompt-lookup
speculation alone and batched (8 at a time): how many outputs equal target-only decoding
token for token. `auto` picks float32 on CUDA until this prints every output identical for a
half precision.

    .venv/bin/python benchmarks/gpu_exactness.py [--device cuda] [--dtypes float32,bfloat16,float16] [--max-new-tokens 64] [--out FILE]

Prompts: the first 10 of the shipped Spec-Bench subset (copy-type ones draft the most).
"""

from __future__ import annotations

import time

import torch

from specdecode import DrafterOptions, SpeculativeEngine
from specdecode.bench.prompts import load_prompts
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.bench.tables import markdown_table

NUM_PROMPTS = 10


def check(dtype: str, device: str, new_tokens: int) -> list[str]:
    engine = SpeculativeEngine.from_pretrained(
        drafter="prompt-lookup",
        device=device,
        dtype=dtype,
        options=DrafterOptions(adaptive=False),
        cache=NO_CACHE,  # every output decoded
    )
    texts = [p.text for p in load_prompts()[:NUM_PROMPTS]]
    options = dict(max_new_tokens=new_tokens, chat=True)
    start = time.perf_counter()
    target_only = [engine.generate(t, speculative=False, **options)[0] for t in texts]
    alone = [engine.generate(t, **options)[0] for t in texts]
    batched = engine.generate(texts, max_batch_size=8, **options)
    seconds = time.perf_counter() - start

    def same(results) -> int:
        return sum(r.token_ids == t.token_ids for r, t in zip(results, target_only, strict=True))

    accepted = sum(r.stats.accepted_tokens for r in alone)
    return [dtype, f"{same(alone)}/{len(texts)}", f"{same(batched)}/{len(texts)}", str(accepted), f"{seconds:.1f}"]


def main() -> None:
    parser = script_parser(__doc__, device="cuda", max_new_tokens=64)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16", help="comma-separated [default: %(default)s]")
    args = parser.parse_args()
    rows = [check(dtype, args.device, args.max_new_tokens) for dtype in args.dtypes.split(",")]
    header = ["dtype", "speculative alone = target-only", "batched = target-only", "accepted drafts", "seconds"]
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    lines = [f"Exactness of speculation on {name}, {args.max_new_tokens} greedy tokens", ""]
    write_table("\n".join([*lines, markdown_table(header, rows)]), args.out)


if __name__ == "__main__":
    main()
