"""`specdecode serve` (the OpenAI-compatible server: server/, on Ray with --ray) and
`specdecode loadtest` (a server's throughput and latency under load: server/loadtest.py)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from specdecode import precision
from specdecode.cli.console import loading, stderr
from specdecode.cli.errors import user_errors
from specdecode.cli.options import (
    SERVER,
    AdaptiveOption,
    CacheMaxMbOption,
    CacheSecretFileOption,
    CacheUrlOption,
    DeviceOption,
    DrafterOption,
    DraftOption,
    DraftStoreOption,
    DtypeOption,
    KOption,
    MaxModelLenOption,
    PrefixCacheOption,
    QuantizationOption,
    RayAddressOption,
    RayOption,
    ReplicaCpusOption,
    ReplicasOption,
    ResponseCacheOption,
    ShippedHeadOption,
    TargetOption,
    cache_options,
    server_config,
)
from specdecode.errors import InvalidArgumentError
from specdecode.loading import DEFAULT_TARGET
from specdecode.server.config import ServerConfig


def serve(
    target: TargetOption = SERVER.target,
    draft: DraftOption = SERVER.draft,
    drafter: DrafterOption = SERVER.drafter,
    k: KOption = SERVER.num_speculative_tokens,
    adaptive: AdaptiveOption = SERVER.adaptive,
    shipped_head: ShippedHeadOption = SERVER.shipped_head,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = SERVER.host,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = SERVER.port,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            envvar="SPECDECODE_API_KEY",
            help="Require 'Authorization: Bearer KEY' on every route but /health (/docs and /redoc are off).",
        ),
    ] = SERVER.api_key,
    metrics_without_key: Annotated[
        bool, typer.Option("--metrics-without-key", help="With --api-key: serve /metrics without the key too.")
    ] = SERVER.metrics_without_key,
    max_waiting: Annotated[
        int, typer.Option(help="Queued requests beyond the running batch before 429.")
    ] = SERVER.max_waiting,
    max_batch_size: Annotated[
        int, typer.Option(help="Requests decoded together (continuous batching).")
    ] = SERVER.max_batch_size,
    max_model_len: MaxModelLenOption = SERVER.max_model_len,
    kv_cache_gb: Annotated[
        Optional[float],
        typer.Option(
            help="KV-cache budget in GiB: max-batch-size x max-model-len tokens of cache must fit, else the "
            "batch size is lowered to what fits (and logged); the server does not start if one sequence "
            "does not fit \\[default: no budget]."
        ),
    ] = SERVER.kv_cache_gb,
    max_request_seconds: Annotated[
        float, typer.Option(help="A request running longer fails with 504.")
    ] = SERVER.max_request_seconds,
    max_connections: Annotated[
        int, typer.Option(help="Open connections at once; one more is answered 503 and closed.")
    ] = SERVER.max_connections,
    max_header_bytes: Annotated[
        int, typer.Option(help="Bytes of a request's headers; more is answered 400.")
    ] = SERVER.max_header_bytes,
    read_timeout: Annotated[
        float, typer.Option(help="Seconds a request may take to arrive whole before its connection is closed.")
    ] = SERVER.read_timeout_s,
    device: DeviceOption = SERVER.device,
    dtype: DtypeOption = SERVER.dtype,
    quantization: QuantizationOption = SERVER.quantization,
    inject_faults: Annotated[
        Optional[str],
        typer.Option(hidden=True, help="Testing: 'TRANSIENT,CRASH[,DELAY_S]' step failure probabilities, step delay."),
    ] = None,
    cache_url: CacheUrlOption = SERVER.cache.url,
    response_cache: ResponseCacheOption = SERVER.cache.response_cache,
    draft_store: DraftStoreOption = SERVER.cache.draft_store,
    prefix_cache: PrefixCacheOption = SERVER.cache.prefix_cache,
    cache_max_mb: CacheMaxMbOption = SERVER.cache.max_mb,
    cache_secret_file: CacheSecretFileOption = None,
    otel_console: Annotated[
        bool,
        typer.Option(
            "--otel-console",
            help="Print OpenTelemetry spans to the console (OTLP export: set OTEL_EXPORTER_OTLP_ENDPOINT).",
        ),
    ] = SERVER.otel_console,
    ray: RayOption = False,
    ray_address: RayAddressOption = None,
    replicas: ReplicasOption = 1,
    replica_cpus: ReplicaCpusOption = 1.0,
    min_replicas: Annotated[
        Optional[int], typer.Option(help="With --ray: autoscale, down to this many replicas.")
    ] = None,
    max_replicas: Annotated[
        Optional[int], typer.Option(help="With --ray: autoscale, up to this many replicas.")
    ] = None,
    target_ongoing_requests: Annotated[
        Optional[float], typer.Option(help="With --ray and autoscaling: requests per replica the autoscaler aims for.")
    ] = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from specdecode.server import run_server
    from specdecode.server.app import app_from_config

    with user_errors():
        # a Redis that does not answer yet is not fatal here: the server starts on its own cache
        cache = cache_options(
            cache_url, response_cache, draft_store, cache_max_mb, cache_secret_file, prefix_cache=prefix_cache
        )
        config = server_config(
            target,
            draft,
            drafter,
            k,
            adaptive,
            device,
            dtype,
            max_model_len=max_model_len,
            quantization=quantization,
            cache=cache,
            shipped_head=shipped_head,
            host=host,
            port=port,
            api_key=api_key,
            metrics_without_key=metrics_without_key,
            max_waiting=max_waiting,
            max_batch_size=max_batch_size,
            max_request_seconds=max_request_seconds,
            max_connections=max_connections,
            max_header_bytes=max_header_bytes,
            read_timeout_s=read_timeout,
            kv_cache_gb=kv_cache_gb,
            otel_console=otel_console,
        )
        if ray or ray_address:
            if inject_faults:
                raise InvalidArgumentError("--inject-faults is for the single-process server; drop it or --ray")
            scaling = _scaling(replicas, replica_cpus, min_replicas, max_replicas, target_ongoing_requests)
            _serve_on_ray(config, scaling, ray_address)
            return
        faults = _fault_injector(inject_faults) if inject_faults else None
        with loading(target, draft):
            engine = config.engine()
            if cache_url is not None and not engine.cache_backend.ping():  # not fatal: it may come up later
                from specdecode.cache.backends import mask_password

                masked = mask_password(cache_url)
                stderr.print(f"warning: no Redis answers at {masked}; caching in this process until one does")
        server_app = app_from_config(config, engine, start_worker=False, faults=faults)
    sizes = f"max_model_len {engine.max_model_len}, up to {server_app.state.worker.decoder.capacity} requests at once"
    stderr.print(f"serving {target} on http://{host}:{port}/v1 ({sizes}; {config.key_note})", soft_wrap=True)
    stderr.print(f"target precision: {engine.precision}", soft_wrap=True)
    stderr.print(f"kept prefixes: {_prefix_note(engine, prefix_cache)}", soft_wrap=True)
    with user_errors():
        run_server(server_app, config.host, config.port)


def _prefix_note(engine, asked: bool) -> str:
    """Whether a freed slot keeps its KV cache for a prompt that starts the same (docs/caching.md)."""
    if engine.decoder.slots.reuses_prefixes:
        return "on (a prompt that starts as an earlier one prefills only the rest; --no-prefix-cache: off)"
    if not asked:
        return "off (--no-prefix-cache)"
    return "off (this runner's prefill rounds a row by the rows beside it; the w8a8 C layers reuse prefixes)"


def _scaling(replicas: int, replica_cpus: float, min_replicas, max_replicas, target_ongoing_requests):
    from specdecode.server.ray_cluster import check_replicas, require_ray

    check_replicas(replicas, replica_cpus)
    if min_replicas is not None and min_replicas < 0:
        raise InvalidArgumentError(f"--min-replicas must be at least 0, got {min_replicas}")
    if max_replicas is not None and max_replicas < 1:
        raise InvalidArgumentError(f"--max-replicas must be at least 1, got {max_replicas}")
    low, high = min_replicas if min_replicas is not None else 1, max_replicas if max_replicas is not None else replicas
    if (min_replicas is not None or max_replicas is not None) and not low <= replicas <= high:
        raise InvalidArgumentError(
            f"autoscaling starts from --replicas {replicas}, which must lie between --min-replicas {low} and "
            f"--max-replicas {high}"
        )
    if target_ongoing_requests is not None and not target_ongoing_requests > 0:
        raise InvalidArgumentError(f"--target-ongoing-requests must be positive, got {target_ongoing_requests}")
    require_ray()
    from specdecode.server.ray_serve import Scaling

    return Scaling(replicas, replica_cpus, min_replicas, max_replicas, target_ongoing_requests)


def _serve_on_ray(config: ServerConfig, scaling, address: str | None) -> None:
    from specdecode.server import ray_cluster, ray_serve

    ray_cluster.connect(address)
    ray_cluster.check_fits(scaling.most_replicas, scaling.replica_cpus)
    status = stderr.status(f"Starting {scaling.replicas} replicas of {config.target} on Ray")
    status.start()

    def ready() -> None:
        status.stop()
        url = f"http://{config.host}:{config.port}/v1"
        stderr.print(
            f"serving {config.target} on {url} with {scaling.replicas} Ray replicas ({config.key_note})", soft_wrap=True
        )

    try:
        ray_serve.serve_until_signalled(config, scaling, ready)
    finally:
        status.stop()


def _fault_injector(option: str):
    from specdecode.server.faults import RandomFaults

    try:
        values = [float(x) for x in option.split(",")]
        transient, crash, delay = (values + [0.0])[:3] if len(values) in (2, 3) else [float("")] * 3
    except ValueError:
        message = f"--inject-faults takes 'TRANSIENT,CRASH[,DELAY_S]' (probabilities, seconds per step), got '{option}'"
        raise InvalidArgumentError(message) from None
    return RandomFaults(transient, crash, delay=delay)


def loadtest(
    url: Annotated[
        Optional[str],
        typer.Option(help="A running server's URL (http://HOST:PORT, with or without /v1); default: start one."),
    ] = None,
    target: Annotated[str, typer.Option(help="Model of the server started here (without --url).")] = DEFAULT_TARGET,
    concurrency: Annotated[str, typer.Option(help="Concurrent clients per level, comma-separated.")] = "1,4,8,16",
    requests: Annotated[int, typer.Option(help="Requests per level (the same ones at every level).")] = 32,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of each request.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy (answers compared with level 1's).")] = 0.0,
    disconnect_rate: Annotated[float, typer.Option(help="Share of clients that hang up mid-stream.")] = 0.0,
    inject_faults: Annotated[
        Optional[str], typer.Option(help="Server started here: 'TRANSIENT,CRASH' probabilities of failing a step.")
    ] = None,
    max_batch_size: Annotated[int, typer.Option(help="Server started here: requests decoded together.")] = 16,
    dtype: Annotated[str, typer.Option(help="Server started here: auto, float32, bfloat16 or float16.")] = "auto",
    prompts: Annotated[
        Optional[str], typer.Option(help="JSONL prompts [default: the shipped Spec-Bench subset].")
    ] = None,
    output: Annotated[Optional[str], typer.Option(help="Write the results as JSON to this file.")] = None,
    api_key: Annotated[
        Optional[str],
        typer.Option(envvar="SPECDECODE_API_KEY", help="With --url: the server's API key (sent on /v1 and /metrics)."),
    ] = None,
    warm_up: Annotated[
        bool, typer.Option(help="Send the requests once, untimed, before the levels (no level meets a cold server).")
    ] = True,
) -> None:
    """Throughput and latency percentiles of an OpenAI-compatible server at several concurrency levels."""
    from specdecode.bench.prompts import load_prompts
    from specdecode.server.loadtest import cache_warning, print_level, run_loadtest, server_metrics, started_server

    with user_errors():
        levels = _positive_ints(concurrency, "--concurrency")
        if requests < 1 or max_tokens < 1:
            raise InvalidArgumentError("--requests and --max-tokens must be at least 1")
        if not 0.0 <= disconnect_rate <= 1.0:
            raise InvalidArgumentError(f"--disconnect-rate must be in [0, 1], got {disconnect_rate}")
        if url and (inject_faults or dtype != "auto"):
            raise InvalidArgumentError("--inject-faults and --dtype apply to the server started here; drop --url")
        if api_key and not url:
            raise InvalidArgumentError("--api-key is for a running server's --url; the server started here has none")
        precision.dtype_named(dtype)  # raises for an unknown name, before the server starts
        texts = [p.text for p in load_prompts(prompts)]
        texts = [texts[i % len(texts)] for i in range(requests)]
        with started_server(url, target, max_batch_size, inject_faults, stderr, dtype, api_key) as (base_url, model):
            if warm_up:
                stderr.print(f"warming up: the {len(texts)} requests once, untimed, {max(levels)} at a time")
            results = run_loadtest(
                base_url,
                model,
                texts,
                levels,
                max_tokens,
                temperature,
                disconnect_rate,
                api_key=api_key or "unused",
                on_level=print_level,
                warm_up=warm_up,
            )
            metrics = server_metrics(base_url, api_key)
    summary = {"levels": [r.as_dict() for r in results], "server_metrics": metrics}
    stderr.print(f"server counters after the run: {metrics}")
    if (warning := cache_warning(metrics)) is not None:
        stderr.print(f"warning: {warning}", highlight=False)
    if output:
        with open(output, "w") as f:
            json.dump(summary, f, indent=2)


def _positive_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"{name} takes comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise InvalidArgumentError(f"{name} values must be at least 1, got '{text}'")
    return values
