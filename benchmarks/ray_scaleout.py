"""What Ray Serve replicas give and cost on this machine: output tokens/s at 8 and 16 clients,
and time to first token at 1 client, for the single-process server, `serve --ray --replicas 1`
and `serve --ray --replicas 2` (1 CPU and 1 torch thread per replica), one after the other in
one run, each on the same streamed chat requests (the shipped Spec-Bench prompts, greedy).

The response cache and the draft store are off, so no request is answered from an earlier one.
The last lines project N machines of R replicas from the measured per-replica throughput.

    .venv/bin/python benchmarks/ray_scaleout.py [--requests 16] [--max-new-tokens 48] [--out FILE]
"""

from __future__ import annotations

import os
import signal
import sys

import openai

from specdecode.bench.prompts import load_prompts
from specdecode.bench.scripts import script_parser, write_table
from specdecode.loading import DEFAULT_TARGET
from specdecode.server.loadtest import run_level, serve_process

CONFIGS = {  # name: (serve's arguments, torch threads of the single process)
    "single process, 2 threads": ([], "2"),
    "single process, 1 thread": ([], "1"),  # a replica's share: what the proxy alone adds is the difference
    "ray, 1 replica x 1 CPU": (["--ray", "--replicas", "1", "--replica-cpus", "1"], None),
    "ray, 2 replicas x 1 CPU": (["--ray", "--replicas", "2", "--replica-cpus", "1"], None),
}


def server(extra: list[str], threads: str | None):
    """`specdecode serve`, caches off, until its log says "serving" (once every replica is up)."""
    env = os.environ | ({"OMP_NUM_THREADS": threads} if threads else {})
    args = ["--no-response-cache", "--no-draft-store", *extra]
    return serve_process(args, env=env, ready_line="serving", stop_signal=signal.SIGINT, timeout_s=600)


def measure(url: str, prompts: list[str], max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    run_level(client, DEFAULT_TARGET, prompts[:2], 2, 8, 0.0)  # warm-up: first forwards of each shape
    ttft = run_level(client, DEFAULT_TARGET, prompts[:8], 1, 8, 0.0)[0]
    row = {"ttft_p50_ms": ttft.ttft_p50_s * 1000, "ttft_p99_ms": ttft.ttft_p99_s * 1000}
    for clients in (8, 16):
        level = run_level(client, DEFAULT_TARGET, prompts, clients, max_tokens, 0.0)[0]
        assert level.failed == 0, level.errors
        row[f"tok_s_{clients}"] = level.tokens_per_s
    return row


def main() -> None:
    parser = script_parser(__doc__, requests=16, max_new_tokens=48)
    args = parser.parse_args()
    texts = [p.text for p in load_prompts(None)]
    prompts = [texts[i % len(texts)] for i in range(args.requests)]
    rows = {}
    lines = []
    for name, (extra, threads) in CONFIGS.items():
        with server(extra, threads) as url:
            rows[name] = measure(url, prompts, args.max_new_tokens)
        lines.append(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[name].items()))
        print(lines[-1], file=sys.stderr, flush=True)  # progress; the whole table comes at the end
    _, single, one, two = rows.values()
    per_replica = one["tok_s_16"]
    for q in ("p50", "p99"):
        added = one[f"ttft_{q}_ms"] - single[f"ttft_{q}_ms"]
        lines.append(f"TTFT {q} added by Ray (1 replica vs the single process, 1 thread each): {added:+.1f} ms")
    lines.append(f"2 replicas / 1 replica at 16 clients: {two['tok_s_16'] / one['tok_s_16']:.2f}x")
    lines.append(
        f"projection: N machines x R replicas of 1 CPU ~ N x R x {per_replica:.1f} tok/s (16 clients per replica)"
    )
    for machines, replicas in ((1, 2), (4, 8), (16, 8)):
        lines.append(f"  {machines} machines x {replicas} replicas: ~{machines * replicas * per_replica:.0f} tok/s")
    write_table("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
