"""What OpenTelemetry tracing costs the server: output tokens/s at 8 concurrent clients with
tracing off and on, in one run, alternating.

Two `specdecode serve` processes of the same model, one plain (tracing off: no OTEL_*
variable set) and one with `--otel-console` (every span printed as JSON, to a file: more
work than OTLP export, which encodes and sends the same spans from the same background
thread). Both with the response cache and the draft store off, so no round answers from
an earlier one. Each round sends the same streamed chat requests (the shipped Spec-Bench
prompts) from 8 `openai` clients to one server, then to the other, alternating which goes
first; medians over the rounds.

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 3] [--requests 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager

import httpx
import openai

from specdecode.bench.loadtest import run_level
from specdecode.bench.prompts import load_prompts


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server(target: str, dtype: str, extra: list[str], log_path: str):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # off unless --otel-console
    command = [sys.executable, "-m", "specdecode.cli", "serve", "--target", target, "--port", str(port)]
    command += ["--dtype", dtype, "--max-batch-size", "8", "--no-response-cache", "--no-draft-store", *extra]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 900
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited; see {log_path}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            process.terminate()
            process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    prompts = [p.text for p in load_prompts()][: args.requests]
    logs = tempfile.mkdtemp(prefix="tracing-overhead-")
    configs = {"off": [], "on": ["--otel-console"]}
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(server(args.target, args.dtype, extra, f"{logs}/{name}.log"))
            for name, extra in configs.items()
        }
        clients = {
            name: openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
            for name, url in urls.items()
        }
        for client in clients.values():  # warm-up: caches allocated, adaptive k measured
            run_level(client, args.target, prompts[: args.concurrency], args.concurrency, 16, 0.0)
        rates: dict[str, list[float]] = {name: [] for name in configs}
        for round_ in range(args.rounds):
            order = ["off", "on"] if round_ % 2 == 0 else ["on", "off"]
            for name in order:
                result, _ = run_level(clients[name], args.target, prompts, args.concurrency, args.max_tokens, 0.0)
                assert result.completed == len(prompts), result.errors
                rates[name].append(result.tokens_per_s)
                print(
                    f"round {round_ + 1} tracing {name:>3}: {result.output_tokens} tokens in {result.wall_s:.1f} s "
                    f"= {result.tokens_per_s:.1f} tok/s",
                    flush=True,
                )
    with open(f"{logs}/on.log") as log:
        spans = log.read().count('"span_id"')
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(
        f"{args.concurrency} clients, {len(prompts)} requests x {args.max_tokens} tokens, {args.rounds} rounds: "
        f"tracing off {off:.1f} tok/s, on (console exporter, {spans} spans printed) {on:.1f} tok/s (medians): "
        f"{(1 - on / off) * 100:+.1f}% loss with tracing on"
    )


if __name__ == "__main__":
    main()
