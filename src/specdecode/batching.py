"""Continuous batching of speculative decoding: one step advances every active sequence.

Vocabulary: a *sequence* is one generation (a request); a *slot* is the KV cache it holds in
the BatchRunner while it is active. One step:
1. draft: each sequence's drafter proposes up to its k tokens (ragged: some propose none);
2. verify: the target runs every sequence's uncached tokens and drafts in ONE forward;
3. accept: each sequence applies the accept/reject rule with its own sampling params and
   generator, keeps its own number of tokens (ragged acceptance) and rolls its cache back.
Sequences join (`add`) and leave (`remove`) between steps.

Exactness: a sequence is verified by the same `verify`, on the same logits, as when it runs
alone; batching only decides which tokens share a matrix product. k follows the measured
acceptance and step costs of the whole batch (adaptive.AdaptiveK), down to plain batched
decoding (k = 0) when drafting no longer pays; seeded sampling always drafts the most k, so
that its samples repeat whatever else is in the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.adaptive import AdaptiveK, StepCosts
from specdecode.batch_runner import BatchRunner
from specdecode.drafters.base import Draft, Drafter
from specdecode.sampling import SamplingParams
from specdecode.stats import GenerationStats
from specdecode.stopping import Stop, StoppingCriteria
from specdecode.verification import verify_logits


@dataclass
class BatchSequence:
    prompt_ids: list[int]
    params: SamplingParams
    stopping: StoppingCriteria
    generator: torch.Generator
    drafter: Drafter | None  # this sequence's own (drafters keep per-sequence state)
    fixed_k: bool = False  # draft the most k every step: seeded sampling, whose samples must repeat
    generated: list[int] = field(default_factory=list)
    stats: GenerationStats | None = None
    slot: int | None = None
    cached: int = 0  # leading tokens of `tokens` held in the slot's cache
    finish: Stop | None = None  # set by the step that ends the sequence
    tag: object = None  # the caller's own record of this sequence (the server's request handle)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids) + self.generated  # a resumed sequence keeps what it had


class BatchDecoder:
    def __init__(self, runner: BatchRunner, num_speculative_tokens: int, adaptive: bool = True):
        self.runner = runner
        self.k_max = num_speculative_tokens
        self.adaptive = adaptive
        self.costs = StepCosts()  # seconds of a verification forward, by the tokens in it (all sequences)
        self.policy = AdaptiveK(self.costs)  # acceptance pooled over every sequence
        self.active: list[BatchSequence] = []
        self._free = list(range(runner.num_slots))[::-1]

    @property
    def has_room(self) -> bool:
        return bool(self._free)

    def add(self, seq: BatchSequence) -> None:
        """Start (or resume, after a restart) seq at the next step."""
        seq.slot, seq.cached = self._free.pop(), 0
        self.runner.crop(seq.slot, 0)
        if seq.stats is None:
            k = self.k_max if seq.drafter is not None else 0
            seq.stats = GenerationStats(seq.drafter.name if k else "none", k, "adaptive" if self.adaptive and k else "fixed")
        if seq.drafter is not None:
            seq.drafter.begin(seq.prompt_ids)
        self.active.append(seq)

    def remove(self, seq: BatchSequence) -> None:
        self.active.remove(seq)
        self._free.append(seq.slot)
        seq.slot = None

    def reset(self) -> None:
        """Forget every cache (after a crash): active sequences re-run their tokens at the next step."""
        for seq in self.active:
            seq.cached = 0
            self.runner.crop(seq.slot, 0)

    def step(self, sequences: list[BatchSequence] | None = None) -> list[tuple[BatchSequence, list[int]]]:
        """Advance every active sequence (or just `sequences`) once; the tokens each emitted. A
        sequence whose `finish` is set afterwards is done (its tokens past the stop are cut).

        Nothing a sequence keeps changes before the target forward has succeeded, so a step
        that raised can simply be run again."""
        sequences = self.active if sequences is None else sequences
        k = self._choose_k(sequences)
        drafts = [self._draft(seq, k) for seq in sequences]
        for seq in sequences:
            self.runner.crop(seq.slot, seq.cached)  # also undoes a failed earlier attempt of this step
        new_tokens = [torch.tensor(s.tokens[s.cached :] + d.tokens.tolist()) for s, d in zip(sequences, drafts)]
        start = time.perf_counter()
        logits = self.runner.forward([s.slot for s in sequences], new_tokens, [len(d) + 1 for d in drafts])
        emitted = [self._accept(seq, draft, seq_logits) for seq, draft, seq_logits in zip(sequences, drafts, logits)]
        if all(n.shape[0] == len(d) + 1 for n, d in zip(new_tokens, drafts)):  # no prefill: a decoding step's cost
            self.costs.record(sum(n.shape[0] for n in new_tokens), time.perf_counter() - start)
        return list(zip(sequences, emitted))

    def _choose_k(self, sequences: list[BatchSequence]) -> int:
        if not self.adaptive or not any(s.drafter is not None for s in sequences):
            return self.k_max
        return self.policy.choose(self.k_max, batch_size=len(sequences))

    def _draft(self, seq: BatchSequence, k: int) -> Draft:
        k = self.k_max if seq.fixed_k else k
        room = min(seq.stopping.max_new_tokens - len(seq.generated), self.runner.max_length - len(seq.tokens))
        prefill = len(seq.tokens) - seq.cached > 1  # runs alone, as in target-only decoding (engine.py)
        if seq.drafter is None or k == 0 or room <= 1 or prefill:  # drafting past the budget is waste
            return Draft.empty()
        start = time.perf_counter()
        draft = seq.drafter.propose(seq.tokens, min(k, room - 1), seq.params, seq.generator)
        self.policy.record_draft(len(draft), time.perf_counter() - start)
        if not len(draft):
            # the batch's forward grows with k whether this sequence drafts or not, so for the
            # policy a sequence that had nothing to propose (no n-gram match) gained nothing
            self.policy.record_verdict(1, 0)
        return draft

    def _accept(
        self,
        seq: BatchSequence,
        draft: Draft,
        logits: torch.Tensor,  # [len(draft) + 1, vocab] after the last token and each draft token
    ) -> list[int]:
        verdict = verify_logits(draft.tokens, draft.probs, logits, seq.params, seq.generator)
        if seq.drafter is not None:
            seq.drafter.observe(len(draft), verdict.num_accepted)
            self.policy.record_verdict(len(draft), verdict.num_accepted)
        emitted = draft.tokens[: verdict.num_accepted].tolist() + [verdict.next_token]
        seq.stats.record_step(len(draft), verdict.num_accepted, draft.source)
        seq.cached = len(seq.tokens) + verdict.num_accepted  # the next token is not in the cache yet
        seq.tokens += emitted
        seq.generated += emitted
        seq.finish = seq.stopping.check(
            seq.generated, len(emitted), context_full=len(seq.tokens) >= self.runner.max_length
        )
        if seq.finish is not None:
            cut = len(seq.generated) - seq.finish.keep
            del seq.generated[seq.finish.keep :]
            emitted = emitted[: max(0, len(emitted) - cut)]  # a stop string may end in an earlier step's tokens
            seq.stats.generated_tokens = len(seq.generated)
        return emitted


def decode_all(decoder: BatchDecoder, sequences: list[BatchSequence]) -> None:
    """Decode every sequence to its end, each joining as a slot frees up; a sequence's
    stats.wall_time_s is the time from the start of this call to its end."""
    waiting, start = list(sequences), time.perf_counter()
    while waiting or decoder.active:
        while waiting and decoder.has_room:
            decoder.add(waiting.pop(0))
        for seq, _ in decoder.step():
            if seq.finish is not None:
                decoder.remove(seq)
                seq.stats.wall_time_s = time.perf_counter() - start
