"""`specdecode bench` (drafters against transformers on Spec-Bench prompts, or the caches on
repeated requests: bench/) and `specdecode profile` (cached forwards against the hardware's
floors: runners/profiling.py)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from specdecode import precision
from specdecode.cache.engine_caches import CacheOptions
from specdecode.cli.console import loading, stderr
from specdecode.cli.errors import user_errors
from specdecode.cli.options import ChatOption, DeviceOption, DtypeOption, QuantizationOption, older_flag
from specdecode.errors import InvalidArgumentError
from specdecode.loading import DEFAULT_TARGET


def bench(
    workload: Annotated[
        str,
        typer.Option(
            help="specbench: drafters against transformers on Spec-Bench prompts; repeat: the caches on "
            "exact repeats, near-repeats, multi-turn revisions and unique prompts; json: schema-constrained "
            "JSON extraction, auto with forced tokens against constrained target-only."
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
            help="prompt-lookup, model (both beside transformers' own), auto (the default drafter, adaptive k) "
            "and/or recycling (trees of k nodes); repeatable or comma-separated "
            "\\[default: prompt-lookup, and model with --draft]."
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
    chat: ChatOption = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda \\[default: auto].")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16 \\[default: auto].")] = None,
    quantization: QuantizationOption = None,
) -> None:
    """Benchmark against transformers on Spec-Bench prompts; write results.json, report.md and plots."""
    from specdecode.bench import BenchConfig, overall_table, run_benchmark, write_outputs

    if workload == "repeat":
        options = dict(
            draft=draft,
            drafter=drafter,
            system=system,
            k=k,
            prompts=prompts,
            category=category,
            runs=runs,
            quick=quick,
            quantization=quantization,
        )
        _bench_repeat(target, device, dtype, prompts_per_category, max_new_tokens, seed, output_dir, options)
        return
    if workload == "json":
        options = dict(draft=draft, drafter=drafter, system=system, k=k, prompts=prompts, category=category)
        options |= dict(prompts_per_category=prompts_per_category, temperature=temperature, quick=quick, chat=chat)
        _bench_json(target, device, dtype, quantization, max_new_tokens, runs, seed, output_dir, options)
        return
    with user_errors():
        if workload != "specbench":
            raise InvalidArgumentError(f"unknown --workload '{workload}'; use specbench, repeat or json")
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
            quantization=quantization,
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
        with loading(target or DEFAULT_TARGET):
            engine = SpeculativeEngine.from_pretrained(
                target or DEFAULT_TARGET,
                drafter="none",
                device=device or "auto",
                dtype=dtype or "bfloat16",
                cache=CacheOptions(draft_store=False, prefix_cache=False),
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


def _bench_json(target, device, dtype, quantization, max_new_tokens, runs, seed, output_dir, options) -> None:
    """`bench --workload json` (bench/extraction.py): its own documents and schemas, the engine's
    defaults (dtype auto, drafter auto)."""
    from pathlib import Path

    from specdecode.bench.extraction import documents, run_extraction_workload
    from specdecode.bench.progress import bench_progress
    from specdecode.core.constraints import require_llguidance
    from specdecode.engine import SpeculativeEngine

    with user_errors():
        given = [f"--{name.replace('_', '-')}" for name, value in options.items() if value not in (None, False)]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} do not apply to --workload json; leave them out")
        if (max_new_tokens is not None and max_new_tokens < 1) or (runs is not None and runs < 1):
            raise InvalidArgumentError("--max-new-tokens and --runs must be at least 1")
        require_llguidance()
        with loading(target or DEFAULT_TARGET):
            engine = SpeculativeEngine.from_pretrained(
                target or DEFAULT_TARGET,
                device=device or "auto",
                dtype=dtype or "auto",
                quantization=quantization,
                cache=CacheOptions(response_cache=False, draft_store=False, prefix_cache=False),
            )
        runs = runs or 1
        with bench_progress(stderr) as progress:
            task = progress.add_task("requests", total=2 * runs * len(documents()))
            table = run_extraction_workload(
                engine, max_new_tokens or 256, runs, seed or 0, lambda: progress.advance(task)
            )
    print(table)
    out = Path(output_dir or "bench-results") / "json-extraction.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    print(f"wrote {out}")


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
    quantization: Annotated[
        Optional[str],
        typer.Option(help="w8a8 or int8-weight-only: the fast runner's products in 8 bits \\[default: none]."),
    ] = None,
    quantize: Annotated[Optional[str], typer.Option(hidden=True, help="The older spelling of --quantization.")] = None,
    compile: Annotated[
        bool,
        typer.Option(help="Also time the fast runner compiled by torch.compile, 1 and 5 tokens (slow: each compiles)."),
    ] = False,
    prefix: Annotated[int, typer.Option(help="Cached tokens before the timed forward.")] = 200,
    repeats: Annotated[
        int, typer.Option(help="Rounds of timed forwards, each size once a round (medians and spreads are shown).")
    ] = 15,
) -> None:
    """Time cached forwards over 1-32 new tokens beside the memory-bandwidth and compute floors."""
    from specdecode.loading import load_model
    from specdecode.runners import runner_for
    from specdecode.runners.profiling import measure_hardware, profile_forward, render_table
    from specdecode.runners.select import resolve_precision

    console = Console()
    with user_errors():
        quantization = older_flag("--quantize", quantize, "--quantization", quantization)
        if prefix < 1 or repeats < 1:
            raise InvalidArgumentError("--prefix and --repeats must be at least 1")
        precision.quantization_named(quantization, precision.RUNNER)  # an unknown name refused before loading
        if compile and runner == "transformers":
            raise InvalidArgumentError("--compile times the fast runner compiled; use --runner both or fast")
        runners = ["fast", "transformers"] if runner == "both" else [runner]
        for name in [target] + ([draft] if draft else []):
            with loading(name):
                # --dtype auto as generate and serve decide it (w8a8 where that is their default),
                # for the runner profiled first; the transformers runner times the products in float
                option = precision.TARGET if quantization is None else precision.RUNNER
                chosen = resolve_precision(name, device, dtype, quantization, runners[0], option=option)
                model, _ = load_model(name, device, chosen)
            products = chosen.runner_quantization
            _check_context(model, prefix)
            with stderr.status("Measuring memory bandwidth and matrix-product rate"):
                hardware = measure_hardware(model.dtype, str(model.device))
            console.print(
                f"{name} ({model.dtype}, {model.device}): read bandwidth {hardware.read_bandwidth / 1e9:.1f} GB/s, "
                f"matrix products {hardware.matmul_flops / 1e9:.1f} GFLOP/s"
            )
            for choice in runners:
                if choice == "fast" and runner == "both" and not _fast_supported(model):
                    continue
                quantized = products if choice != "transformers" else None
                model_runner = runner_for(model, choice, quantized)
                with stderr.status(f"Timing {type(model_runner).__name__}"):
                    costs = profile_forward(model_runner, model, hardware, prefix=prefix, repeats=repeats)
                label = type(model_runner).__name__ + (f" {quantized.name}" if quantized else "")
                console.print(render_table(f"{name}: {label}, after {prefix} cached tokens", costs))
                if compile and model_runner.compilable:
                    model_runner.compile()
                    with stderr.status(f"Compiling and timing {type(model_runner).__name__}"):
                        costs = profile_forward(model_runner, model, hardware, (1, 5), prefix, repeats)
                    console.print(render_table(f"{name}: {label} compiled, after {prefix} cached tokens", costs))


def _check_context(model, prefix: int) -> None:
    """The longest timed forward (--prefix cached tokens, then PROFILED_SIZES' largest) fits the model's context."""
    from specdecode.runners.profiling import PROFILED_SIZES

    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context is not None and prefix + max(PROFILED_SIZES) > context:
        raise InvalidArgumentError(
            f"--prefix {prefix} and {max(PROFILED_SIZES)} new tokens pass the model's context of {context} tokens: "
            f"give --prefix {max(context - max(PROFILED_SIZES), 1)} or less",
            "prefix",
        )


def _fast_supported(model) -> bool:
    from specdecode.runners import fast_llama

    return fast_llama.supports(model)
