"""Logit bias and repetition penalties: what a request adds to the target's logits, exact under
speculation.

An `Adjustments` changes the target's logits at each position by the tokens before it, as
OpenAI's API, vLLM and transformers define the options, in this order:
- repetition_penalty r (transformers, vLLM): the logit x of every token in the prompt or the
  generated tokens becomes x / r where x > 0 and x * r otherwise (r > 1 discourages repeats);
- frequency_penalty f and presence_penalty a (OpenAI): a token generated c times so far loses
  c * f + (c > 0) * a (the prompt does not count, as in vLLM);
- logit_bias (OpenAI): a constant added to the logits of the listed tokens.

Exactness. The adjusted target is the target whose logits are adjusted by exactly the tokens
before each position. Verification sees that target at every verified row: the row after the
committed tokens is adjusted by them, and the row after a draft node by them and the node's
path, as if the path had been emitted (a row is only used when its path is accepted). The
accept/reject rule then keeps the adjusted target's distribution, whatever drafted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specdecode.errors import InvalidArgumentError

MAX_LOGIT_BIAS_TOKENS = 1024  # entries of a request's logit_bias (it is kept per sequence)
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, 100 makes it the only choice
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty


@dataclass(frozen=True)
class Adjustments:
    """A request's logit bias and penalties; the defaults change nothing."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by token id
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN too
                raise InvalidArgumentError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}", name)
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidArgumentError(
                f"repetition_penalty must be > 0 and finite (1 changes nothing), got {self.repetition_penalty}",
                "repetition_penalty",
            )

    @staticmethod
    def of(
        logit_bias: Mapping[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
    ) -> Adjustments:
        """Checked adjustments from a request's options (logit_bias as OpenAI's map, token id -> bias)."""
        return Adjustments(_checked_bias(logit_bias or {}), presence_penalty, frequency_penalty, repetition_penalty)

    @property
    def active(self) -> bool:
        """Whether it changes any logit."""
        return bool(self.logit_bias) or self.penalizes

    @property
    def penalizes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    def check_vocabulary(self, vocab_size: int) -> None:
        bad = next((token for token, _ in self.logit_bias if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad}", "logit_bias")

    def apply(
        self,
        logits: torch.Tensor,  # [1 + len(tokens), vocab]: after the committed tokens, then after each draft node
        prompt: list[int],
        generated: list[int],
        tokens: list[int],  # the draft's nodes
        parents: list[int],  # each node's parent among the nodes, -1 for the root
    ) -> torch.Tensor:  # [1 + len(tokens), vocab] float32
        """The adjusted logits of every row, each by the tokens before it (module docstring)."""
        logits = logits.float()
        if self.penalizes:
            counts = _counts_per_row(generated, tokens, parents, logits.shape[-1])  # [rows, vocab]
            if self.repetition_penalty != 1.0:
                seen = counts > 0
                seen[:, torch.tensor(prompt, dtype=torch.long)] = True
                penalized = torch.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
                logits = torch.where(seen, penalized, logits)
            if self.frequency_penalty or self.presence_penalty:
                logits = logits - self.frequency_penalty * counts - self.presence_penalty * (counts > 0)
        if self.logit_bias:
            bias = torch.zeros(logits.shape[-1])
            bias[torch.tensor([token for token, _ in self.logit_bias])] = torch.tensor([b for _, b in self.logit_bias])
            logits = logits + bias
        return logits


NO_ADJUSTMENTS = Adjustments()


def _checked_bias(logit_bias: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    if len(logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidArgumentError(
            f"logit_bias may list at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(logit_bias)}", "logit_bias"
        )
    checked = {}
    for token, bias in logit_bias.items():
        try:
            token_id, value = int(token), float(bias)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"logit_bias maps token ids to numbers, got {token!r}: {bias!r}", "logit_bias"
            ) from None
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidArgumentError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value} for token {token}",
                "logit_bias",
            )
        checked[token_id] = value
    return tuple(sorted(checked.items()))


def _counts_per_row(generated: list[int], tokens: list[int], parents: list[int], vocab_size: int) -> torch.Tensor:
    """[1 + len(tokens), vocab] float32: how often each token occurs among the generated tokens
    (row 0), and among them and the draft path to each node (row 1 + i)."""
    counts = torch.zeros(1 + len(tokens), vocab_size)
    if generated:
        counts[0] = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):  # parents come first
        counts[1 + node] = counts[1 + parent]
        counts[1 + node, token] += 1
    return counts
