"""A draft head on Spec-Bench prompts, in one run: target-only against `auto` without a
head, `auto` with the head, and the head alone.

The head never saw these prompts: it trained on instructions the target wrote itself (Magpie)
and the target's answers to them (specdecode train-draft). Every system runs every prompt,
interleaved per prompt (the machine is shared and noisy), best of `--repeats` per prompt; every
output is checked against target-only decoding of the same engine (same precision). Systems:
- target-only;
- auto, no head: the default drafter with `--no-shipped-head` (recycling first on the fast runner);
- auto + head: the default drafter with the head (prompt lookup, draft store, head, recycling);
- head: the head alone (trees under greedy decoding on the fast runner), adaptive k;
- with --given-order, also both autos trying their candidates in the order they are given,
  as they did before the decoder ranked them by measured tokens per second (Decoder._ranked);
- with --linear-head, also "auto + head, nn.Linear products": the head drafting through its
  trained module's own float32 nn.Linear products instead of drafters.head.for_drafting's.
A second table gives the tree sizes each system's policy chose, by category, and the
verification costs (by new tokens) its decoder measured and chose them by.

--products times the head's forward and its logits instead (no prompts): the trained module
against for_drafting's copies (its layer on torch operations, and in C where the C layers run),
interleaved, medians. --draft-cost measures what issue 25 bounds: seconds the head spends
drafting per drafted token (k = 4 pinned, chains and trees, each with the layer on torch and in
C) against a target-only decoding step, on DRAFT_COST_PROMPTS (written for this script, not
Spec-Bench).
--sampling times target-only, auto + head (the head's one-hot trees at every temperature) and
auto + head drafting chains (drawn from q when sampling: what the head did before) at
temperatures 0, 0.7 and 1, interleaved per prompt and seed, on SAMPLING_PROMPTS (written for
the scripts); each cell sums tokens and seconds over the prompts and seeds.

    .venv/bin/python benchmarks/head.py --head DIR [--target NAME] [--prompts ../shared/specbench/question.jsonl]
        [--prompts-per-category 2] [--max-new-tokens 64] [--repeats 1] [-k 8] [--linear-head] [--out FILE]
    .venv/bin/python benchmarks/head.py --head DIR --products [--out FILE]
    .venv/bin/python benchmarks/head.py --head DIR --draft-cost [--dtype auto] [--quantization w8a8] [--out FILE]
    .venv/bin/python benchmarks/head.py --head DIR --sampling [--repeats 2] [-k 8] [--out FILE]
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter

import torch

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.environment import cpu_name
from specdecode.bench.prompts import OPEN_CHAT_PROMPTS, load_prompts, select_prompts
from specdecode.bench.scripts import script_parser, write_table
from specdecode.drafters.auto import candidates_of
from specdecode.drafters.factory import DrafterOptions, make_drafter
from specdecode.drafters.head import HeadCache, HeadDrafter, drafting_kind, for_drafting, load_head
from specdecode.loading import DEFAULT_TARGET

NO_CACHE = CacheOptions(response_cache=False, draft_store=False, prefix_cache=False)
DRAFT_COST_PROMPTS = OPEN_CHAT_PROMPTS[:4]
SAMPLING_PROMPTS = OPEN_CHAT_PROMPTS
TEMPERATURES = (0.0, 0.7, 1.0)


def systems(
    base: SpeculativeEngine, head: str, k: int, linear_head: bool, given_order: bool = False
) -> dict[str, SpeculativeEngine]:
    def drafter(name: str, draft: str | None, shipped_head: bool = True):
        options = DrafterOptions(shipped_head=shipped_head)
        return make_drafter(name, draft, base.target_runner, base.tokenizer, None, "auto", options)

    engines = {
        "target-only": base.with_drafter(None, 0),
        "auto, no head": base.with_drafter(drafter("auto", None, shipped_head=False), k, adaptive=True),
        "auto + head": base.with_drafter(drafter("auto", head), k, adaptive=True),
        "head": base.with_drafter(drafter("head", head), k, adaptive=True),
    }
    if linear_head:
        slow = drafter("auto", head)
        for candidate in candidates_of(slow):
            if isinstance(candidate, HeadDrafter):
                candidate.fast = candidate.head  # forks share it
        engines["auto + head, nn.Linear products"] = base.with_drafter(slow, k, adaptive=True)
    if given_order:
        unranked = {
            "auto, no head, given order": drafter("auto", None, shipped_head=False),
            "auto + head, given order": drafter("auto", head),
        }
        for name, auto in unranked.items():
            engines[name] = base.with_drafter(auto, k, adaptive=True)
            engines[name].decoder._ranked = lambda seq, batch_size, explores: seq.drafters  # as given
    return engines


def products(args) -> str:
    """Milliseconds of the head's forward (rows after 200 cached ones) and of its logits: the
    trained module, and for_drafting's copies with the layer on torch operations and in C."""
    base = engine_for(args)
    trained = load_head(args.head, base.target_runner.model)
    copies = [for_drafting(trained, layer_in_c=False), for_drafting(trained)]
    heads = {"nn.Linear (float32)": trained}
    heads.update({f"for_drafting ({drafting_kind(fast)})": fast for fast in copies})
    c = trained.config
    lines = [
        f"Head forward and logits, ms (medians of 100, interleaved), {torch.get_num_threads()} threads, {cpu_name()}; "
        "200 cached rows.",
        "",
        "| rows | " + " | ".join(f"{name}: forward | logits" for name in heads) + " |",
        "|---" * (2 * len(heads) + 1) + "|",
    ]
    with torch.inference_mode():
        for rows in (1, 4, 16):
            features, tokens = torch.randn(rows, c.hidden_size), torch.randint(0, c.target_vocab_size, (rows,))
            positions, mask = torch.arange(200, 200 + rows), torch.ones(rows, 200 + rows, dtype=torch.bool)
            cache = HeadCache(c)
            cache.append(torch.randn(c.num_kv_heads, 200, c.head_dim), torch.randn(c.num_kv_heads, 200, c.head_dim))
            times: dict[str, list[list[float]]] = {name: [[], []] for name in heads}
            for _ in range(110):
                for name, head in heads.items():
                    cache.length = 200
                    start = time.perf_counter()
                    if head is trained:
                        g = head(features, tokens, positions, cache.past(), mask)[0]
                    else:
                        g = head.draft_forward(features, tokens, positions, cache, mask)
                    middle = time.perf_counter()
                    head.logits(g)
                    times[name][0].append(middle - start)
                    times[name][1].append(time.perf_counter() - middle)
            cells = [f"{statistics.median(t[10:]) * 1e3:.3f}" for pair in times.values() for t in pair]
            lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def engine_for(args) -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained(
        args.target,
        device="cpu",
        dtype=args.dtype,
        cache=NO_CACHE,
        drafter="none",
        quantization=args.quantization,
        keep_model_weights=True,  # the heads' drafters are made after loading, from the model's own layers
    )


def chat(engine: SpeculativeEngine) -> bool:
    """Prompts through the chat template where the model has one; a base model's as plain text."""
    return bool(getattr(engine.tokenizer, "chat_template", None))


class _TimedHead(HeadDrafter):
    """A HeadDrafter that adds up its proposals' seconds and drafted tokens."""

    spent = [0.0, 0]  # seconds, tokens: shared by forks

    def propose(self, *args, **kwargs):
        start = time.perf_counter()
        draft = super().propose(*args, **kwargs)
        self.spent[0] += time.perf_counter() - start
        self.spent[1] += len(draft)
        return draft

    def fork(self) -> _TimedHead:
        return _TimedHead(self.head, self.drafts_trees, self.branching, self.fast)


def draft_cost(args) -> str:
    base = engine_for(args)
    head = load_head(args.head, base.target_runner.model)
    target_only = base.with_drafter(None, 0)
    target_only.generate(DRAFT_COST_PROMPTS[0], max_new_tokens=16, chat=True)  # warm the shapes
    per_token = []
    for prompt in DRAFT_COST_PROMPTS:
        [result] = target_only.generate(prompt, max_new_tokens=args.max_new_tokens, chat=True)
        per_token.append(result.stats.wall_time_s / result.stats.generated_tokens)
    step = statistics.median(per_token)
    lines = [
        f"{base.precision}, {torch.get_num_threads()} threads, {cpu_name()}; greedy, {args.max_new_tokens} new tokens, "
        f"{len(DRAFT_COST_PROMPTS)} prompts; target-only: {step * 1e3:.2f} ms per token (median over the prompts).",
        "",
        "| head drafts (k = 4 pinned) | ms per drafted token | x a target-only token | tokens per target forward |",
        "|---|---|---|---|",
    ]
    for tree, layer_in_c in itertools.product((False, True), (False, True)):
        drafter = _TimedHead(head, tree=tree, fast=for_drafting(head, layer_in_c))
        view = base.with_drafter(drafter, 4, adaptive=False)
        view.generate(DRAFT_COST_PROMPTS[0], max_new_tokens=16, chat=True)
        drafter.spent[:] = [0.0, 0]
        results = [view.generate(p, max_new_tokens=args.max_new_tokens, chat=True)[0] for p in DRAFT_COST_PROMPTS]
        per_draft = drafter.spent[0] / max(drafter.spent[1], 1)
        tokens = statistics.mean(r.stats.mean_accepted_length for r in results)
        kind = ("trees" if tree else "chains") + (", layer in C" if drafter.fast.kernel_layer else ", layer on torch")
        lines.append(f"| {kind} | {per_draft * 1e3:.3f} | {per_draft / step * 100:.1f}% | {tokens:.2f} |")
    return "\n".join(lines) + "\n"


def sampling(args) -> str:
    """Speed against target-only and tokens per forward, by temperature (module docstring)."""
    base = engine_for(args)

    def auto_with_head():
        return make_drafter("auto", args.head, base.target_runner, base.tokenizer, None, "auto", DrafterOptions())

    chains = auto_with_head()
    for candidate in candidates_of(chains):
        if isinstance(candidate, HeadDrafter):
            candidate.drafts_trees = False  # forks copy it
    engines = {
        "target-only": base.with_drafter(None, 0),
        "auto + head": base.with_drafter(auto_with_head(), args.k, adaptive=True),
        "auto + head drafting chains": base.with_drafter(chains, args.k, adaptive=True),
    }
    prompts = [base.encode(p, chat=True) for p in SAMPLING_PROMPTS]
    totals: dict[tuple[float, str], list[float]] = {}  # tokens, seconds, forwards
    for temperature in TEMPERATURES:
        for engine in engines.values():  # warm the shapes, and each policy at this temperature
            engine.generate([prompts[0]], max_new_tokens=16, temperature=temperature, seed=99)
        for ids in prompts:
            for seed in range(args.repeats):
                for name, engine in engines.items():
                    [result] = engine.generate(
                        [ids], max_new_tokens=args.max_new_tokens, temperature=temperature, seed=seed
                    )
                    total = totals.setdefault((temperature, name), [0.0, 0.0, 0.0])
                    total[0] += result.stats.generated_tokens
                    total[1] += result.stats.wall_time_s
                    total[2] += result.stats.target_forwards
        print(temperature, {n: round(t[0] / t[1], 1) for (tt, n), t in totals.items() if tt == temperature}, flush=True)
    lines = [
        f"{args.target}, {base.precision}, {torch.get_num_threads()} threads, {cpu_name()}; {args.max_new_tokens} new "
        f"tokens, chat template, {len(prompts)} prompts (SAMPLING_PROMPTS) x {args.repeats} seeds, systems interleaved; "
        f"k (tree nodes) at most {args.k}, adaptive; head {args.head}.",
        "",
        "Each cell: speed against target-only at the same temperature (tokens over seconds, summed), then tokens "
        "per target forward.",
        "",
        "| temperature | target-only tok/s | " + " | ".join(list(engines)[1:]) + " |",
        "|---" * (len(engines) + 1) + "|",
    ]
    for temperature in TEMPERATURES:
        tokens, seconds, _ = totals[(temperature, "target-only")]
        cells = []
        for name in list(engines)[1:]:
            t = totals[(temperature, name)]
            cells.append(f"{t[0] / t[1] / (tokens / seconds):.2f}x, {t[0] / t[2]:.2f}")
        lines.append(f"| {temperature:g} | {tokens / seconds:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(args) -> str:
    torch.manual_seed(0)
    base = engine_for(args)
    engines = systems(base, args.head, args.k, args.linear_head, args.given_order)
    prompts = select_prompts(load_prompts(args.prompts), per_category=args.prompts_per_category)
    for engine in engines.values():  # warm the shapes each system runs
        engine.generate(["Say hello."], max_new_tokens=16, chat=chat(base))
    rows: dict[tuple[str, str], list] = {}
    trees: dict[tuple[str, str], Counter] = {}  # (category, system) -> tree size (nodes) -> steps
    for prompt in prompts:
        ids = base.encode(prompt.text, chat=chat(base))
        best: dict[str, object] = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                result = engine.generate([ids], max_new_tokens=args.max_new_tokens)[0]
                if name not in best or result.stats.tokens_per_second > best[name].stats.tokens_per_second:
                    best[name] = result
        reference = best["target-only"].token_ids
        for name, result in best.items():
            rows.setdefault((prompt.category, name), []).append(
                (result.stats.tokens_per_second, result.stats.mean_accepted_length, result.token_ids == reference)
            )
            trees.setdefault((prompt.category, name), Counter()).update(result.stats.tree_histogram)
        print(prompt.category, {n: round(r.stats.tokens_per_second, 1) for n, r in best.items()}, flush=True)
    return report(rows, base, args) + tree_report(trees, engines)


def report(rows: dict, base: SpeculativeEngine, args) -> str:
    names = list(dict.fromkeys(name for _, name in rows))
    categories = list(dict.fromkeys(category for category, _ in rows))
    lines = [
        f"{args.target}, {base.precision}, {torch.get_num_threads()} threads, {cpu_name()}; greedy, "
        f"{args.max_new_tokens} new tokens, {'chat template' if chat(base) else 'plain text'}, best of {args.repeats} "
        "per prompt, systems interleaved "
        f"per prompt, caches off; k (tree nodes) at most {args.k}; head {args.head}.",
        "",
        "Each cell: speed against target-only (mean of the prompts' tokens per second, ratio), then tokens per "
        "target forward.",
        "",
        *table_head(["category (prompts)", *names, "outputs identical"]),
    ]
    for category in categories + ["all"]:
        chosen = categories if category == "all" else [category]
        cells = []
        baseline = statistics.mean(r[0] for c in chosen for r in rows[(c, "target-only")])
        for name in names:
            results = [r for c in chosen for r in rows[(c, name)]]
            speed = statistics.mean(r[0] for r in results)
            cells.append(f"{speed / baseline:.2f}x, {statistics.mean(r[1] for r in results):.2f}")
        same = sum(r[2] for c in chosen for name in names for r in rows[(c, name)])
        total = sum(len(rows[(c, name)]) for c in chosen for name in names)
        count = sum(len(rows[(c, "target-only")]) for c in chosen)
        lines.append(f"| {category} ({count}) | " + " | ".join(cells) + f" | {same}/{total} |")
    return "\n".join(lines) + "\n"


def table_head(columns: list[str]) -> list[str]:
    """A markdown table's header and rule."""
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def tree_report(trees: dict[tuple[str, str], Counter], engines: dict[str, SpeculativeEngine]) -> str:
    """The tree sizes each system's policy chose, by category (the kept result of each prompt),
    and the verification costs it chose them by: what each system's decoder measured."""
    categories = list(dict.fromkeys(category for category, _ in trees))
    names = [name for name in engines if any(trees[(c, name)] for c in categories)]
    if not names:
        return ""
    lines = [
        "",
        "Tree sizes chosen (AdaptiveTree, core/adaptive.py): nodes per tree step, mean, then the sizes most "
        "chosen as nodes: steps.",
        "",
        *table_head(["category", *names]),
    ]
    for category in categories + ["all"]:
        chosen = categories if category == "all" else [category]
        cells = [_tree_cell(sum((trees[(c, name)] for c in chosen), Counter())) for name in names]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    lines += ["", "Verification forward by new tokens, as each decoder measured it (ms, moving average):", ""]
    for name in names:
        seconds = sorted(engines[name].decoder.costs.seconds.items())
        lines.append(f"- {name}: " + ", ".join(f"{n}: {1000 * s:.1f}" for n, s in seconds))
    return "\n".join(lines) + "\n"


def _tree_cell(sizes: Counter) -> str:
    steps = sum(sizes.values())
    if not steps:
        return "no trees"
    mean = sum(n * count for n, count in sizes.items()) / steps
    return f"{mean:.1f} ({', '.join(f'{n}: {c}' for n, c in sizes.most_common(3))})"


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=64, k=8, repeats=1, prompts_per_category=2, dtype="auto")
    parser.add_argument("--head", required=True, help="the head's folder (specdecode train-draft --output)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="the target model [default: %(default)s]")
    parser.add_argument("--prompts", default=None, help="JSONL prompts [default: the shipped Spec-Bench subset]")
    parser.add_argument("--linear-head", action="store_true", help="also auto + head on nn.Linear products")
    parser.add_argument(
        "--given-order", action="store_true", help="also both autos trying their candidates in the given order"
    )
    parser.add_argument("--products", action="store_true", help="time the head's forward instead")
    parser.add_argument("--quantization", default=None, help="the target's, e.g. w8a8 [default: none]")
    parser.add_argument("--draft-cost", action="store_true", help="the head's draft cost per drafted token instead")
    parser.add_argument("--sampling", action="store_true", help="trees against chains by temperature instead")
    args = parser.parse_args()
    mode = products if args.products else draft_cost if args.draft_cost else sampling if args.sampling else run
    write_table(mode(args), args.out)


if __name__ == "__main__":
    main()
