"""`auto` in two variants against target-only decoding, in one process, interleaved per prompt
(bench.interleave, the order shuffled), on chat prompts written for the scripts, never Spec-Bench:
OPEN_CHAT_PROMPTS and OPEN_PROMPTS (open-ended), DRAFTER_PROMPTS["copy"] (answers that copy the
prompt). Every output is checked against target-only's.

--compare head-layer: the shipped head's layer in C against the same layer on torch operations
(drafters/head_kernel.py), two engines, each measuring its own costs.
--compare cold: one engine whose measured costs and acceptance carry from answer to answer (a
server's) against a fresh decoder and drafter for every answer, made before its timer starts
(what `specdecode bench` gives each answer of a stateful drafter, and what a one-shot
`specdecode generate` starts with); the fresh decoders share the engine's measured step costs,
as every `with_drafter` view does, and measure acceptance from nothing.
--compare head --head DIR: the head shipped for the default model against the draft head in DIR
(a `specdecode train-draft` output), each in `auto` and alone (`--drafter head`).
--compare k: `auto` with k <= -k against k <= --other-k (trees of up to that many nodes).

    .venv/bin/python benchmarks/auto_variants.py --compare head-layer|cold|head|k [--head DIR]
        [--other-k 8] [--rounds 2] [--max-new-tokens 64] [-k 4] [--quantization w8a8|none] [--dtype auto] [--out FILE]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from specdecode import SpeculativeEngine
from specdecode.bench.environment import cpu_name
from specdecode.bench.interleave import interleave
from specdecode.bench.prompts import DRAFTER_PROMPTS, OPEN_CHAT_PROMPTS, OPEN_PROMPTS
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.bench.systems import named_drafter
from specdecode.drafters.auto import candidates_of
from specdecode.drafters.head import SHIPPED_HEADS, HeadDrafter, for_drafting
from specdecode.loading import DEFAULT_TARGET

PROMPTS = {"open-ended": list(dict.fromkeys([*OPEN_CHAT_PROMPTS, *OPEN_PROMPTS])), "copy": DRAFTER_PROMPTS["copy"]}


def load(args, draft: str | None = None, k: int | None = None, drafter: str = "auto") -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained(
        device="cpu", dtype=args.dtype, cache=NO_CACHE, drafter=drafter, draft=draft,
        num_speculative_tokens=args.k if k is None else k,
        quantization=None if args.quantization == "none" else args.quantization,
        keep_model_weights=True,  # named_drafter makes auto's head again
    )  # fmt: skip


def head_layer_variants(args, items: list) -> tuple[SpeculativeEngine, dict[str, Callable]]:
    in_c, on_torch = load(args), load(args)
    [head] = [c for c in candidates_of(on_torch.drafter) if isinstance(c, HeadDrafter)]
    head.fast = for_drafting(head.head, layer_in_c=False)  # forks share it
    return in_c, {"auto, head layer in C": lambda item: in_c, "auto, head layer on torch": lambda item: on_torch}


def cold_variants(args, items: list) -> tuple[SpeculativeEngine, dict[str, Callable]]:
    base = load(args)
    auto = named_drafter("auto", base)  # as `bench` makes it: without the draft store
    warm = base.with_drafter(auto(), args.k, adaptive=True)
    cold = [base.with_drafter(auto(), args.k, adaptive=True) for _ in items]  # one per answer, made untimed
    return base, {"auto, warm": lambda item: warm, "auto, cold": lambda item: cold[item[0]]}


def head_variants(args, items: list) -> tuple[SpeculativeEngine, dict[str, Callable]]:
    shipped = str(SHIPPED_HEADS / DEFAULT_TARGET)
    engines = {
        f"{drafter}, {name}": load(args, draft=folder, drafter=drafter)
        for drafter in ("auto", "head")
        for name, folder in (("shipped head", shipped), (f"head {args.head}", args.head))
    }
    return engines["auto, shipped head"], {name: (lambda item, e=engine: e) for name, engine in engines.items()}


def k_variants(args, items: list) -> tuple[SpeculativeEngine, dict[str, Callable]]:
    small, large = load(args), load(args, k=args.other_k)
    return small, {f"auto, k <= {args.k}": lambda item: small, f"auto, k <= {args.other_k}": lambda item: large}


VARIANTS = {"head-layer": head_layer_variants, "cold": cold_variants, "head": head_variants, "k": k_variants}


def run(args) -> str:
    prompts = [(kind, text) for kind, texts in PROMPTS.items() for text in texts]
    items = [(i, kind) for i, (kind, _) in enumerate(prompts * args.rounds)]  # (index, kind): each answer its own
    base, engines = VARIANTS[args.compare](args, items)
    ids = [base.encode(text, chat=True) for _, text in prompts]

    def system(engine_of: Callable | None) -> Callable:
        def generate(item):
            engine = base if engine_of is None else engine_of(item)
            prompt = ids[item[0] % len(ids)]
            [result] = engine.generate([prompt], max_new_tokens=args.max_new_tokens, speculative=engine_of is not None)
            return result

        return generate

    systems = {"target-only": system(None)} | {name: system(engine_of) for name, engine_of in engines.items()}
    for name, engine_of in engines.items():  # warm the shapes (and a warm engine), with an engine not timed
        if name != "auto, cold":
            engine_of(items[0]).generate([ids[0]], max_new_tokens=16)
    base.generate([ids[0]], max_new_tokens=16, speculative=False)
    runs = interleave(systems, items, order="shuffle")
    totals = defaultdict(lambda: [0.0, 0, 0])  # (kind, system) -> seconds, tokens, target forwards
    references = {}
    for r in runs:
        tokens = r.value.token_ids
        if references.setdefault(r.item % len(ids), tokens) != tokens:
            raise AssertionError(f"{r.system}'s output differs from the others' on prompt {r.item % len(ids)}")
        total = totals[(items[r.item][1], r.system)]
        total[0] += r.seconds
        total[1] += len(tokens)
        total[2] += r.value.stats.target_forwards
    return table(args, base, list(systems), totals)


def table(args, base: SpeculativeEngine, names: list[str], totals: dict) -> str:
    lines = [
        f"Default model, {base.precision}, {torch.get_num_threads()} threads, {cpu_name()}; greedy, "
        f"{args.max_new_tokens} new tokens, chat template, {args.rounds} rounds, caches off; "
        f"{'auto k as named' if args.compare == 'k' else f'auto k <= {args.k}'}; "
        "every output identical to target-only's.",
        "",
        "Tokens per second (against target-only), tokens per target forward.",
        "",
        "| prompts | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for kind, texts in PROMPTS.items():
        seconds, tokens, _ = totals[(kind, names[0])]
        cells = []
        for name in names:
            s, n, forwards = totals[(kind, name)]
            cells.append(f"{n / s:.1f} ({n / s / (tokens / seconds):.2f}x), {n / forwards:.2f}")
        lines.append(f"| {kind} ({len(texts)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=64, k=4, rounds=2)
    parser.add_argument("--compare", choices=tuple(VARIANTS), required=True, help="which variants")
    parser.add_argument("--head", help="--compare head: the draft head folder to compare with the shipped one")
    parser.add_argument("--other-k", type=int, default=8, help="--compare k: the larger k [default: 8]")
    parser.add_argument("--quantization", default="w8a8", help="the target's, or none [default: w8a8]")
    parser.add_argument("--dtype", default="auto", help="the target's [default: auto]")
    args = parser.parse_args()
    if args.compare == "head" and not args.head:
        parser.error("--compare head needs --head DIR")
    write_table(run(args), args.out)


if __name__ == "__main__":
    main()
