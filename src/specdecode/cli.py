"""The `specdecode` command line."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Optional

import typer
from rich.console import Console

from specdecode import precision
from specdecode.cache.engine_caches import CacheOptions
from specdecode.core.checks import (
    DEFAULT_SPECULATIVE_TOKENS,
    check_prompt_text,
    check_request,
)
from specdecode.drafters.factory import DrafterOptions
from specdecode.errors import InvalidArgumentError, SpecDecodeError
from specdecode.loading import DEFAULT_TARGET
from specdecode.server.config import ServerConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Exact speculative decoding for Hugging Face causal language models.",
)
stderr = Console(stderr=True)
SERVER = ServerConfig()  # `serve`'s defaults
CACHE = CacheOptions()  # the caches' defaults

# options that several commands share
TargetOption = Annotated[str, typer.Option(help="Target model: short name, folder, .gguf file or Hub id.")]
DraftOption = Annotated[
    Optional[str], typer.Option(help="Draft model (its own tokenizer: cross-tokenizer), or a draft head's folder.")
]
DrafterOption = Annotated[
    str,
    typer.Option(
        help="auto, model, prompt-lookup, recycling (the target's own past predictions), suffix, self-quantized, "
        "cross-tokenizer, head (a draft head from train-draft: --draft DIR) or none."
    ),
]
KOption = Annotated[
    int, typer.Option("-k", "--num-speculative-tokens", help="k: the most tokens drafted per step (0: target-only).")
]
AdaptiveOption = Annotated[
    bool, typer.Option("--adaptive/--fixed-k", help="Choose k per step from measured acceptance and costs.")
]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
DtypeOption = Annotated[
    str,
    typer.Option(
        help="auto (bfloat16 where the CPU multiplies it natively and a fast path makes it exact, "
        "else float32), float32, bfloat16 or float16."
    ),
]
MaxModelLenOption = Annotated[
    Optional[int],
    typer.Option(help="Most tokens, prompt and generated, a sequence may hold \\[default: the model's context]."),
]
DTYPES = ("auto", "float32", "bfloat16", "float16")
CompileOption = Annotated[
    bool,
    typer.Option(
        help="Run the target compiled by torch.compile (Llama-family fast runner; each forward size "
        "compiles on first use, which is slow)."
    ),
]
QuantizationOption = Annotated[
    Optional[str],
    typer.Option(
        help="Quantize the target: nf4, fp4, llm-int8 (older: int8; bitsandbytes, transformers runner) or w8a8 "
        "(int8 weights and activations, Llama-family fast runner) \\[default: none]."
    ),
]
CacheUrlOption = Annotated[
    Optional[str],
    typer.Option(
        help="redis://HOST:PORT/DB (or rediss://): share the caches with other processes \\[default: this one]."
    ),
]
ResponseCacheOption = Annotated[
    bool, typer.Option(help="Answer repeated deterministic requests from the cache (where exact).")
]
DraftStoreOption = Annotated[bool, typer.Option(help="Earlier requests' text drafts (drafters suffix and auto).")]
CacheMaxMbOption = Annotated[int, typer.Option(help="Memory of the in-process cache, in MB.")]
CacheSecretFileOption = Annotated[
    Optional[str],
    typer.Option(
        help="A file holding the key that signs the shared caches' entries, so that only its holders can "
        "write what is served \\[default: $SPECDECODE_CACHE_SECRET; neither: the Redis must be trusted]."
    ),
]
RayOption = Annotated[
    bool, typer.Option("--ray", help="Run on Ray: replicas of the engine (pip install specdecode[ray]).")
]
RayAddressOption = Annotated[
    Optional[str],
    typer.Option(
        help="A Ray cluster to join (HOST:PORT, or auto for one on this node); implies --ray \\[default: start one here]."
    ),
]
ReplicasOption = Annotated[int, typer.Option(help="With --ray: engine replicas, each with its own model.")]
ReplicaCpusOption = Annotated[float, typer.Option(help="With --ray: CPUs per replica (and its torch threads).")]


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input ends the command with one line on stderr and exit status 2, never a traceback."""
    try:
        yield
    except SpecDecodeError as error:
        stderr.print(f"[bold red]error:[/] {_as_flags(error)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _as_flags(error: SpecDecodeError) -> str:
    """The message of a rule on an argument ("max_new_tokens must ...") with the argument spelled
    as an option (--max-new-tokens): the checks word each rule once, in Python's names
    (core/checks.py), and each interface names the argument as its users write it (the
    server: server/errors.py, API_NAMES)."""
    message, param = str(error), error.param
    if param and re.match(rf"{re.escape(param)}( \(\w+\))? must ", message):  # "top_p must ...", "num_... (k) must ..."
        return "--" + param.replace("_", "-") + message[len(param) :]
    return message


def _cache_secret(path: str | None) -> str | None:
    """The key in --cache-secret-file (its first line), read here so that it is never on a command
    line; else $SPECDECODE_CACHE_SECRET's, resolved here so that Ray replicas get it with the config."""
    if path is None:
        import os

        return os.environ.get("SPECDECODE_CACHE_SECRET") or None
    try:
        with open(path, encoding="utf-8") as file:
            secret = file.readline().strip()
    except OSError as error:
        raise InvalidArgumentError(f"--cache-secret-file {path}: cannot read it ({error.strerror})") from None
    if not secret:
        raise InvalidArgumentError(f"--cache-secret-file {path} is empty; write the key on its first line")
    return secret


@app.callback()
def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The text to continue (or the user message, with --chat).")],
    target: TargetOption = DEFAULT_TARGET,
    draft: DraftOption = None,
    drafter: DrafterOption = "auto",
    k: KOption = DEFAULT_SPECULATIVE_TOKENS,
    adaptive: AdaptiveOption = True,
    ngram: Annotated[tuple[int, int], typer.Option(help="Prompt lookup: shortest and longest n-gram.")] = (1, 3),
    max_continuation: Annotated[Optional[int], typer.Option(help="Prompt lookup: most tokens copied per step.")] = None,
    lookup_history: Annotated[bool, typer.Option(help="Prompt lookup also searches earlier requests.")] = False,
    quantization: QuantizationOption = None,
    compile: CompileOption = False,
    draft_quantization: Annotated[
        Optional[str],
        typer.Option(help="self-quantized drafter only: bfloat16, int8, nf4 or fp4 \\[default: bfloat16]."),
    ] = None,
    min_confidence: Annotated[
        float, typer.Option(help="Model drafters stop after a token they give less probability.")
    ] = 0.0,
    recycling_width: Annotated[
        int, typer.Option(help="recycling drafter: the target's candidates kept per token (the table's width).")
    ] = DrafterOptions().recycling_width,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    max_model_len: MaxModelLenOption = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[Optional[int], typer.Option(help="Sample from the k most likely tokens.")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Sample from the smallest set with this mass.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop at this string (repeatable).")] = None,
    chat: Annotated[
        Optional[bool],
        typer.Option("--chat/--no-chat", help="Apply the chat template \\[default: on if the model has one]."),
    ] = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    trust_remote_code: Annotated[bool, typer.Option(help="Run model code from the Hub (off by default).")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    compare: Annotated[
        bool, typer.Option(help="Also run target-only decoding and print the speedup (caches off: it times decoding).")
    ] = False,
    cache_url: CacheUrlOption = CACHE.url,
    response_cache: ResponseCacheOption = CACHE.response_cache,
    draft_store: DraftStoreOption = CACHE.draft_store,
    cache_max_mb: CacheMaxMbOption = CACHE.max_mb,
    cache_secret_file: CacheSecretFileOption = None,
) -> None:
    """Generate text with speculative decoding and print it with its stats."""
    from specdecode.engine import SpeculativeEngine

    with user_errors():
        # what needs no model, before the load (from_pretrained checks k and max_model_len first too)
        check_prompt_text(prompt)
        check_request(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop
        )
        with stderr.status(f"Loading {target}" + (f" and {draft}" if draft else "")):
            drafter_options = DrafterOptions(
                adaptive,
                *ngram,
                max_continuation,
                lookup_history,
                draft_quantization,
                min_confidence,
                recycling_width=recycling_width,
            )
            engine = SpeculativeEngine.from_pretrained(
                target,
                draft=draft,
                drafter=drafter,
                num_speculative_tokens=k,
                device=device,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                options=drafter_options,
                max_model_len=max_model_len,
                # --compare decodes one prompt again and again: caches would time themselves
                cache=CacheOptions(
                    cache_url,
                    response_cache and not compare,
                    draft_store and not compare,
                    cache_max_mb,
                    require_backend=True,
                    secret=_cache_secret(cache_secret_file),
                ),
                quantization=quantization,
                compile=compile,
            )
        use_chat = chat if chat is not None else bool(getattr(engine.tokenizer, "chat_template", None))
        options = dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop, chat=use_chat
        )
        if not compare:
            result = engine.generate(prompt, seed=seed, **options)[0]
        else:
            engine.generate(prompt, **(options | dict(max_new_tokens=2)))  # warm-up, so neither run pays it
            # alternate the two, so a noisy neighbour on the machine slows both alike; keep the medians
            runs = [
                engine.generate(prompt, seed=seed, speculative=speculative, **options)[0]
                for _ in range(COMPARE_ROUNDS)
                for speculative in (False, True)
            ]
            baseline, result = _median_run(runs[0::2]), _median_run(runs[1::2])

    output = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason}
    output["stats"] = result.stats.to_dict()
    lines = [result.text, f"[{result.stats.summary()}]"]
    if compare:
        output["compare"] = _comparison(result, baseline, greedy=temperature == 0)
        lines.append(_comparison_line(output["compare"]))
    if json_output:
        print(json.dumps(output))
    else:
        print("\n".join(lines))


@app.command()
def bench(
    workload: Annotated[
        str,
        typer.Option(
            help="specbench: drafters against transformers on Spec-Bench prompts; repeat: the caches on "
            "exact repeats, near-repeats, multi-turn revisions and unique prompts."
        ),
    ] = "specbench",
    quick: Annotated[
        bool, typer.Option(help="One prompt per Spec-Bench task, 32 tokens, k = 2 and 4: a few minutes.")
    ] = False,
    output_dir: Annotated[
        Optional[str], typer.Option(help="Folder for results.json, report.md and the plots \\[default: bench-results].")
    ] = None,
    target: Annotated[Optional[str], typer.Option(help=f"Target model \\[default: {DEFAULT_TARGET}].")] = None,
    draft: Annotated[
        Optional[list[str]],
        typer.Option(help="Draft model for the model drafter and HF assisted generation (repeatable)."),
    ] = None,
    drafter: Annotated[
        Optional[list[str]],
        typer.Option(
            help="prompt-lookup and/or model (repeatable) \\[default: prompt-lookup, and model with --draft]."
        ),
    ] = None,
    system: Annotated[
        Optional[list[str]],
        typer.Option(
            "--system",
            "--systems",
            help="Also run llama.cpp (plain decoding, flash attention on) and/or llama.cpp+lookup (its "
            "prompt-lookup drafter, 2 tokens a step) on the target's .gguf, in a process of their own; "
            "repeatable or comma-separated; greedy only (pip install 'specdecode\\[llamacpp]') \\[default: none].",
        ),
    ] = None,
    k: Annotated[
        Optional[list[str]],
        typer.Option("-k", help="Tokens drafted per step, repeatable or comma-separated \\[default: 2,4,6]."),
    ] = None,
    prompts: Annotated[
        Optional[str],
        typer.Option(help="JSONL prompts: Spec-Bench's question.jsonl or your own \\[default: the shipped subset]."),
    ] = None,
    category: Annotated[
        Optional[list[str]],
        typer.Option(help="Only these categories (repeatable or comma-separated; mt-bench = its eight)."),
    ] = None,
    prompts_per_category: Annotated[
        Optional[int], typer.Option(help="First N prompts of each category; 0 = all \\[default: 0].")
    ] = None,
    max_new_tokens: Annotated[
        Optional[int], typer.Option(help="Most tokens to generate per prompt \\[default: 128].")
    ] = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy \\[default: 0].")] = None,
    runs: Annotated[Optional[int], typer.Option(help="Passes over the prompts \\[default: 1].")] = None,
    seed: Annotated[
        Optional[int], typer.Option(help="Seed of the system order and of sampling \\[default: 0].")
    ] = None,
    chat: Annotated[
        Optional[bool],
        typer.Option("--chat/--no-chat", help="Apply the chat template \\[default: on if the model has one]."),
    ] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda \\[default: auto].")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16 \\[default: auto].")] = None,
) -> None:
    """Benchmark against transformers on Spec-Bench prompts; write results.json, report.md and plots."""
    from specdecode.bench import BenchConfig, overall_table, run_benchmark, write_outputs

    if workload == "repeat":
        options = dict(
            draft=draft, drafter=drafter, system=system, k=k, prompts=prompts, category=category, runs=runs, quick=quick
        )
        _bench_repeat(target, device, dtype, prompts_per_category, max_new_tokens, seed, output_dir, options)
        return
    with user_errors():
        if workload != "specbench":
            raise InvalidArgumentError(f"unknown --workload '{workload}'; use specbench or repeat")
        config = BenchConfig.create(
            quick,
            target=target,
            drafts=draft,
            drafters=drafter,
            systems=system,
            k_values=k,
            prompts=prompts,
            categories=category,
            prompts_per_category=prompts_per_category,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            runs=runs,
            seed=seed,
            chat=chat,
            device=device,
            dtype=dtype,
            output_dir=output_dir,
        )
        result = run_benchmark(config, stderr)
        files = write_outputs(result, config.output_dir)
    print(overall_table(result.rows, config.greedy))
    print("wrote " + ", ".join(str(f) for f in files))


def _bench_repeat(target, device, dtype, prompts_per_category, max_new_tokens, seed, output_dir, options) -> None:
    """`bench --workload repeat` (bench/repeat.py): its own systems and prompts, bfloat16 by
    default (where the response cache is exact on the CPU)."""
    from pathlib import Path

    from specdecode.bench.progress import bench_progress
    from specdecode.bench.repeat import request_count, run_repeat_workload
    from specdecode.engine import SpeculativeEngine

    with user_errors():
        given = [f"--{name.replace('_', '-')}" for name, value in options.items() if value]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} do not apply to --workload repeat; leave them out")
        prompts = prompts_per_category or 4
        if prompts < 1 or (max_new_tokens is not None and max_new_tokens < 1):
            raise InvalidArgumentError("--prompts-per-category and --max-new-tokens must be at least 1")
        with stderr.status(f"Loading {target or DEFAULT_TARGET}"):
            engine = SpeculativeEngine.from_pretrained(
                target or DEFAULT_TARGET,
                drafter="none",
                device=device or "auto",
                dtype=dtype or "bfloat16",
                cache=CacheOptions(draft_store=False),
            )
        with bench_progress(stderr) as progress:
            task = progress.add_task("requests", total=request_count(prompts))
            table = run_repeat_workload(
                engine, prompts, max_new_tokens or 64, seed or 0, lambda: progress.advance(task)
            )
    print(table)
    out = Path(output_dir or "bench-results") / "repeat.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    print(f"wrote {out}")


COMPARE_ROUNDS = 3


def _median_run(results: list):
    return sorted(results, key=lambda r: r.stats.tokens_per_second)[len(results) // 2]


def _comparison(result, baseline, greedy: bool) -> dict:
    return {
        "target_only_tokens_per_second": baseline.stats.tokens_per_second,
        "speculative_tokens_per_second": result.stats.tokens_per_second,
        "speedup": result.stats.tokens_per_second / baseline.stats.tokens_per_second,
        "identical_output": result.token_ids == baseline.token_ids if greedy else None,
    }


def _comparison_line(comparison: dict) -> str:
    identical = {True: "outputs identical", False: "OUTPUTS DIFFER", None: "sampled, outputs not compared"}
    return (
        f"[target-only {comparison['target_only_tokens_per_second']:.1f} tok/s | "
        f"speculative {comparison['speculative_tokens_per_second']:.1f} tok/s | "
        f"speedup {comparison['speedup']:.2f}x | {identical[comparison['identical_output']]}]"
    )


@app.command()
def profile(
    target: Annotated[
        str, typer.Option(help="Model to profile: short name, folder, .gguf file or Hub id.")
    ] = DEFAULT_TARGET,
    draft: Annotated[Optional[str], typer.Option(help="Also profile this draft model.")] = None,
    runner: Annotated[
        str, typer.Option(help="auto, fast, transformers, or both (fast and transformers side by side).")
    ] = "both",
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    quantize: Annotated[
        Optional[str],
        typer.Option(help="int8-weight-only (older: int8) or w8a8: the fast runner's products in 8 bits."),
    ] = None,
    compile: Annotated[
        bool,
        typer.Option(help="Also time the fast runner compiled by torch.compile, 1 and 5 tokens (slow: each compiles)."),
    ] = False,
    prefix: Annotated[int, typer.Option(help="Cached tokens before the timed forward.")] = 200,
    repeats: Annotated[int, typer.Option(help="Timed forwards per size (the median is shown).")] = 7,
) -> None:
    """Time cached forwards over 1-32 new tokens beside the memory-bandwidth and compute floors."""
    from specdecode.loading import load_model
    from specdecode.runners import runner_for
    from specdecode.runners.profiling import measure_hardware, profile_forward, render_table
    from specdecode.runners.select import chosen_dtype

    console = Console()
    with user_errors():
        if prefix < 1 or repeats < 1:
            raise InvalidArgumentError("--prefix and --repeats must be at least 1")
        quantize = precision.quantization_named(quantize, precision.PROFILE).name if quantize else None
        if compile and runner == "transformers":
            raise InvalidArgumentError("--compile times the fast runner compiled; use --runner both or fast")
        runners = ["fast", "transformers"] if runner == "both" else [runner]
        for name in [target] + ([draft] if draft else []):
            with stderr.status(f"Loading {name}"):
                # --dtype auto as generate and serve decide it, for the runner profiled first
                model, _ = load_model(name, device, chosen_dtype(dtype, name, device, runners[0], None))
            with stderr.status("Measuring memory bandwidth and matrix-product rate"):
                hardware = measure_hardware(model.dtype, str(model.device))
            console.print(
                f"{name} ({model.dtype}, {model.device}): read bandwidth {hardware.read_bandwidth / 1e9:.1f} GB/s, "
                f"matrix products {hardware.matmul_flops / 1e9:.1f} GFLOP/s"
            )
            for choice in runners:
                if choice == "fast" and runner == "both" and not _fast_supported(model):
                    continue
                model_runner = runner_for(model, choice, quantize if choice != "transformers" else None)
                with stderr.status(f"Timing {type(model_runner).__name__}"):
                    costs = profile_forward(model_runner, model, hardware, prefix=prefix, repeats=repeats)
                label = type(model_runner).__name__ + (f" {quantize}" if quantize and choice != "transformers" else "")
                console.print(render_table(f"{name}: {label}, after {prefix} cached tokens", costs))
                if compile and model_runner.compilable:
                    model_runner.compile()
                    with stderr.status(f"Compiling and timing {type(model_runner).__name__}"):
                        costs = profile_forward(model_runner, model, hardware, (1, 5), prefix, repeats)
                    console.print(render_table(f"{name}: {label} compiled, after {prefix} cached tokens", costs))


def _fast_supported(model) -> bool:
    from specdecode.runners import fast_llama

    return fast_llama.supports(model)


@app.command()
def serve(
    target: TargetOption = SERVER.target,
    draft: DraftOption = SERVER.draft,
    drafter: DrafterOption = SERVER.drafter,
    k: KOption = SERVER.num_speculative_tokens,
    adaptive: AdaptiveOption = SERVER.adaptive,
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
        cache = CacheOptions(
            cache_url, response_cache, draft_store, cache_max_mb, secret=_cache_secret(cache_secret_file)
        )
        config = _server_config(
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
            host=host,
            port=port,
            api_key=api_key,
            metrics_without_key=metrics_without_key,
            max_waiting=max_waiting,
            max_batch_size=max_batch_size,
            max_request_seconds=max_request_seconds,
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
        with stderr.status(f"Loading {target}" + (f" and {draft}" if draft else "")):
            engine = config.engine()
            if cache_url is not None and not engine.cache_backend.ping():  # not fatal: it may come up later
                from specdecode.cache.backends import mask_password

                masked = mask_password(cache_url)
                stderr.print(f"warning: no Redis answers at {masked}; caching in this process until one does")
        server_app = app_from_config(config, engine, start_worker=False, faults=faults)
    sizes = f"max_model_len {engine.max_model_len}, up to {server_app.state.worker.decoder.capacity} requests at once"
    stderr.print(f"serving {target} on http://{host}:{port}/v1 ({sizes})" + (" (API key required)" if api_key else ""))
    with user_errors():
        run_server(server_app, config.host, config.port)


def _server_config(target, draft, drafter, k, adaptive, device, dtype, **settings) -> ServerConfig:
    """The config of `serve` (settings: its own options) or `batch`, from the engine options they
    share; its checks run here, before anything loads."""
    return ServerConfig(
        target=target,
        draft=draft,
        drafter=drafter,
        num_speculative_tokens=k,
        adaptive=adaptive,
        device=device,
        dtype=dtype,
        **settings,
    )


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
        key = " (API key required)" if config.api_key else ""
        url = f"http://{config.host}:{config.port}/v1"
        stderr.print(f"serving {config.target} on {url} with {scaling.replicas} Ray replicas{key}")

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


@app.command()
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
) -> None:
    """Throughput and latency percentiles of an OpenAI-compatible server at several concurrency levels."""
    from specdecode.bench.prompts import load_prompts
    from specdecode.server.loadtest import print_level, run_loadtest, server_metrics, started_server

    with user_errors():
        levels = _positive_ints(concurrency, "--concurrency")
        if requests < 1 or max_tokens < 1:
            raise InvalidArgumentError("--requests and --max-tokens must be at least 1")
        if not 0.0 <= disconnect_rate <= 1.0:
            raise InvalidArgumentError(f"--disconnect-rate must be in [0, 1], got {disconnect_rate}")
        if url and (inject_faults or dtype != "auto"):
            raise InvalidArgumentError("--inject-faults and --dtype apply to the server started here; drop --url")
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"unknown --dtype '{dtype}'; use {', '.join(DTYPES)}")
        texts = [p.text for p in load_prompts(prompts)]
        texts = [texts[i % len(texts)] for i in range(requests)]
        with started_server(url, target, max_batch_size, inject_faults, stderr, dtype) as (base_url, model):
            results = run_loadtest(
                base_url, model, texts, levels, max_tokens, temperature, disconnect_rate, on_level=print_level
            )
            metrics = server_metrics(base_url)
    summary = {"levels": [r.as_dict() for r in results], "server_metrics": metrics}
    stderr.print(f"server counters after the run: {metrics}")
    if output:
        with open(output, "w") as f:
            json.dump(summary, f, indent=2)


@app.command()
def batch(
    input: Annotated[str, typer.Argument(help="JSONL in the OpenAI Batch API format (custom_id, method, url, body).")],
    output: Annotated[str, typer.Option(help="JSONL of answers; a rerun skips the custom_ids already in it.")],
    target: TargetOption = SERVER.target,
    draft: DraftOption = SERVER.draft,
    drafter: DrafterOption = SERVER.drafter,
    k: KOption = SERVER.num_speculative_tokens,
    adaptive: AdaptiveOption = SERVER.adaptive,
    concurrency: Annotated[int, typer.Option(help="Requests decoded together (continuous batching).")] = 8,
    device: DeviceOption = SERVER.device,
    dtype: DtypeOption = SERVER.dtype,
    ray: RayOption = False,
    ray_address: RayAddressOption = None,
    replicas: ReplicasOption = 1,
    replica_cpus: ReplicaCpusOption = 1.0,
) -> None:
    """Answer a JSONL file of completions and chat requests offline, as `specdecode serve` would."""
    from pathlib import Path

    from specdecode.bench.progress import bench_progress
    from specdecode.server.app import app_from_config
    from specdecode.server.batch import pending, read_requests, run_batch

    with user_errors():
        source, destination = Path(input), Path(output)
        if not source.is_file():
            raise InvalidArgumentError(f"no input file at {input}")
        if concurrency < 1:
            raise InvalidArgumentError(f"--concurrency must be at least 1, got {concurrency}")
        config = _server_config(target, draft, drafter, k, adaptive, device, dtype).with_batch_size(concurrency)
        on_ray = ray or ray_address is not None
        if on_ray:
            from specdecode.server import ray_cluster

            ray_cluster.check_replicas(replicas, replica_cpus)
        lines = read_requests(source)
        todo = pending(lines, destination)  # the output is read once: resuming stays linear
        left = len(todo)
        if on_ray:
            ray_cluster.connect(ray_address)
            ray_cluster.check_fits(replicas, replica_cpus)
            from specdecode.server.ray_batch import run_batch_on_ray

            description = f"{replicas} Ray actors; {len(lines) - left} done before"

            def answer_all(advance):
                return run_batch_on_ray(config, todo, destination, replicas, replica_cpus, advance)
        else:
            with stderr.status(f"Loading {target}" + (f" and {draft}" if draft else "")):
                server_app = app_from_config(config)
            description = f"{len(lines) - left} of {len(lines)} done before"

            def answer_all(advance):
                return run_batch(server_app, todo, destination, concurrency, advance)

        with bench_progress(stderr) as progress:
            task = progress.add_task(description, total=left)
            answered = answer_all(lambda: progress.advance(task))
    stderr.print(f"{answered} answered, {len(lines) - answered} already in {output}")


def _positive_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"{name} takes comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise InvalidArgumentError(f"{name} values must be at least 1, got '{text}'")
    return values


def _register_train_draft() -> None:
    from specdecode.training import train_draft_command

    app.command("train-draft")(user_errors()(train_draft_command))


_register_train_draft()


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
