"""What a request may ask, checked without a model: one function, and one message, per rule.

The engine runs these on every request; the CLI runs them before it loads a model (so a
mistake costs no load), and the server before it queues a request (so it is answered at
once). Each error names the argument at fault by its Python name (errors.py); the server
maps the names it spells differently (server/errors.py, API_NAMES). What needs the model
(prompt token ids within the vocabulary, a prompt that fits the context) is the engine's.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from specdecode.core.adaptive import MAX_SPECULATIVE_TOKENS
from specdecode.core.logprobs import MAX_TOP_LOGPROBS
from specdecode.core.sampling import SamplingParams
from specdecode.errors import InvalidArgumentError

DEFAULT_SPECULATIVE_TOKENS = 4  # k where none is asked (engines, `generate`, `serve`, `batch`)

# a request's stop strings: as many as OpenAI allows, each of a bounded length (the check
# after every step searches the new text and the longest stop string's length before it)
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64  # a request's stop_token_ids (each step checks its new tokens against them)


def check_request(
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | SequenceOf[str] | None = None,
    num_speculative_tokens: int | None = None,
    most_k: int = MAX_SPECULATIVE_TOKENS,
    logprobs: int | None = None,
) -> tuple[SamplingParams, list[str]]:
    """Every rule of one request's settings: its sampling parameters and stop strings.
    most_k: the most k it may ask (an engine's: the k it was loaded with)."""
    params = SamplingParams(temperature, top_k, top_p, min_p)
    check_max_new_tokens(max_new_tokens)
    stop_strings = checked_stop_strings(stop)
    check_seed(seed)
    if num_speculative_tokens is not None:
        check_k(num_speculative_tokens, most_k)
    check_logprobs(logprobs)
    return params, stop_strings


def check_logprobs(logprobs: int | None) -> None:
    """None (no log-probabilities), or how many of the likeliest tokens to list beside each one."""
    if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise InvalidArgumentError(
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (the likeliest tokens listed per token), got {logprobs}",
            "logprobs",
        )


def check_stop_token_ids(stop_token_ids: SequenceOf[int] | None, vocab_size: int) -> None:
    """At most MAX_STOP_TOKEN_IDS ids, each within the vocabulary."""
    ids = list(stop_token_ids or [])
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}", "stop_token_ids")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(f"stop_token_ids must be in [0, {vocab_size}), got {bad}", "stop_token_ids")


def check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be at least 1, got {max_new_tokens}", "max_new_tokens")


def checked_stop_strings(stop: str | SequenceOf[str] | None) -> list[str]:
    """A request's stop strings as a list: none empty, at most MAX_STOP_STRINGS, each bounded."""
    stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stop_strings):
        raise InvalidArgumentError("stop strings must not be empty", "stop")
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop_strings)}", "stop")
    longest = max((len(s) for s in stop_strings), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise InvalidArgumentError(
            f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}", "stop"
        )
    return stop_strings


def check_seed(seed: int | None) -> None:
    """A seed torch's generator takes (a throwaway one: seeding is cheap)."""
    if seed is None:
        return
    try:
        torch.Generator().manual_seed(seed)
    except (RuntimeError, ValueError, OverflowError, TypeError):
        raise InvalidArgumentError(f"seed must be an integer in [-2**63, 2**64), got {seed}", "seed") from None


def check_k(k: int, most: int = MAX_SPECULATIVE_TOKENS) -> int:
    """k (num_speculative_tokens, the most tokens drafted per step) within [0, most]: an
    engine's at most MAX_SPECULATIVE_TOKENS, a request's at most its engine's (whose policy,
    stats and metrics were sized for it)."""
    why = "drafting more per step never pays"
    if most < MAX_SPECULATIVE_TOKENS:
        why = "the k this engine was loaded with; load it with a larger -k"
    if not isinstance(k, int) or not 0 <= k <= most:
        raise InvalidArgumentError(
            f"num_speculative_tokens (k) must be an integer >= 0 (0 = target-only) and at most {most} ({why}), got {k}",
            "num_speculative_tokens",
        )
    return k


def check_max_model_len(max_model_len: int | None, context: int | None = None) -> None:
    """At least 2 (one prompt token and one new one); once the model is known, within its
    context length (context None: not known yet, as in the CLI before it loads the model)."""
    if max_model_len is None:
        return
    if not isinstance(max_model_len, int) or max_model_len < 2 or (context is not None and max_model_len > context):
        rule = "at least 2 (one prompt token and one new one)"
        if context is not None:
            rule = f"in [2, {context}] (the model's context length; one prompt token and one new one at least)"
        raise InvalidArgumentError(f"max_model_len must be {rule}, got {max_model_len}", "max_model_len")


def check_max_batch_size(max_batch_size: int) -> None:
    if max_batch_size < 1:
        raise InvalidArgumentError(f"max_batch_size must be at least 1, got {max_batch_size}", "max_batch_size")


def check_prompt_text(prompt: str) -> None:
    if not prompt.strip():
        raise InvalidArgumentError("the prompt is empty; give some text to continue", "prompt")


def seeds_for(seed: int | None, count: int) -> list[int | None]:
    """The one seeding rule: prompt (or choice) i of a request is seeded seed + i, so that each
    sample is its own and the same alone, in a batch, on the server or from the response cache."""
    return [None if seed is None else seed + i for i in range(count)]
