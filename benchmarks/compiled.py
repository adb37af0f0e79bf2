"""The fast Llama runner compiled by torch.compile against itself eager, side by side in one process.

One engine (default model, bfloat16); its runner's compiled forward is switched off and on
between rounds, so that a noisy machine slows both alike. Per round and mode: a cached
forward over 1 and 5 tokens (after 200 cached tokens), and target-only decoding of the
held-out Spec-Bench prompts (64 tokens each). Compiling happens before any timing and is
reported apart (inductor keeps the code on disk: a second run compiles faster).

    .venv/bin/python benchmarks/compiled.py [--rounds 3] [--dtype bfloat16] [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import statistics
import time

from specdecode import SpeculativeEngine
from specdecode.bench.interleave import interleave
from specdecode.bench.prompts import held_out_prompts
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.runners.profiling import cached_forward_ms

MODES = ("eager", "compiled")


def measure(dtype: str, rounds: int, new_tokens: int) -> tuple[float, dict[str, list[dict]]]:
    """Seconds spent compiling, and each mode's measurements, one dict per round."""
    engine = SpeculativeEngine.from_pretrained(
        drafter="prompt-lookup", device="cpu", dtype=dtype, cache=NO_CACHE, compile=True
    )
    runner = engine.target_runner
    compiled = runner._compiled_layers  # switched off and on below (a private switch, for this comparison only)
    start = time.perf_counter()
    for n in (1, 5):
        cached_forward_ms(runner, n, repeats=1)  # compiles this size
    compile_seconds = time.perf_counter() - start
    prompts = [engine.encode(p, chat=True) for p in held_out_prompts()]
    engine.eos_token_ids = frozenset()  # every run decodes exactly new_tokens

    def mode(name: str):
        def measure_mode(_) -> dict:
            runner._compiled_layers = compiled if name == "compiled" else None
            forwards = {"forward_1": cached_forward_ms(runner, 1), "forward_5": cached_forward_ms(runner, 5)}
            results = [engine.generate([ids], max_new_tokens=new_tokens, speculative=False)[0] for ids in prompts]
            return forwards | {
                "tokens_per_second": [r.stats.tokens_per_second for r in results],
                "outputs": [r.token_ids for r in results],
            }

        return measure_mode

    runs = interleave({name: mode(name) for name in MODES}, repeats=rounds)
    return compile_seconds, {name: [r.value for r in runs if r.system == name] for name in MODES}


def report(dtype: str, rounds: int, compile_seconds: float, found: dict[str, list[dict]]) -> str:
    identical = [r["outputs"] for r in found["eager"]] == [r["outputs"] for r in found["compiled"]]
    rows = []
    for mode in MODES:
        one = statistics.median(r["forward_1"] for r in found[mode])
        five = statistics.median(r["forward_5"] for r in found[mode])
        speed = statistics.median(t for r in found[mode] for t in r["tokens_per_second"])
        each = ", ".join(f"{r['forward_1']:.1f}" for r in found[mode])
        rows.append([mode, f"{one:.1f}", f"{five:.1f}", f"{five / one:.2f}", f"{speed:.1f}", each])
    header = ["mode", "forward 1 token ms", "forward 5 tokens ms", "5 / 1", "target-only tok/s"]
    return "\n".join(
        [
            f"Default model (SmolLM2-135M-Instruct), {dtype}; {rounds} rounds alternating eager and compiled; medians.",
            f"Compiling sizes 1 and 5 took {compile_seconds:.0f} s before timing. "
            f"Target-only outputs identical eager and compiled: {identical}.",
            "",
            markdown_table([*header, "each round's forward 1 ms"], rows),
        ]
    )


def main() -> None:
    parser = script_parser(__doc__, rounds=3, dtype="bfloat16", max_new_tokens=64)
    args = parser.parse_args()
    found = measure(args.dtype, args.rounds, args.max_new_tokens)
    write_table(report(args.dtype, args.rounds, *found), args.out)


if __name__ == "__main__":
    main()
