"""`specdecode loadtest`: concurrent OpenAI clients against a server; throughput and latency.

Every concurrency level sends the same requests (streamed, so the time to first token is
seen). Aggregate output tokens/s is compared with level 1 (one request at a time) of the
same run, and each greedy answer with level 1's answer to the same request. Clients can
hang up mid-stream on purpose (`disconnect_rate`): those requests count as disconnected,
and every other request must come back whole or with an error; none may hang.
`serve_process` starts a `specdecode serve` of its own, for this and for the scripts in benchmarks/.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from specdecode.errors import InvalidArgumentError, SpecDecodeError


@dataclass
class Timing:
    text: str | None  # None when the request failed or was abandoned
    tokens: int = 0
    ttft_s: float | None = None  # arrival of the first text
    e2e_s: float = 0.0
    error: str | None = None
    disconnected: bool = False

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first."""
        if self.ttft_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    completed: int
    failed: int
    disconnected: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    speedup_vs_one_at_a_time: float | None = None
    identical_to_one_at_a_time: int | None = None  # greedy answers equal to level 1's answer ...
    compared_to_one_at_a_time: int | None = None  # ... of this many (both completed)
    errors: list[str] | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def one_request(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, temperature: float, hang_up_after: int | None
) -> Timing:
    """One streamed chat completion; hang_up_after: close the stream after that many chunks."""
    start = time.perf_counter()
    timing, pieces = Timing(text=None), []
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
        )
        for i, chunk in enumerate(stream):
            if hang_up_after is not None and i >= hang_up_after:
                stream.close()
                timing.disconnected = True
                break
            if chunk.choices and chunk.choices[0].delta.content:
                timing.ttft_s = timing.ttft_s or time.perf_counter() - start
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                timing.tokens = chunk.usage.completion_tokens
    except openai.APIError as error:
        timing.error = f"{type(error).__name__}: {error}"
    timing.e2e_s = time.perf_counter() - start
    if timing.error is None and not timing.disconnected:
        timing.text = "".join(pieces)
    return timing


def run_level(
    client: openai.OpenAI,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    temperature: float,
    disconnect_rate: float = 0.0,
    seed: int = 0,
) -> tuple[LevelResult, list[Timing]]:
    rng = random.Random(seed)
    hang_ups = [rng.randint(1, 4) if rng.random() < disconnect_rate else None for _ in prompts]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        timings = list(
            pool.map(
                lambda i: one_request(client, model, prompts[i], max_tokens, temperature, hang_ups[i]),
                range(len(prompts)),
            )
        )
    wall = time.perf_counter() - start
    done = [t for t in timings if t.text is not None]
    tokens = sum(t.tokens for t in done)

    def percentiles(values: list[float | None]) -> tuple[float, float]:
        values = [v for v in values if v is not None]
        return tuple(float(np.percentile(values, q)) for q in (50, 99)) if values else (float("nan"),) * 2

    ttft, tpot, e2e = (percentiles([getattr(t, name) for t in done]) for name in ("ttft_s", "tpot_s", "e2e_s"))
    errors = sorted({t.error for t in timings if t.error})
    result = LevelResult(
        concurrency,
        len(prompts),
        len(done),
        sum(t.error is not None for t in timings),
        sum(t.disconnected for t in timings),
        wall,
        tokens,
        tokens / wall,
        *ttft,
        *tpot,
        *e2e,
        errors=errors or None,
    )
    return result, timings


def run_loadtest(
    base_url: str,
    model: str,
    prompts: list[str],
    levels: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    disconnect_rate: float = 0.0,
    timeout_s: float = 600.0,
    api_key: str = "unused",
    on_level: Callable[[LevelResult], None] | None = None,
    warm_up: bool = True,
) -> list[LevelResult]:
    """Each level in turn on the same prompts; ratios and greedy equality against level 1 when it
    is run first. warm_up: the prompts sent once, untimed, at the highest level first, so that no
    level pays for a cold server (first allocations, drafters' policies measured from nothing)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
    if warm_up:
        run_level(client, model, prompts, max(levels), max_tokens, temperature)
    results, reference = [], None
    for level in levels:
        result, timings = run_level(client, model, prompts, level, max_tokens, temperature, disconnect_rate, seed=level)
        if level == 1 and reference is None:
            reference = (result, timings)
        elif reference is not None:
            result.speedup_vs_one_at_a_time = result.tokens_per_s / reference[0].tokens_per_s
            if temperature == 0:
                pairs = [
                    (a.text, b.text) for a, b in zip(reference[1], timings) if a.text is not None and b.text is not None
                ]
                result.identical_to_one_at_a_time = sum(a == b for a, b in pairs)
                result.compared_to_one_at_a_time = len(pairs)
        results.append(result)
        if on_level is not None:
            on_level(result)
    return results


@contextmanager
def started_server(
    url: str | None,
    target: str,
    max_batch_size: int,
    inject_faults: str | None,
    console: Console,
    dtype: str = "auto",
    api_key: str | None = None,
) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of the server at url, or of a `specdecode serve` started here
    (in its own process, so that clients and engine do not share an interpreter) and stopped after."""
    if url is not None:
        api_base = url.rstrip("/").removesuffix("/v1") + "/v1"
        yield api_base, _served_model(api_base, api_key)
        return
    # every level sends the same requests: a response cache would answer the later levels from
    # memory, a draft store would draft them from the earlier answers and the slots' kept
    # prefixes would spare their prefills, so none runs here
    args = ["--target", target, "--max-batch-size", str(max_batch_size), "--dtype", dtype]
    args += ["--no-response-cache", "--no-draft-store", "--no-prefix-cache"]
    args += ["--inject-faults", inject_faults] if inject_faults else []
    with serve_process(
        args, on_start=lambda log: console.status(f"Starting `specdecode serve --target {target}` (log: {log})")
    ) as base_url:
        yield base_url, target


@contextmanager
def serve_process(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    ready_line: str | None = None,
    stop_signal: int = signal.SIGTERM,
    timeout_s: float = 900.0,
    log_path: str | None = None,
    on_start: Callable[[str], contextlib.AbstractContextManager] = lambda log: contextlib.nullcontext(),
) -> Iterator[str]:
    """`specdecode serve ARGS` on a free port, in a process of its own; yields its base URL (.../v1)
    once it answers /health (or, with ready_line, once its log holds that text: `serve --ray` prints
    it when every replica is up), then stops it with stop_signal (uvicorn and Ray shut down
    gracefully on SIGTERM and SIGINT), killing it if it does not end. Its output goes to log_path
    (default: a new temporary file). on_start(log path): a context around the wait, for a status line."""
    port = _free_port()
    command = [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), *args]
    if log_path is None:
        log = tempfile.NamedTemporaryFile("w+", prefix="specdecode-serve-", suffix=".log", delete=False)  # noqa: SIM115 - the server writes it while it runs
    else:
        log = open(log_path, "w+")  # noqa: SIM115 - as above
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with on_start(log.name):
            _wait_until_ready(f"http://127.0.0.1:{port}", process, log.name, ready_line, timeout_s)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.send_signal(stop_signal)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_ready(
    root: str, process: subprocess.Popen, log_path: str, ready_line: str | None, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            last = (Path(log_path).read_text().strip().splitlines() or ["(no output)"])[-1]
            raise SpecDecodeError(f"the server exited with status {process.returncode}: {last}")
        if _healthy(root) if ready_line is None else ready_line in Path(log_path).read_text():
            return
        time.sleep(0.5)
    raise SpecDecodeError(f"the server did not become ready in {timeout_s:g} s; see {log_path}")


def _healthy(root: str) -> bool:
    try:
        return httpx.get(f"{root}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _served_model(api_base: str, api_key: str | None = None) -> str:
    try:
        response = httpx.get(f"{api_base}/models", headers=_bearer(api_key), timeout=30)
        if response.status_code == 401:
            raise InvalidArgumentError(
                f"the server at {api_base} wants an API key; give it with --api-key (or SPECDECODE_API_KEY)"
                if not api_key
                else f"the server at {api_base} refused the API key given by --api-key (or SPECDECODE_API_KEY)"
            )
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        raise InvalidArgumentError(
            f"no OpenAI-compatible server answered at {api_base}/models ({type(error).__name__}: {error}); "
            "give --url as http://HOST:PORT of a running `specdecode serve`"
        ) from error


def server_metrics(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's counters that tell whether anything was lost: restarts, retries, requests by outcome."""
    text = httpx.get(f"{base_url.removesuffix('/v1')}/metrics", headers=_bearer(api_key), timeout=30).text
    wanted = (
        "num_requests_running",
        "num_requests_waiting",
        "request_success",
        "request_errors",
        "engine_step_retries",
        "engine_worker_restarts",
        "spec_decode_draft_acceptance_rate",
        "response_cache_lookups",
        "draft_store_tokens",
        "prefix_cache_hits",
    )
    values = {}
    for family in text_string_to_metric_families(text):
        if family.name.removeprefix("specdecode:") in wanted:
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                label = ",".join(f"{k}={v}" for k, v in sample.labels.items())
                values[sample.name.removeprefix("specdecode:") + (f"{{{label}}}" if label else "")] = sample.value
    return values


def cache_warning(metrics: dict[str, float]) -> str | None:
    """What a running server's caches did to a load test that sends the same requests at every
    level (server_metrics' counters after it), or None where they did nothing."""
    hits = metrics.get("response_cache_lookups_total{result=hit}", 0.0)
    stored = metrics.get("draft_store_tokens", 0.0)
    prefixes = metrics.get("prefix_cache_hits_total", 0.0)
    done = [f"{hits:.0f} answers came from its response cache"] if hits else []
    done += ["its draft store held earlier answers"] if stored else []
    done += [f"{prefixes:.0f} prompt tokens came from its kept prefixes"] if prefixes else []
    if not done:
        return None
    return (
        f"the server's caches were on ({'; '.join(done)}): every level sends the same requests, so the later "
        "levels measure the caches; start it with --no-response-cache --no-draft-store --no-prefix-cache"
    )


def print_level(result: LevelResult, console: Console | None = None) -> None:
    console = console or Console()
    speedup = f"{result.speedup_vs_one_at_a_time:.2f}x" if result.speedup_vs_one_at_a_time else "1.00x (baseline)"
    same = (
        f" | identical to one-at-a-time {result.identical_to_one_at_a_time}/{result.compared_to_one_at_a_time}"
        if result.compared_to_one_at_a_time is not None
        else ""
    )
    console.print(
        f"concurrency {result.concurrency:>3}: {result.completed}/{result.requests} completed, {result.failed} failed, "
        f"{result.disconnected} hung up | {result.output_tokens} tokens in {result.wall_s:.1f} s = "
        f"{result.tokens_per_s:.1f} tok/s ({speedup}) | TTFT p50 {result.ttft_p50_s * 1e3:.0f} ms, "
        f"p99 {result.ttft_p99_s * 1e3:.0f} ms | TPOT p50 {result.tpot_p50_s * 1e3:.0f} ms, "
        f"p99 {result.tpot_p99_s * 1e3:.0f} ms | e2e p50 {result.e2e_p50_s:.2f} s, p99 {result.e2e_p99_s:.2f} s{same}",
        highlight=False,
    )
    if result.errors:
        console.print(f"  errors: {result.errors}", highlight=False)
