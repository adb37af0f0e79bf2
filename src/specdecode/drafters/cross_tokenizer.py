"""A draft model with a different tokenizer: it continues the text, and its text is
re-encoded into target tokens.

The draft decodes greedily, so its proposal is a deterministic function of the target's
tokens: a one-hot drafter, exact under greedy decoding and under sampling alike (the
target accepts a token t with probability p(t) and otherwise samples from p without t).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from specdecode.core.sampling import SamplingParams
from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.identity import runner_fingerprint, tokenizer_digest
from specdecode.runners import CachedSequence, ModelRunner

TAIL_TOKENS = 4  # target tokens re-encoded with the draft text, so a word split at the boundary merges


class CrossTokenizerDrafter(Drafter):
    name = "cross-tokenizer"
    per_sequence = False  # one draft model cache, shared: batches of one sequence
    depends_on_history = False
    drafts_trees = False

    def __init__(
        self,
        runner: ModelRunner,
        draft_tokenizer: PreTrainedTokenizerBase,
        target_tokenizer: PreTrainedTokenizerBase,
    ):
        self.runner = runner
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self._cached = CachedSequence(runner)

    def begin(self, prompt_ids: list[int]) -> None:
        self._cached = CachedSequence(self.runner)

    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        if k <= 0:
            return Draft.empty()
        text = self.target_tokenizer.decode(token_ids)
        context = self.draft_tokenizer(text).input_ids  # re-encoded; the cache keeps the common prefix
        drafted: list[int] = []
        # draft tokens are about as long as target tokens; the draft's context may end first
        for _ in range(min(k, self.runner.max_length - len(context))):
            logits = self._cached.logits(context + drafted)[-1]  # [vocab]
            drafted.append(int(logits.argmax()))
        tokens = self._to_target(token_ids, self._new_text(context, drafted))[:k]
        return Draft(torch.tensor(tokens, dtype=torch.long), None) if tokens else Draft.empty()

    def finish(self, token_ids: list[int]) -> None:
        pass

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def learn(self, token_ids: list[int], draft: Draft, logits: torch.Tensor) -> None:
        pass

    def _new_text(self, context: list[int], drafted: list[int]) -> str:
        # decode with a little context: decoders drop the leading space of a lone first token
        tail = context[-TAIL_TOKENS:]
        before = self.draft_tokenizer.decode(tail, skip_special_tokens=True)
        after = self.draft_tokenizer.decode(tail + drafted, skip_special_tokens=True)
        return after[len(before) :] if after.startswith(before) else ""

    def _to_target(self, token_ids: list[int], new_text: str) -> list[int]:
        """Target tokens for new_text, continuing token_ids."""
        if not new_text:
            return []
        tail = token_ids[-TAIL_TOKENS:]
        joined = self.target_tokenizer.encode(self.target_tokenizer.decode(tail) + new_text, add_special_tokens=False)
        if joined[: len(tail)] == tail:
            return joined[len(tail) :]
        return self.target_tokenizer.encode(new_text, add_special_tokens=False)

    def cache_identity(self) -> list | None:
        fingerprint = runner_fingerprint(self.runner)
        tokenizers = [tokenizer_digest(t) for t in (self.draft_tokenizer, self.target_tokenizer)]
        return None if fingerprint is None or None in tokenizers else [fingerprint, tokenizers]

    def fork(self) -> CrossTokenizerDrafter:
        raise TypeError(f"the {self.name} drafter holds one draft-model cache; it cannot be forked")
