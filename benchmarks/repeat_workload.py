"""The repeat workloads (`specdecode bench --workload repeat`, bench/repeat.py), as a script
whose table can be kept where asked:

    .venv/bin/python benchmarks/repeat_workload.py [--prompts 4] [--new-tokens 48] [--out FILE]
"""

from __future__ import annotations

import argparse

from report import emit
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.repeat import run_repeat_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = SpeculativeEngine.from_pretrained(
        drafter="none", device="cpu", dtype="bfloat16", cache=CacheOptions(draft_store=False)
    )
    emit(run_repeat_workload(engine, args.prompts, args.new_tokens, args.seed), args.out)


if __name__ == "__main__":
    main()
