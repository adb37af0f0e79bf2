"""`specdecode generate`: one prompt, its continuation and stats; with --compare, target-only
decoding timed beside it, and llama.cpp's plain decoding of the target's .gguf where
llama-cpp-python is installed (greedy)."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Optional

import typer

from specdecode.cache.engine_caches import CacheOptions
from specdecode.cli.console import loading
from specdecode.cli.errors import user_errors
from specdecode.cli.options import (
    AdaptiveOption,
    CacheMaxMbOption,
    CacheSecretFileOption,
    CacheUrlOption,
    ChatOption,
    DeviceOption,
    DrafterOption,
    DraftOption,
    DraftStoreOption,
    DtypeOption,
    KOption,
    MaxModelLenOption,
    QuantizationOption,
    ResponseCacheOption,
    ShippedHeadOption,
    TargetOption,
    cache_options,
)
from specdecode.core.adjustments import Adjustments
from specdecode.core.checks import DEFAULT_SPECULATIVE_TOKENS, check_prompt_text, check_request
from specdecode.drafters.factory import DrafterOptions
from specdecode.loading import DEFAULT_TARGET

CACHE = CacheOptions()  # the caches' defaults
COMPARE_ROUNDS = 3  # --compare: runs of each decoding, the median kept


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
    compile: Annotated[
        bool,
        typer.Option(
            help="Run the target compiled by torch.compile (Llama-family fast runner; each forward size "
            "compiles on first use, which is slow)."
        ),
    ] = False,
    draft_quantization: Annotated[
        Optional[str],
        typer.Option(help="self-quantized drafter only: bfloat16, int8-weight-only, nf4 or fp4 \\[default: bfloat16]."),
    ] = None,
    min_confidence: Annotated[
        float, typer.Option(help="Model drafters stop after a token they give less probability.")
    ] = 0.0,
    recycling_width: Annotated[
        int, typer.Option(help="recycling drafter: the target's candidates kept per token (the table's width).")
    ] = DrafterOptions().recycling_width,
    shipped_head: ShippedHeadOption = DrafterOptions().shipped_head,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    max_model_len: MaxModelLenOption = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[Optional[int], typer.Option(help="Sample from the k most likely tokens.")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Sample from the smallest set with this mass.")] = None,
    min_p: Annotated[
        Optional[float], typer.Option(help="Drop tokens less likely than this times the likeliest.")
    ] = None,
    presence_penalty: Annotated[
        float, typer.Option(help="OpenAI's: subtracted from each token already generated.")
    ] = 0.0,
    frequency_penalty: Annotated[
        float, typer.Option(help="OpenAI's: subtracted per time a token was generated.")
    ] = 0.0,
    repetition_penalty: Annotated[
        float, typer.Option(help="transformers': divides the logits of tokens seen (1: off).")
    ] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop at this string (repeatable).")] = None,
    regex: Annotated[Optional[str], typer.Option(help="The answer matches this regular expression.")] = None,
    json_schema: Annotated[
        Optional[str], typer.Option(help="The answer is JSON of this schema (a file, or the schema's JSON).")
    ] = None,
    logprobs: Annotated[
        Optional[int], typer.Option(help="With --json: each token's log-probability and the N likeliest.")
    ] = None,
    chat: ChatOption = None,
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
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, stop=stop, logprobs=logprobs)
        check_request(max_new_tokens=max_new_tokens, seed=seed, **sampling)
        adjustments = dict(
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
        )
        Adjustments.of(**adjustments)  # checked before the load
        constraint = _constraint(regex, json_schema)
        with loading(target, draft):
            drafter_options = DrafterOptions(
                adaptive,
                *ngram,
                max_continuation,
                lookup_history,
                draft_quantization,
                min_confidence,
                recycling_width=recycling_width,
                shipped_head=shipped_head,
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
                cache=cache_options(
                    cache_url,
                    response_cache and not compare,
                    draft_store and not compare,
                    cache_max_mb,
                    cache_secret_file,
                    require_backend=True,
                    prefix_cache=not compare,
                ),
                quantization=quantization,
                compile=compile,
            )
        use_chat = chat if chat is not None else bool(getattr(engine.tokenizer, "chat_template", None))
        options = dict(max_new_tokens=max_new_tokens, chat=use_chat, constraint=constraint, **sampling, **adjustments)
        llamacpp = None
        if compare and temperature == 0:
            llamacpp = _llamacpp_beside(target, engine, engine.prompt_token_ids(prompt, use_chat), max_new_tokens)
        try:
            if not compare:
                result = engine.generate(prompt, seed=seed, **options)[0]
            else:
                baseline, result, llamacpp_speed = _timed_runs(engine, prompt, seed, options, llamacpp)
        finally:
            if llamacpp is not None:
                llamacpp.close()

    output = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason}
    if result.logprobs is not None:
        output["logprobs"] = [dataclasses.asdict(entry) for entry in result.logprobs]
    output["stats"] = result.stats.to_dict()
    lines = [result.text, f"[{result.stats.summary()}]"]
    if compare:
        output["compare"] = _comparison(result, baseline, greedy=temperature == 0)
        lines.append(_comparison_line(output["compare"]))
        if llamacpp_speed is not None:
            output["compare"]["llama_cpp_tokens_per_second"] = llamacpp_speed
            lines.append(_llamacpp_line(output["compare"]))
    if json_output:
        print(json.dumps(output))
    else:
        print("\n".join(lines))


def _constraint(regex: str | None, json_schema: str | None):
    """--regex or --json-schema (a file's path, or the schema itself) as a grammar; None for neither."""
    from pathlib import Path

    from specdecode.core.constraints import Constraint
    from specdecode.errors import InvalidArgumentError

    if regex is not None and json_schema is not None:
        raise InvalidArgumentError("give --regex or --json-schema, not both", "json_schema")
    if regex is not None:
        return Constraint.regex(regex)
    if json_schema is None:
        return None
    text = Path(json_schema).read_text() if Path(json_schema).is_file() else json_schema
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise InvalidArgumentError(
            f"--json-schema is neither a file nor JSON: {error}; give a schema file's path or its JSON", "json_schema"
        ) from None
    if not isinstance(schema, dict):
        raise InvalidArgumentError("--json-schema must be a JSON object (a schema)", "json_schema")
    return Constraint.json_schema(schema)


def _timed_runs(engine, prompt: str, seed: int | None, options: dict, llamacpp) -> tuple:
    """--compare: the median target-only and speculative runs of the prompt, and llama.cpp's
    median tokens/s on the same prompt ids where it runs beside (else None)."""
    engine.generate(prompt, **(options | dict(max_new_tokens=2)))  # warm-up, so neither run pays it
    ids, stop = None, None
    if llamacpp is not None:
        ids, stop = engine.prompt_token_ids(prompt, options["chat"]), sorted(engine.eos_token_ids)
        llamacpp.generate(ids, 2, stop)
    # alternate them, so a noisy neighbour on the machine slows all alike; keep the medians
    runs, speeds = [], []
    for _ in range(COMPARE_ROUNDS):
        runs += [
            engine.generate(prompt, seed=seed, speculative=speculative, **options)[0] for speculative in (False, True)
        ]
        if llamacpp is not None:
            answer = llamacpp.generate(ids, options["max_new_tokens"], stop)
            speeds.append(len(answer.token_ids) / answer.seconds)
    speed = sorted(speeds)[len(speeds) // 2] if speeds else None
    return _median_run(runs[0::2]), _median_run(runs[1::2]), speed


def _llamacpp_beside(target: str, engine, prompt_ids: list[int], max_new_tokens: int):
    """llama.cpp's plain decoding on the target's own .gguf, in its own process, where
    llama-cpp-python is installed and the target has a .gguf (else None; a failure to start is
    one line on stderr, and the comparison goes on without it)."""
    import torch

    from specdecode.bench import llamacpp
    from specdecode.errors import InvalidArgumentError

    if not llamacpp.installed():
        return None
    try:
        gguf = llamacpp.gguf_file(target)
    except InvalidArgumentError:
        return None
    try:
        worker = llamacpp.LlamaCppWorker(gguf, torch.get_num_threads(), len(prompt_ids) + max_new_tokens + 8, None)
    except llamacpp.LlamaCppError as error:
        typer.echo(f"--compare without llama.cpp: {error}", err=True)
        return None
    if worker.info["n_vocab"] != engine.target_runner.vocab_size:  # other token ids: not comparable
        worker.close()
        return None
    return worker


def _median_run(results: list):
    return sorted(results, key=lambda r: r.stats.tokens_per_second)[len(results) // 2]


def _comparison(result, baseline, greedy: bool) -> dict:
    return {
        "target_only_tokens_per_second": baseline.stats.tokens_per_second,
        "speculative_tokens_per_second": result.stats.tokens_per_second,
        "speedup": result.stats.tokens_per_second / baseline.stats.tokens_per_second,
        "identical_output": result.token_ids == baseline.token_ids if greedy else None,
    }


def _llamacpp_line(comparison: dict) -> str:
    speed = comparison["llama_cpp_tokens_per_second"]
    return (
        f"[llama.cpp, plain decoding of the same .gguf {speed:.1f} tok/s | this engine: target-only "
        f"{comparison['target_only_tokens_per_second'] / speed:.2f}x, speculative "
        f"{comparison['speculative_tokens_per_second'] / speed:.2f}x llama.cpp]"
    )


def _comparison_line(comparison: dict) -> str:
    identical = {True: "outputs identical", False: "OUTPUTS DIFFER", None: "sampled, outputs not compared"}
    return (
        f"[target-only {comparison['target_only_tokens_per_second']:.1f} tok/s | "
        f"speculative {comparison['speculative_tokens_per_second']:.1f} tok/s | "
        f"speedup {comparison['speedup']:.2f}x | {identical[comparison['identical_output']]}]"
    )
