"""Speed, memory and quality of each precision the fast path supports, in one run.

For the default model: target-only tokens/s of transformers' `generate` (fp32, the
baseline) and of this engine in float32, bfloat16 and weight-only int8, interleaved per
prompt; the bytes of weights a forward reads; perplexity on a fixed text; and greedy
agreement with the float32 model (the share of its greedy tokens each variant reproduces
before the first difference, and the share of positions where the argmax agrees along the
float32 greedy path).

    .venv/bin/python benchmarks/precision.py [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import copy
import statistics

import torch

from specdecode import SpeculativeEngine
from specdecode.bench.interleave import interleave, medians
from specdecode.bench.prompts import OPEN_PROMPTS, PERPLEXITY_TEXT
from specdecode.bench.quality import greedy_agreement, runner_perplexity
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.runners import runner_for
from specdecode.runners.profiling import weight_bytes

HF = "transformers generate, float32"


def variants(model):
    """(name, runner, weight bytes a forward reads) for each precision."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    int8 = runner_for(model, quantization="int8-weight-only")
    products = [p for layer in int8.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    int8_bytes = sum(p.nbytes for p in products) + int8.lm_head.nbytes
    return [
        ("float32", runner_for(model), weight_bytes(model)),
        ("bfloat16", runner_for(bf16), weight_bytes(bf16)),
        ("int8 weights, float32", int8, int8_bytes),
    ]


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=64)
    args = parser.parse_args()
    new_tokens = args.max_new_tokens
    engine = SpeculativeEngine.from_pretrained(
        device="cpu", dtype="float32", drafter="none", cache=NO_CACHE, keep_model_weights=True
    )
    model, tokenizer = engine.target_runner.model, engine.tokenizer
    runs = variants(model)
    engines = {name: SpeculativeEngine(runner, tokenizer, None, num_speculative_tokens=0) for name, runner, _ in runs}
    prompts = [engine.encode(p, chat=True) for p in OPEN_PROMPTS]

    def hf(ids: list[int]) -> None:
        model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def ours(e: SpeculativeEngine):
        return lambda ids: e.generate([ids], max_new_tokens=new_tokens)[0]

    # side by side per prompt, after one untimed pass of each on the first prompt
    timed = interleave({HF: hf} | {name: ours(e) for name, e in engines.items()}, prompts, warm_up=1)
    speed = medians([r for r in timed if r.system == HF], key=lambda r: new_tokens / r.seconds)
    speed |= medians([r for r in timed if r.system != HF], key=lambda r: r.value.stats.tokens_per_second)
    greedy_fp32 = [r.value.token_ids for r in timed if r.system == "float32"]  # in prompt order

    text_ids = tokenizer(PERPLEXITY_TEXT).input_ids
    baseline = speed[HF]
    rows = [[HF, f"{weight_bytes(model) / 1e6:.0f}", f"{baseline:.1f}", "1.00", "", "", ""]]
    reference = runs[0][1]
    for name, runner, size in runs:
        pairs = [greedy_agreement(runner, reference, ids, g) for ids, g in zip(prompts, greedy_fp32)]
        reproduced, agree = zip(*pairs)
        rows.append(
            [name, f"{size / 1e6:.0f}", f"{speed[name]:.1f}", f"{speed[name] / baseline:.2f}"]
            + [f"{runner_perplexity(runner, text_ids):.3f}", f"{statistics.mean(reproduced):.0%}"]
            + [f"{statistics.mean(agree):.1%}"]
        )
    header = ["precision", "weight MB read per forward", "tokens/s", "x transformers generate", "perplexity"]
    header += ["greedy tokens reproduced", "argmax agreement"]
    title = f"Default model, {new_tokens} new tokens, {len(OPEN_PROMPTS)} prompts, greedy; median tokens/s over the prompts."
    write_table(f"{title}\n\n{markdown_table(header, rows)}", args.out)


if __name__ == "__main__":
    main()
