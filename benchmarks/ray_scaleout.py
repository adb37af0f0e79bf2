"""What Ray Serve replicas give and cost on this machine: output tokens/s at 8 and 16 clients,
and time to first token at 1 client, for the single-process server, `serve --ray --replicas 1`
and `serve --ray --replicas 2` (1 CPU and 1 torch thread per replica), one after the other in
one run, each on the same streamed chat requests (the shipped Spec-Bench prompts, greedy).

The response cache and the draft store are off, so no request is answered from an earlier one.
The last lines project N machines of R replicas from the measured per-replica throughput.

    .venv/bin/python benchmarks/ray_scaleout.py [--requests 16] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import openai

from specdecode.bench.loadtest import run_level
from specdecode.bench.prompts import load_prompts
from specdecode.loading import DEFAULT_TARGET

CONFIGS = {  # name: (serve's arguments, torch threads of the single process)
    "single process, 2 threads": ([], "2"),
    "single process, 1 thread": ([], "1"),  # a replica's share: what the proxy alone adds is the difference
    "ray, 1 replica x 1 CPU": (["--ray", "--replicas", "1", "--replica-cpus", "1"], None),
    "ray, 2 replicas x 1 CPU": (["--ray", "--replicas", "2", "--replica-cpus", "1"], None),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server(extra: list[str], threads: str | None):
    env = os.environ | ({"OMP_NUM_THREADS": threads} if threads else {})
    port = free_port()
    args = ["serve", "--port", str(port), "--no-response-cache", "--no-draft-store", *extra]
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "serve.log"
        with log.open("w") as out:
            process = subprocess.Popen([sys.executable, "-m", "specdecode.cli", *args], stdout=out, stderr=out, env=env)
        try:
            deadline = time.monotonic() + 600
            while "serving" not in log.read_text():  # printed once every replica is up
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{log.read_text()}")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            process.send_signal(2)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    texts = [p.text for p in load_prompts(None)]
    prompts = [texts[i % len(texts)] for i in range(args.requests)]
    rows = {}
    for name, (extra, threads) in CONFIGS.items():
        with server(extra, threads) as url:
            rows[name] = measure(url, prompts, args.max_tokens)
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[name].items()), flush=True)
    _, single, one, two = rows.values()
    per_replica = one["tok_s_16"]
    for q in ("p50", "p99"):
        added = one[f"ttft_{q}_ms"] - single[f"ttft_{q}_ms"]
        print(f"TTFT {q} added by Ray (1 replica vs the single process, 1 thread each): {added:+.1f} ms")
    print(f"2 replicas / 1 replica at 16 clients: {two['tok_s_16'] / one['tok_s_16']:.2f}x")
    print(f"projection: N machines x R replicas of 1 CPU ~ N x R x {per_replica:.1f} tok/s (16 clients per replica)")
    for machines, replicas in ((1, 2), (4, 8), (16, 8)):
        print(f"  {machines} machines x {replicas} replicas: ~{machines * replicas * per_replica:.0f} tok/s")


if __name__ == "__main__":
    main()
