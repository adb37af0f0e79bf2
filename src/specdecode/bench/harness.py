"""`specdecode bench`: load the models once, warm every system up, time every system on every
prompt in a shuffled order, then check the outputs, sum up, and write the report.

Shuffling the systems anew for each prompt spreads machine noise (another process, a
frequency change) over all of them instead of favouring whichever always runs first.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from transformers import PreTrainedModel

from specdecode.bench.config import BenchConfig
from specdecode.bench.costs import ForwardCosts, measure_costs
from specdecode.bench.environment import describe_environment, load_average
from specdecode.bench.interleave import interleave
from specdecode.bench.llamacpp import LOOKUP_TOKENS, NOT_INSTALLED, gguf_file, installed
from specdecode.bench.measurement import Measurement
from specdecode.bench.progress import bench_progress
from specdecode.bench.prompts import BenchPrompt, load_prompts, select_prompts
from specdecode.bench.quality import Difference, add_perplexities, compare_greedy
from specdecode.bench.summary import Row, summarize
from specdecode.bench.systems import (
    EngineSystem,
    HFSystem,
    LlamaCppSystem,
    Output,
    System,
    SystemSpec,
    build_systems,
    close_systems,
    load_draft,
    plan_systems,
)
from specdecode.core.sampling import SamplingParams
from specdecode.engine import CacheOptions, SpeculativeEngine
from specdecode.errors import InvalidArgumentError

WARM_UP_TOKENS = 8
LLAMACPP_BATCH = 512


@dataclass
class BenchResult:
    config: BenchConfig
    environment: dict
    specs: list[SystemSpec]
    systems: list[dict]  # each system's spec, name and generate options, for results.json
    prompts: list[dict]  # id, category and length in tokens of each prompt timed
    skipped_prompts: list[dict]  # prompts too long for the context window
    costs: ForwardCosts
    measurements: list[Measurement]
    differences: list[Difference]  # greedy runs: outputs that differ from their reference's (quality.py)
    rows: list[Row]


def run_benchmark(config: BenchConfig, console: Console | None = None) -> BenchResult:
    """Measure every system of config on its prompts; returns everything measured (nothing is written)."""
    console = console or Console(stderr=True)
    prompts = select_prompts(load_prompts(config.prompts), config.categories, config.prompts_per_category)
    llamacpp = llamacpp_systems(config, console)
    gguf = gguf_file(config.target) if llamacpp else None  # a target without one is refused before the load
    with console.status(f"Loading {', '.join((config.target, *config.drafts))}"):
        engine, draft_models = load_models(config)
    prompts, prompt_ids, skipped = encode_prompts(engine, prompts, config)
    # the engine's quantization as it resolved: named, or --dtype auto's choice (w8a8 where it runs)
    quantization = config.quantization or (engine.quantization.name if engine.quantization else None)
    specs = plan_systems(config.active_drafters, config.drafts, config.k_values, llamacpp, quantization)
    with console.status("Starting llama.cpp" if llamacpp else "Preparing the systems"):
        systems = build_systems(specs, engine, draft_models, gguf, llamacpp_context(prompt_ids, config))
    try:
        return measure_systems(config, console, engine, systems, prompts, prompt_ids, skipped)
    finally:
        close_systems(systems)


def measure_systems(
    config: BenchConfig,
    console: Console,
    engine: SpeculativeEngine,
    systems: list[System],
    prompts: list[BenchPrompt],
    prompt_ids: dict[str, list[int]],
    skipped: list[dict],
) -> BenchResult:
    """Warm-up, step costs, timing, then the outputs checked and summed up."""
    with console.status("Warming up every system"):
        for system in systems:
            warm_up_tokens = min(WARM_UP_TOKENS, config.max_new_tokens)
            system.generate(prompt_ids[prompts[0].id], warm_up_tokens, config.temperature, config.seed)
    with console.status("Timing target forwards and draft proposals"):
        costs = measure_step_costs(engine, systems, prompt_ids, config)

    model = engine.target_runner.model
    environment = describe_environment(model.device, model.dtype, type(engine.target_runner).__name__)
    environment["engine_precision"] = engine.precision  # the target as (c) and (d) run it
    for system in systems:
        if isinstance(system, LlamaCppSystem):
            environment["versions"]["llama-cpp-python"] = system.options["version"]
    measurements = time_systems(systems, prompts, prompt_ids, config, console)
    environment["load_average_1m_after"] = load_average()

    differences = []
    if config.greedy:
        with console.status("Comparing outputs with transformers' greedy output"):
            differences = compare_greedy(measurements, prompt_ids, model, engine.tokenizer)
    else:
        with console.status("Scoring outputs by the target's perplexity"):
            add_perplexities(measurements, prompt_ids, model)
    specs = [system.spec for system in systems]
    rows = summarize(measurements, specs, costs, config.greedy)
    return BenchResult(
        config,
        environment,
        specs,
        [describe_system(s) for s in systems],
        [{"id": p.id, "category": p.category, "prompt_tokens": len(prompt_ids[p.id])} for p in prompts],
        skipped,
        costs,
        measurements,
        differences,
        rows,
    )


def llamacpp_systems(config: BenchConfig, console: Console) -> tuple[str, ...]:
    """The llama.cpp systems asked for, or none, said in one line, where llama-cpp-python is missing."""
    if config.systems and not installed():
        console.print(NOT_INSTALLED, markup=False, highlight=False, soft_wrap=True)
        return ()
    return config.systems


def llamacpp_context(prompt_ids: dict[str, list[int]], config: BenchConfig) -> int:
    """llama.cpp's context: the longest prompt, its new tokens, and a last draft past them; at
    least llama-cpp-python's default batch of 512, which it cuts down to a smaller context."""
    return max(max(map(len, prompt_ids.values())) + config.max_new_tokens + LOOKUP_TOKENS + 1, LLAMACPP_BATCH)


def load_models(config: BenchConfig) -> tuple[SpeculativeEngine, dict[str, PreTrainedModel]]:
    """The target, in an engine without a drafter (systems add their own), and the draft models."""
    no_cache = CacheOptions(
        response_cache=False, draft_store=False, prefix_cache=False
    )  # the benchmark times decoding, not caches
    engine = SpeculativeEngine.from_pretrained(
        config.target,
        drafter="none",
        num_speculative_tokens=0,
        device=config.device,
        dtype=config.dtype,
        cache=no_cache,
        quantization=config.quantization,
        keep_model_weights=True,  # transformers' generate runs it as the baseline
    )
    drafts = {name: load_draft(name, engine, config.device, config.dtype) for name in config.drafts}
    return engine, drafts


def encode_prompts(
    engine: SpeculativeEngine, prompts: list[BenchPrompt], config: BenchConfig
) -> tuple[list[BenchPrompt], dict[str, list[int]], list[dict]]:
    """Token ids of each prompt, as every system gets them; prompts that cannot fit are skipped."""
    chat = config.chat if config.chat is not None else bool(getattr(engine.tokenizer, "chat_template", None))
    context = engine.max_model_len
    kept, ids, skipped = [], {}, []
    for prompt in prompts:
        tokens = engine.encode(prompt.text, chat=chat)
        if len(tokens) + config.max_new_tokens > context:
            skipped.append({"id": prompt.id, "category": prompt.category, "prompt_tokens": len(tokens)})
            continue
        kept.append(prompt)
        ids[prompt.id] = tokens
    if not kept:
        raise InvalidArgumentError(
            f"no prompt fits the model's context of {context} tokens with --max-new-tokens {config.max_new_tokens}; "
            "lower --max-new-tokens or use shorter prompts"
        )
    return kept, ids, skipped


def measure_step_costs(
    engine: SpeculativeEngine,
    systems: list[System],
    prompt_ids: dict[str, list[int]],
    config: BenchConfig,
) -> ForwardCosts:
    """Step costs after the median-length prompt: they grow with the context, so take a typical one."""
    prefix = sorted(prompt_ids.values(), key=len)[len(prompt_ids) // 2]
    prefix = prefix[: engine.max_model_len - max(config.k_values) - 2]
    drafters = {s.spec.series: s.engine.drafter for s in systems if isinstance(s, EngineSystem) and s.spec.speculative}
    return measure_costs(engine.target_runner, drafters, prefix, config.k_values, SamplingParams(config.temperature))


def time_systems(
    systems: list[System],
    prompts: list[BenchPrompt],
    prompt_ids: dict[str, list[int]],
    config: BenchConfig,
    console: Console,
) -> list[Measurement]:
    """Every system on every prompt, config.runs times, systems in a new random order each prompt
    (bench/interleave.py); each system times itself (llama.cpp's inside its worker)."""
    # one item per run and prompt, with one sampling seed each, the same for every system
    items = [(run, index, prompt) for run in range(config.runs) for index, prompt in enumerate(prompts)]
    with bench_progress(console) as progress:
        task = progress.add_task("Timing", total=len(items) * len(systems))

        def timing(system: System):
            def generate(item: tuple[int, int, BenchPrompt]) -> Output:
                run, index, prompt = item
                progress.update(
                    task,
                    description=f"run {run + 1}/{config.runs} prompt {index + 1}/{len(prompts)} "
                    f"({prompt.category}) {system.spec.name}",
                )
                seed = config.seed + run * len(prompts) + index
                output = system.generate(prompt_ids[prompt.id], config.max_new_tokens, config.temperature, seed)
                progress.advance(task)
                return output

            return generate

        runs = interleave({i: timing(s) for i, s in enumerate(systems)}, items, order="shuffle", seed=config.seed)
        progress.update(task, description="Timed")
    return [_measurement(systems[r.system], items[r.item], r.order, prompt_ids, r.value) for r in runs]


def _measurement(
    system: System, item: tuple[int, int, BenchPrompt], order: int, prompt_ids: dict[str, list[int]], output: Output
) -> Measurement:
    run, _, prompt = item
    stats = output.stats.to_dict() if output.stats is not None else None
    spec = system.spec
    ids = prompt_ids[prompt.id]
    return Measurement(
        spec.name,
        spec.group,
        prompt.id,
        prompt.category,
        run,
        order,
        len(ids),
        output.token_ids,
        output.wall_time_s,
        stats,
    )


def describe_system(system: System) -> dict:
    spec = system.spec
    described = {
        "name": spec.name,
        "group": spec.group,
        "framework": spec.framework,
        "drafter": spec.drafter,
        "k": spec.k,
        "draft": spec.draft,
    }
    if isinstance(system, HFSystem):
        # what was passed to generate, less the assistant model object itself
        described["generate_options"] = {k: v for k, v in system.options.items() if k != "assistant_model"}
    elif isinstance(system, LlamaCppSystem):
        described["llama_cpp"] = system.options  # the file, and the settings its context was created with
    return described
