"""Every drafter against target-only decoding of the default model, in one run.

Greedy, 64 new tokens, chat template on. For each prompt, target-only decoding runs
before and after the drafters (their mean is that prompt's baseline), and each drafter's
output is checked token for token against it. Per drafter and prompt type (copy-type:
copy, edit, extract, summarize; open-ended): acceptance rate, mean accepted length
(tokens per target forward), mean k, tokens/s, and speedup = baseline seconds / drafter
seconds over the same prompts. Adaptive drafters share the target's step costs and keep
what they measured from prompt to prompt, as in a server.

    .venv/bin/python benchmarks/drafters.py [--max-new-tokens 64] [-k 12] [--dtype float32] [--lookup-only] [--out FILE]
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
from transformers import LlamaForCausalLM

from specdecode import SpeculativeEngine
from specdecode.bench.interleave import interleave
from specdecode.bench.prompts import DRAFTER_PROMPTS
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.drafters import (
    AutoDrafter,
    CrossTokenizerDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    self_quantized_drafter,
)
from specdecode.loading import load_model
from specdecode.runners import runner_for

BEFORE, AFTER = "target-only, before", "target-only, after"  # each prompt's baseline: the mean of the two


def random_draft(target) -> LlamaForCausalLM:
    """A useless draft: the target's architecture and vocabulary, 4 layers, random weights."""
    torch.manual_seed(0)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = 4
    return LlamaForCausalLM(config).eval()


def drafters(engine: SpeculativeEngine, k_max: int, model_drafters: bool = True) -> dict[str, tuple]:
    """name -> (drafter, k, adaptive)."""
    target = engine.target_runner.model
    useless = ModelDrafter(runner_for(random_draft(target)))
    lookup_family = {
        "prompt-lookup, k=4": (PromptLookupDrafter(), 4, False),
        f"prompt-lookup, adaptive k<={k_max}": (PromptLookupDrafter(), k_max, True),
        f"auto (lookup), adaptive k<={k_max}": (AutoDrafter([PromptLookupDrafter()]), k_max, True),
        f"auto (lookup + random draft), adaptive k<={k_max}": (
            AutoDrafter([PromptLookupDrafter(), useless]),
            k_max,
            True,
        ),
    }
    if not model_drafters:
        return lookup_family
    gemma, gemma_tokenizer = load_model("gemma3-270m", "cpu", "float32")
    cross = CrossTokenizerDrafter(runner_for(gemma), gemma_tokenizer, engine.tokenizer)
    return lookup_family | {
        "self-quantized bf16, k=4": (self_quantized_drafter(target, "bfloat16"), 4, False),
        "self-quantized int8, k=4": (self_quantized_drafter(target, "int8-weight-only"), 4, False),
        "cross-tokenizer gemma3-270m, k=4": (cross, 4, False),
        f"auto (lookup + cross-tokenizer gemma3), adaptive k<={k_max}": (
            AutoDrafter([PromptLookupDrafter(), copy.copy(cross)]),
            k_max,
            True,
        ),
    }


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=64, k=12, dtype="float32")
    parser.add_argument("--lookup-only", action="store_true", help="only prompt lookup, auto and the random draft")
    args = parser.parse_args()

    engine = SpeculativeEngine.from_pretrained(
        "smollm2-135m-instruct",
        drafter="none",
        device="cpu",
        dtype=args.dtype,
        cache=NO_CACHE,
        keep_model_weights=True,  # the self-quantized drafters copy it
    )
    views = {}
    for name, (drafter, k, adaptive) in drafters(engine, args.k, not args.lookup_only).items():
        views[name] = view = engine.with_drafter(drafter, k, adaptive=adaptive)  # shares the target and tokenizer
        view.generate("Say hello.", max_new_tokens=8, chat=True)  # warm-up: first calls and first measurements

    def system(view: SpeculativeEngine, speculative: bool = True):
        return lambda prompt: view.generate(
            prompt, max_new_tokens=args.max_new_tokens, chat=True, speculative=speculative
        )[0]

    systems = (
        {BEFORE: system(engine, False)} | {n: system(v) for n, v in views.items()} | {AFTER: system(engine, False)}
    )
    totals = defaultdict(lambda: defaultdict(float))  # (drafter, kind) -> sums
    for kind, prompts in DRAFTER_PROMPTS.items():
        runs = interleave(systems, prompts)
        for index in range(len(prompts)):
            seen = {r.system: r for r in runs if r.item == index}
            first, last = seen.pop(BEFORE), seen.pop(AFTER)
            assert first.value.token_ids == last.value.token_ids
            baseline_s = (first.seconds + last.seconds) / 2
            _add(totals["target-only", kind], first.value, baseline_s, baseline_s, True)
            for name, run in seen.items():
                _add(
                    totals[name, kind], run.value, run.seconds, baseline_s, run.value.token_ids == first.value.token_ids
                )
            print(
                f"{kind:10s} {baseline_s:5.2f} s target-only | "
                + " | ".join(f"{name.split(',')[0]} {baseline_s / run.seconds:.2f}x" for name, run in seen.items()),
                flush=True,
            )
    write_table(_table(totals, list(views), args), args.out)


def _add(sums: dict, result, seconds: float, baseline_s: float, identical: bool) -> None:
    stats = result.stats
    sums["drafted"] += stats.drafted_tokens
    sums["accepted"] += stats.accepted_tokens
    sums["forwards"] += stats.target_forwards
    sums["tokens"] += stats.generated_tokens
    sums["seconds"] += seconds
    sums["baseline_s"] += baseline_s
    sums["differ"] += not identical


def _table(totals: dict, names: list[str], args) -> str:
    rows = []
    for name in ["target-only", *names]:
        for kind in DRAFTER_PROMPTS:
            s = totals[name, kind]
            acceptance = f"{s['accepted'] / s['drafted']:.0%}" if s["drafted"] else "-"
            rows.append(
                [name, kind, acceptance, f"{s['tokens'] / s['forwards']:.2f}", f"{s['drafted'] / s['forwards']:.1f}"]
                + [f"{s['tokens'] / s['seconds']:.1f}", f"{s['baseline_s'] / s['seconds']:.2f}x"]
                + ["yes" if not s["differ"] else "NO"]
            )
    header = ["drafter", "prompts", "acceptance", "mean accepted length", "mean k", "tokens/s", "speedup"]
    return "\n".join(
        [
            f"# Drafters on smollm2-135m-instruct ({args.dtype}, CPU)",
            "",
            f"Greedy, {args.max_new_tokens} new tokens, 4 prompts per type; speedup = target-only seconds / drafter "
            "seconds on the same prompts, target-only run before and after each prompt's drafters.",
            "",
            markdown_table([*header, "outputs identical"], rows),
        ]
    )


if __name__ == "__main__":
    main()
