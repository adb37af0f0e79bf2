"""Measured costs of the pieces of one decoding step, for the predicted speedup.

A step of (d) costs one drafter proposal of k tokens plus one target forward over k + 1
tokens; a step of (c) costs one target forward over 1 token. Each is timed the way the
loop runs it: the cache rolled back to the same prefix, then only the new tokens run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.bench.interleave import interleave, medians
from specdecode.core.sampling import SamplingParams
from specdecode.drafters import Drafter
from specdecode.runners import CachedSequence, ModelRunner

ROUNDS = 7  # timed calls of each kind, after one untimed; the median resists a noisy neighbour


@dataclass
class ForwardCosts:
    context_tokens: int  # length of the prefix every cost was measured after
    target_s: dict[int, float] = field(default_factory=dict)  # tokens in one forward -> seconds
    draft_s: dict[str, dict[int, float]] = field(default_factory=dict)  # series -> k -> seconds of one proposal

    def to_dict(self) -> dict:
        return {"context_tokens": self.context_tokens, "target_s": self.target_s, "draft_s": self.draft_s}


def measure_costs(
    runner: ModelRunner,
    drafters: dict[str, Drafter],
    prefix: list[int],
    k_values: tuple[int, ...],
    params: SamplingParams,
) -> ForwardCosts:
    """Target forwards of 1 and k + 1 tokens, and one proposal of k tokens by each drafter."""
    target = CachedSequence(runner)
    target.logits(prefix)  # prefill once, untimed
    sizes = sorted({1, *(k + 1 for k in k_values)})
    calls = {("target", n): verification(target, prefix, n) for n in sizes}
    for series, drafter in drafters.items():
        drafter.begin(prefix)
        calls |= {(series, k): proposal(drafter, prefix, k, params) for k in k_values}
    costs = ForwardCosts(len(prefix))
    # untimed first calls (prefill, allocations), then rounds of one call of each kind: a burst
    # of load from another process slows every kind alike instead of all repeats of one
    timings = interleave({key: lambda _, call=call: call() for key, call in calls.items()}, repeats=ROUNDS, warm_up=1)
    for (what, size), seconds in medians(timings).items():
        if what == "target":
            costs.target_s[size] = seconds
        else:
            costs.draft_s.setdefault(what, {})[size] = seconds
    return costs


def verification(target: CachedSequence, prefix: list[int], num_tokens: int) -> Callable[[], object]:
    """One cached target forward over num_tokens after prefix: the check of num_tokens - 1 drafts."""
    extended = prefix + [prefix[i % len(prefix)] for i in range(num_tokens)]
    # each call rolls the cache back to prefix and runs the num_tokens new ones, as a step does
    return lambda: target.logits(extended, num_tokens)


def proposal(drafter: Drafter, prefix: list[int], k: int, params: SamplingParams) -> Callable[[], object]:
    """One proposal of k tokens after prefix (k draft forwards for a model drafter)."""
    generator = torch.Generator().manual_seed(0)
    # a model drafter's cache rolls back to prefix on each call (the first prefills it)
    return lambda: drafter.propose(prefix, k, params, generator)
