"""The repeat workloads (`specdecode bench --workload repeat`, bench/repeat.py), as a script
whose table can be kept where asked:

    .venv/bin/python benchmarks/repeat_workload.py [--prompts-per-category 4] [--max-new-tokens 48] [--seed 0] [--out FILE]
"""

from __future__ import annotations

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.repeat import run_repeat_workload
from specdecode.bench.scripts import script_parser, write_table


def main() -> None:
    parser = script_parser(__doc__, prompts_per_category=4, max_new_tokens=48, seed=0)
    args = parser.parse_args()
    engine = SpeculativeEngine.from_pretrained(
        drafter="none", device="cpu", dtype="bfloat16", cache=CacheOptions(draft_store=False, prefix_cache=False)
    )
    table = run_repeat_workload(engine, args.prompts_per_category, args.max_new_tokens, args.seed)
    write_table(table, args.out)


if __name__ == "__main__":
    main()
