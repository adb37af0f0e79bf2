"""Structured outputs: a grammar the answer must follow, exact under speculation.

A `Constraint` names what the answer must be (JSON, JSON of a schema, a regular expression, one
of a list of choices, a Lark grammar); `Grammar` compiles it once for a tokenizer (llguidance,
`pip install 'specdecode[structured]'`), and each sequence holds a `Matcher` of its own.

Exactness. The constrained target is the target whose logits have every token the grammar
forbids set to -inf, before the sampling settings apply (as vLLM's structured outputs and a
transformers logits processor do). Verification sees exactly those logits at every verified
position: the mask at the root is the matcher's state after the accepted tokens, and after a
draft node the state after that node's path. The masks are computed by consuming a path and
rolling it back, so a step changes no matcher until its tokens are committed (`advance`), and a
rejected draft never moves one. A draft token the grammar forbids has probability 0 under the
constrained target: the accept/reject rule rejects it, whatever drafted it, and the output keeps
the constrained target's distribution.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from specdecode.core.sampling import row_maxima
from specdecode.errors import InvalidArgumentError

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
MAX_GRAMMARS = 64  # compiled grammars an engine keeps
# JSON laid out as json.dumps writes it ({"a": 1, "b": [2, 3]}), the layout models learnt most:
# free whitespace lets a small model fill an answer with blank lines and still follow the schema
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the answer must be. value: the JSON schema (a JSON string, json_schema), the
    pattern (regex), the choices (a JSON list of strings, choice), the Lark grammar (grammar);
    "" for json (any JSON object)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(
                f"unknown constraint '{self.kind}'; choose one of: {', '.join(KINDS)}", "constraint"
            )

    @staticmethod
    def json_object() -> Constraint:
        return Constraint("json")

    @staticmethod
    def json_schema(schema: dict) -> Constraint:
        return Constraint("json_schema", json.dumps(schema, sort_keys=True))

    @staticmethod
    def regex(pattern: str) -> Constraint:
        return Constraint("regex", pattern)

    @staticmethod
    def choice(choices: list[str]) -> Constraint:
        return Constraint("choice", json.dumps(list(choices)))

    @staticmethod
    def grammar(lark: str) -> Constraint:
        return Constraint("grammar", lark)

    def lark(self) -> str:
        """The constraint as llguidance's grammar text."""
        import llguidance

        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(json.loads(self.value), defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            choices = json.loads(self.value)
            return llguidance.LLMatcher.grammar_from_regex("|".join(_regex_literal(c) for c in choices))
        return llguidance.LLMatcher.grammar_from_lark(self.value)


def _regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in r"\.^$|?*+()[]{}/" else c for c in text)


def require_llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise InvalidArgumentError(
            "structured outputs need llguidance: pip install 'specdecode[structured]'", "constraint"
        ) from None
    return llguidance


class Grammars:
    """A tokenizer's grammars, each compiled and checked once, the latest MAX_GRAMMARS kept (a
    server's clients choose them): one per engine, used from the server's threads too."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self.hf_tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._compiled: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()

    @cached_property
    def tokenizer(self):
        llguidance = require_llguidance()
        eos = self.eos or None
        try:
            return llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        except (ValueError, TypeError, RuntimeError) as error:  # a tokenizer llguidance cannot read
            raise InvalidArgumentError(
                f"structured outputs cannot use this model's tokenizer ({error}); "
                "llguidance reads byte-level BPE and SentencePiece tokenizers",
                "constraint",
            ) from None

    def grammar(self, constraint: Constraint) -> str:
        """The constraint's grammar, checked; a constraint llguidance refuses (a bad schema,
        pattern or grammar) is an error naming it."""
        with self._lock:
            grammar = self._compiled.pop(constraint, None) or self._compile(constraint)
            self._compiled[constraint] = grammar  # the most recent last
            while len(self._compiled) > MAX_GRAMMARS:
                self._compiled.popitem(last=False)
            return grammar

    def matcher(self, constraint: Constraint) -> Matcher:
        """A new matcher at the start of the constraint's grammar."""
        llguidance = require_llguidance()
        return Matcher(llguidance.LLMatcher(self.tokenizer, self.grammar(constraint)), self.vocab_size)

    def _compile(self, constraint: Constraint) -> str:
        llguidance = require_llguidance()
        try:
            grammar = constraint.lark()
        except (ValueError, TypeError, RuntimeError) as error:
            raise InvalidArgumentError(
                f"the {constraint.kind} constraint is not valid: {error}", "constraint"
            ) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise InvalidArgumentError(f"the {constraint.kind} constraint is not valid: {messages[0]}", "constraint")
        return grammar


class Matcher:
    """One sequence's place in its grammar: the tokens it has committed."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def masked(self, logits: torch.Tensor, tokens: list[int], parents: list[int], greedy: bool = False) -> torch.Tensor:
        """logits [1 + len(tokens), vocab] (after the committed tokens, then after each draft
        node) with every token the grammar forbids there set to -inf. parents: each node's
        parent among the nodes, -1 for the root (a chain: i - 1). The matcher is left as it was.

        greedy: only each row's argmax is used (decoding at temperature 0). A row whose argmax
        the grammar allows there keeps its logits: masking removes tokens only, so the masked
        argmax is the same token (ties included: no earlier index reaches the maximum). Only
        the other rows pay for a mask, which costs far more than checking one token."""
        argmax = row_maxima(logits)[1].tolist() if greedy else []  # [1 + len(tokens)]
        masks = {}  # row -> the tokens allowed there, for the rows that need a mask
        for node in range(-1, len(tokens)):
            path = _path(node, tokens, parents) if node >= 0 else []
            if greedy and self._keeps_argmax(path, argmax[node + 1]):
                continue
            masks[node + 1] = self.allowed() if node < 0 else self._allowed_after(path)
        if not masks:
            return logits
        masked = logits.clone()
        for row, allowed in masks.items():
            masked[row].masked_fill_(~allowed, float("-inf"))
        return masked

    def _keeps_argmax(self, path: list[int], argmax: int) -> bool:
        """Whether the row after path needs no mask for its argmax: the grammar allows the argmax
        there, or forbids the path itself (the row is never reached)."""
        if self.matcher.is_stopped():
            return False
        return self.matcher.validate_tokens(path + [argmax]) != len(path)

    def _allowed_after(self, path: list[int]) -> torch.Tensor:
        """The mask after a draft path. Where the grammar forbids the path, the row after it is
        never reached (its node is rejected: probability 0): no mask, so that its logits stay
        finite. A forbidden token is never consumed: it would leave the matcher in error for good."""
        if self.matcher.validate_tokens(path) < len(path):
            return torch.ones(self.vocab_size, dtype=torch.bool)
        consumed = self.matcher.try_consume_tokens(path)
        allowed = self.allowed() if consumed == len(path) else torch.ones(self.vocab_size, dtype=torch.bool)
        self.matcher.rollback(consumed)
        return allowed

    def forced(self, most: int) -> list[int]:
        """Up to `most` tokens the grammar forces next (keys, quotes, braces, the rest of an
        enum value): a draft that costs nothing, verified like any other."""
        return self.matcher.compute_ff_tokens()[:most] if most > 0 else []

    def checked_chain(self, forced: list[int], chain: list[int], most: int) -> tuple[int, list[int]]:
        """For a drafter's chain behind the forced tokens: how many of its tokens the grammar
        allows (the rest would be rejected for certain: the constrained target gives them
        probability 0), and up to `most` tokens the grammar forces after those. The matcher is
        left as it was."""
        valid = self.matcher.validate_tokens(forced + chain)
        keep = max(0, valid - len(forced))
        if keep == 0 or most <= 0:
            return keep, []
        consumed = self.matcher.try_consume_tokens(forced + chain[:keep])
        after = self.matcher.compute_ff_tokens()[:most] if consumed == len(forced) + keep else []
        self.matcher.rollback(consumed)
        return keep, after

    def advance(self, tokens: list[int]) -> None:
        """Commit a step's emitted tokens (accepted drafts and the next token), each one the
        masked logits allowed. Once the grammar is complete it takes no token: the one allowed
        then is an EOS, which ends the sequence."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")


def _path(node: int, tokens: list[int], parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]
