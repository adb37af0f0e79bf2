"""The options that several commands take (their type, flag, help and defaults), and what they
are turned into: the caches' options (`cache_options`) and a server's config (`server_config`).
An option that one command alone takes stands in that command's signature."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from specdecode import precision
from specdecode.cache.engine_caches import CacheOptions
from specdecode.errors import InvalidArgumentError
from specdecode.server.config import ServerConfig

SERVER = ServerConfig()  # `serve`'s and `batch`'s defaults


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
ChatOption = Annotated[
    Optional[bool],
    typer.Option("--chat/--no-chat", help="Apply the chat template \\[default: on if the model has one]."),
]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
DtypeOption = Annotated[
    str,
    typer.Option(
        help="auto (w8a8 where the Llama-family fast runner and this CPU's int8 kernel run it, +0.8% "
        "perplexity; in float, bfloat16 where the CPU multiplies it natively and a fast path makes it "
        "exact, else float32), float32, bfloat16 or float16 (the checkpoint's own arithmetic)."
    ),
]
MaxModelLenOption = Annotated[
    Optional[int],
    typer.Option(help="Most tokens, prompt and generated, a sequence may hold \\[default: the model's context]."),
]
QuantizationOption = Annotated[
    Optional[str],
    typer.Option(
        help="Quantize the target: nf4, fp4, llm-int8 (bitsandbytes, transformers runner) or w8a8 "
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
PrefixCacheOption = Annotated[
    bool,
    typer.Option(help="Keep a finished request's KV cache for a later prompt that starts the same way (where exact)."),
]
ShippedHeadOption = Annotated[
    bool,
    typer.Option(help="drafter auto without --draft: draft with the head shipped for the target, if there is one."),
]
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


def older_flag(older: str, value, name: str, current):
    """The value of an option given by an older flag (warned of in one line), else the current one's."""
    if value is None:
        return current
    if current is not None:
        raise InvalidArgumentError(f"give {name} alone: {older} is its older spelling")
    precision.warn_older_spelling(older, name)
    return value


def cache_options(
    url: str | None,
    response_cache: bool,
    draft_store: bool,
    max_mb: int,
    secret_file: str | None,
    require_backend: bool = False,
    prefix_cache: bool = True,
) -> CacheOptions:
    """The caches of --cache-url, --response-cache, --draft-store, --cache-max-mb,
    --cache-secret-file and --prefix-cache (generate and serve)."""
    secret = _cache_secret(secret_file)
    return CacheOptions(
        url,
        response_cache,
        draft_store,
        max_mb,
        prefix_cache=prefix_cache,
        require_backend=require_backend,
        secret=secret,
    )


def _cache_secret(path: str | None) -> str | None:
    """The key in --cache-secret-file (its first line), read here so that it is never on a command
    line; else $SPECDECODE_CACHE_SECRET's, resolved here so that Ray replicas get it with the config."""
    if path is None:
        return os.environ.get("SPECDECODE_CACHE_SECRET") or None
    try:
        with open(path, encoding="utf-8") as file:
            secret = file.readline().strip()
    except OSError as error:
        raise InvalidArgumentError(f"--cache-secret-file {path}: cannot read it ({error.strerror})") from None
    if not secret:
        raise InvalidArgumentError(f"--cache-secret-file {path} is empty; write the key on its first line")
    return secret


def server_config(target, draft, drafter, k, adaptive, device, dtype, **settings) -> ServerConfig:
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
