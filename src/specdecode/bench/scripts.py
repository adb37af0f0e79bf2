"""What every script in benchmarks/ shares: one argparse style whose flags are spelled the same
where they mean the same (and as `specdecode bench` spells them), the caches a timing turns
off, and where a script's table goes.

The shared flags:
  --max-new-tokens N  most new tokens of each generation (of each request, for a server)
  -k N                most tokens drafted per step
  --rounds N          passes of the systems side by side (bench/interleave.py), kept as medians or the best
  --repeats N         timed calls inside one measurement, kept as their median (as `specdecode profile`)
  --requests N        requests sent to a server; --concurrency N: its concurrent clients
  --prompts-per-category N  prompts of each category (as `specdecode bench`: of each workload)
  --target, --dtype, --device, --seed, --threads
  --out FILE          also write the table to FILE, below the command that made it and the machine
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from specdecode.bench.environment import machine_line
from specdecode.engine import CacheOptions

NO_CACHE = CacheOptions(
    response_cache=False, draft_store=False, prefix_cache=False
)  # a timing measures decoding, not caches

FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "max_new_tokens": (("--max-new-tokens",), dict(type=int, metavar="N", help="most new tokens of each generation")),
    "k": (
        ("-k", "--num-speculative-tokens"),
        dict(type=int, dest="k", metavar="N", help="most tokens drafted per step"),
    ),
    "rounds": (("--rounds",), dict(type=int, metavar="N", help="passes of the systems side by side")),
    "repeats": (("--repeats",), dict(type=int, metavar="N", help="timed calls per median")),
    "requests": (("--requests",), dict(type=int, metavar="N", help="requests sent to the server")),
    "concurrency": (("--concurrency",), dict(type=int, metavar="N", help="concurrent clients of the server")),
    "prompts_per_category": (
        ("--prompts-per-category",),
        dict(type=int, metavar="N", help="prompts of each category (of each workload)"),
    ),
    "target": (("--target",), dict(help="the target model")),
    "dtype": (("--dtype",), dict(help="the target's dtype: auto, float32, bfloat16 or float16")),
    "device": (("--device",), dict(help="auto, cpu or cuda")),
    "seed": (("--seed",), dict(type=int, help="seed of the order of systems and of sampling")),
    "threads": (("--threads",), dict(type=int, metavar="N", help="torch threads")),
}


def script_parser(doc: str | None, **defaults) -> argparse.ArgumentParser:
    """A script's parser: its docstring as the description, --out, and the shared flags named in
    defaults (name=default value); the script adds flags of its own after."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        flags, options = FLAGS[name]
        described = f"{options['help']} [default: {default}]"
        parser.add_argument(*flags, **(options | dict(default=default, help=described)))
    parser.add_argument("--out", type=Path, metavar="FILE", help="also write the table to FILE")
    return parser


def write_table(text: str, out: Path | None) -> None:
    """Print the table; with out, also write it there below the command that made it and the machine."""
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"    {command_line()}\n\n{machine_line()}\n\n{text}\n")


def command_line() -> str:
    """The command that runs this script again, as the results files give it."""
    return shlex.join([".venv/bin/python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
