"""What OpenTelemetry tracing costs the server: output tokens/s at 8 concurrent clients with
tracing off and on, in one run, alternating.

Two `specdecode serve` processes of the same model, one plain (tracing off: no OTEL_*
variable set) and one with `--otel-console` (every span printed as JSON, to a file: more
work than OTLP export, which encodes and sends the same spans from the same background
thread). Both with the response cache and the draft store off, so no round answers from
an earlier one. Each round sends the same streamed chat requests (the shipped Spec-Bench
prompts) from 8 `openai` clients to one server, then to the other, alternating which goes
first; medians over the rounds.

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 3] [--requests 16] [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import openai

from specdecode.bench.interleave import interleave, medians
from specdecode.bench.prompts import load_prompts
from specdecode.bench.scripts import script_parser, write_table
from specdecode.loading import DEFAULT_TARGET
from specdecode.server.loadtest import run_level, serve_process

CONFIGS = {"off": [], "on": ["--otel-console"]}  # tracing off: no OTEL_* variable set


def main() -> None:
    parser = script_parser(
        __doc__, target=DEFAULT_TARGET, dtype="auto", rounds=3, requests=16, concurrency=8, max_new_tokens=64
    )
    args = parser.parse_args()
    prompts = [p.text for p in load_prompts()][: args.requests]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # off unless --otel-console
    serve = ["--target", args.target, "--dtype", args.dtype, "--max-batch-size", "8"]
    serve += ["--no-response-cache", "--no-draft-store"]
    logs = Path(tempfile.mkdtemp(prefix="tracing-overhead-"))
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(serve_process([*serve, *extra], env=env, log_path=str(logs / f"{name}.log")))
            for name, extra in CONFIGS.items()
        }
        clients = {
            name: openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
            for name, url in servers.items()
        }
        for client in clients.values():  # warm-up: caches allocated, adaptive k measured
            run_level(client, args.target, prompts[: args.concurrency], args.concurrency, 16, 0.0)

        def level(name: str):
            def run(_) -> float:
                result, _ = run_level(clients[name], args.target, prompts, args.concurrency, args.max_new_tokens, 0.0)
                assert result.completed == len(prompts), result.errors
                print(
                    f"tracing {name:>3}: {result.output_tokens} tokens in {result.wall_s:.1f} s "
                    f"= {result.tokens_per_s:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
                return result.tokens_per_s

            return run

        runs = interleave({name: level(name) for name in CONFIGS}, repeats=args.rounds, order="alternate")
    spans = (logs / "on.log").read_text().count('"span_id"')
    rates = medians(runs, key=lambda run: run.value)
    off, on = rates["off"], rates["on"]
    rounds = [f"round {r.repeat + 1} tracing {r.system:>3}: {r.value:.1f} tok/s" for r in runs]
    summary = (
        f"{args.concurrency} clients, {len(prompts)} requests x {args.max_new_tokens} tokens, {args.rounds} rounds: "
        f"tracing off {off:.1f} tok/s, on (console exporter, {spans} spans printed) {on:.1f} tok/s (medians): "
        f"{(1 - on / off) * 100:+.1f}% loss with tracing on"
    )
    write_table("\n".join([*rounds, summary]), args.out)


if __name__ == "__main__":
    main()
