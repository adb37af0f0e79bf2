"""The decode loop: one step advances every active sequence, one sequence or many.

Vocabulary (the rule's own words are in core/verification.py): a *sequence* is one
generation (a request, or one choice of it); a *slot* is the KV cache it holds while it is
active (runners/slots.py); a *step* is one target forward. `Decoder.step` runs the phases:

0. roll back: each slot's cache is cropped to the sequence's accepted prefix (the rejected
   drafts' positions are overwritten next), and the runner's own length is the truth:
   what it no longer holds (after a failed forward it could not undo) is run again;
1. prefill: a sequence whose prompt is not cached (a new one, or one whose cache was lost)
   runs its prompt alone from an empty cache and drafts nothing, exactly as target-only
   decoding does, so both start from the same cache (the fast paths' half precision relies
   on it). A rebuilt sequence's prefill decides nothing: its next token is known;
2. draft: each other sequence's drafters propose up to its k tokens (ragged: some propose
   none); k is chosen here, from what was measured (core/adaptive.py);
3. verify: the target runs every sequence's uncached tokens and drafts in ONE forward. A
   rebuilt sequence's generated tokens (uncached but its last) run here too, with every
   row's logits asked for: the fast paths then attend one query at a time, as when those
   tokens were first decoded or verified, so their cache and the next logits are bitwise
   those of the uninterrupted run ("rebuild" below);
4. accept: each sequence applies the accept/reject rule with its own sampling params and
   generator and keeps its own number of tokens (ragged acceptance); every verdict and
   every stop is decided before anything is changed, so a step that raises changes
   nothing (the generators are restored) and can simply be run again;
5. commit: tokens appended, the cache's length set to the accepted prefix, stats, stopping.

Exactness: a sequence is verified by the same rule, on the same logits, whether it runs
alone or in a batch; batching only decides which tokens share a matrix product. k depends
only on past steps, so it never changes what is generated; seeded sampling drafts its
most k every step, so that its samples repeat whatever else ran before or beside it. A
target whose cache cannot roll back (runner.rolls_back False: a recurrent state) decodes
target-only, and its stats say why.

Rebuild: a sequence whose cache was lost (`reset`, after an engine crash; a failed forward
its runner could not undo) is computed again as it was first computed: prefill (1), then its
generated tokens through the verification path (3), so it goes on bit for bit where its runner
is batch invariant. A sampled sequence that lived through a failure loses its response-cache
key: its draws follow its drafts, and a draft model's cache is then rebuilt in other chunks,
which may round its probabilities otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from specdecode.core.adaptive import AdaptiveK, StepCosts
from specdecode.core.sampling import SamplingParams
from specdecode.core.stats import GenerationStats
from specdecode.core.stopping import Stop, StoppingCriteria
from specdecode.core.verification import Verdict, verify_logits
from specdecode.drafters.base import Draft, Drafter
from specdecode.runners.base import ModelRunner
from specdecode.runners.slots import SlotPool


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    stopping: StoppingCriteria
    generator: torch.Generator
    drafters: tuple[Drafter, ...] = ()  # this sequence's candidates, first that proposes drafts
    k_max: int = 0  # most tokens drafted per step; 0: target-only
    fixed_k: bool = False  # draft k_max every step: seeded sampling, whose samples must repeat
    drafter_name: str = "none"  # what the stats call the drafters ("auto" for several)
    generated: list[int] = field(default_factory=list)
    stats: GenerationStats | None = None
    slot: int | None = None
    cached: int = 0  # leading tokens of `tokens` held in the slot's cache
    finish: Stop | None = None  # set by the step that ends the sequence
    tag: object = None  # the caller's own record of this sequence (the server's request handle)
    cache_key: str | None = None  # its key in the engine's response cache, when it may be cached

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids) + self.generated  # a resumed sequence keeps what it had

    @property
    def prefilling(self) -> bool:
        """More than its last token is uncached: a prompt, or a cache being rebuilt; the step is
        no decoding step (its cost says nothing of a decoding step's)."""
        return len(self.tokens) - self.cached > 1

    @property
    def prompt_uncached(self) -> bool:
        """Its next step prefills the prompt (phase 1)."""
        return self.prefilling and self.cached < len(self.prompt_ids)

    @property
    def rebuilding(self) -> bool:
        """Generated tokens of its own are not in its cache (it was lost): it is being rebuilt."""
        return self.prefilling and len(self.generated) > 0


@dataclass(frozen=True)
class _Decision:
    """What one step decided for one sequence, applied only once every sequence has one."""

    verdict: Verdict
    emitted: list[int]  # accepted drafts + the recovered or bonus token
    finish: Stop | None


# why a target whose cache cannot roll back decodes target-only (its stats say it)
NO_ROLLBACK_NOTE = (
    "target-only: this model's cache keeps a recurrent state that cannot be rolled back past "
    "rejected drafts, so nothing was drafted"
)


class Decoder:
    """One per engine, so that measured costs and acceptance carry across calls."""

    def __init__(self, runner: ModelRunner, adaptive: bool = True, max_length: int | None = None):
        """max_length: the most tokens (prompt + generated) a sequence holds; a sequence that
        reaches it ends with finish reason "length" (default: the model's context)."""
        self.max_length = runner.max_length if max_length is None else max_length
        self.slots = SlotPool(runner, self.max_length)
        self.adaptive = adaptive
        self.capacity = 1  # most sequences active at once
        self.costs = StepCosts()  # seconds of a verification forward, by the tokens in it (all sequences)
        self._sizes_run: set[int] = set()  # forward sizes run at least once (see _record_cost)
        self.policies: dict[str, AdaptiveK] = {}  # drafter name -> its acceptance, pooled over sequences
        self.active: list[Sequence] = []

    @property
    def has_room(self) -> bool:
        return len(self.active) < self.capacity

    def add(self, seq: Sequence) -> None:
        """Start (or resume, after a restart) seq at the next step."""
        seq.slot, seq.cached = self.slots.acquire(), 0
        note = None
        if seq.k_max and seq.drafters and not self.slots.runner.rolls_back:
            seq.k_max, seq.drafters, note = 0, (), NO_ROLLBACK_NOTE  # drafts would stay in its state
        if seq.stats is None:
            k = seq.k_max if seq.drafters else 0
            policy = "adaptive" if self.adaptive and k and not seq.fixed_k else "fixed"
            seq.stats = GenerationStats(seq.drafter_name if k else "none", k, policy, note=note)
        for drafter in seq.drafters:
            drafter.begin(seq.prompt_ids)
        self.active.append(seq)

    def remove(self, seq: Sequence) -> None:
        """seq leaves, and its slot is free, even if a drafter's finish raises (a store's write)."""
        try:
            for drafter in seq.drafters:
                drafter.finish(seq.tokens)
        finally:
            self.active.remove(seq)
            self.slots.release(seq.slot)
            seq.slot = None

    def reset(self) -> None:
        """Forget every cache (after a crash): each active sequence is rebuilt from its tokens,
        as they were first computed (module docstring, "Rebuild")."""
        for seq in self.active:
            seq.cached = 0
            self.slots.crop(seq.slot, 0)
            _lived_through_a_failure(seq)

    def step(
        self, sequences: list[Sequence] | None = None, after_forward: Callable[[], None] | None = None
    ) -> list[tuple[Sequence, list[int]]]:
        """Advance every active sequence (or just `sequences`) once; the tokens each emitted. A
        sequence whose `finish` is set afterwards is done (its tokens past the stop are cut).
        All or nothing: if this raises, no sequence has changed, but for what it lost (cached
        tokens its runner could not keep, which the next step runs again; a sampled sequence's
        response-cache key). after_forward: called once the target forward has run (the
        server's fault injection)."""
        sequences = self.active if sequences is None else sequences
        states = [seq.generator.get_state() for seq in sequences]
        try:
            self._roll_back(sequences)
            drafts = self._draft(sequences)
            forward_tokens = sum(len(seq.tokens) - seq.cached + len(d) for seq, d in zip(sequences, drafts))
            start = time.perf_counter()
            logits = self._verify(sequences, drafts)
            if after_forward is not None:
                after_forward()
            decisions = [self._decide(*args) for args in zip(sequences, drafts, logits, strict=True)]
        except BaseException:
            for seq, state in zip(sequences, states, strict=True):
                seq.generator.set_state(state)  # a retried step draws the same numbers
                _lived_through_a_failure(seq)
            raise
        if not any(seq.prefilling for seq in sequences):  # a decoding step's cost, for adaptive k
            self._record_cost(forward_tokens, time.perf_counter() - start)
        return [
            (seq, self._commit(seq, d, decision)) for seq, d, decision in zip(sequences, drafts, decisions, strict=True)
        ]

    # --- phases ---

    def _roll_back(self, sequences: list[Sequence]) -> None:
        """Phase 0: every slot back to its sequence's accepted prefix, or to what it still holds."""
        for seq in sequences:
            self.slots.crop(seq.slot, seq.cached)  # rolls back rejected drafts, and a failed attempt
            # the runner's length is the truth: after a failed forward it may hold less
            seq.cached = min(seq.cached, self.slots.cache_length(seq.slot))
            if seq.cached < len(seq.prompt_ids):  # a prompt is prefilled whole, from empty, as at first
                seq.cached = 0
                self.slots.crop(seq.slot, 0)

    def _draft(self, sequences: list[Sequence]) -> list[Draft]:
        chosen: dict[str, int] = {}  # this step's k per drafter, chosen on first use
        k_max = max(seq.k_max for seq in sequences)
        return [self._propose(seq, chosen, k_max, len(sequences)) for seq in sequences]

    def _propose(self, seq: Sequence, chosen: dict[str, int], k_max: int, batch_size: int) -> Draft:
        room = min(seq.stopping.max_new_tokens - len(seq.generated), self.max_length - len(seq.tokens))
        if seq.k_max == 0 or room <= 1 or seq.prompt_uncached:  # drafting past the budget is waste
            return Draft.empty()
        for drafter in seq.drafters:
            k = min(self._k(seq, drafter.name, chosen, k_max, batch_size), room - 1)
            if k == 0:
                continue
            start = time.perf_counter()
            draft = drafter.propose(seq.tokens, k, seq.params, seq.generator)
            policy = self._policy(drafter.name)
            policy.record_draft(len(draft), time.perf_counter() - start)
            if len(draft):
                return replace(draft, source=drafter.name)
            if batch_size > 1:
                # the batch's forward grows with the others' drafts whether this sequence
                # drafts or not, so for the policy proposing nothing gained nothing
                policy.record_verdict(1, 0)
        return Draft.empty()

    def _k(self, seq: Sequence, name: str, chosen: dict[str, int], k_max: int, batch_size: int) -> int:
        if seq.fixed_k or not self.adaptive:
            return seq.k_max
        if name not in chosen:  # one choice per drafter and step: the policy counts steps
            chosen[name] = self._policy(name).choose(k_max, batch_size)
        return min(chosen[name], seq.k_max)

    def _verify(self, sequences: list[Sequence], drafts: list[Draft]) -> list[torch.Tensor]:
        """One target forward: [len(draft) + 1, vocab] logits per sequence, after its last
        token and after each of its draft tokens (a prefill's: [1, vocab], after its prompt).
        A rebuilt sequence asks for every new row's logits, so that the fast paths run them
        one query at a time, as they first ran (module docstring); only the last are kept."""
        new_tokens, num_logits = [], []
        for seq, draft in zip(sequences, drafts, strict=True):
            end = len(seq.prompt_ids) if seq.prompt_uncached else len(seq.tokens)
            new_tokens.append(torch.tensor(seq.tokens[seq.cached : end] + draft.tokens.tolist()))
            num_logits.append(1 if seq.prompt_uncached else len(new_tokens[-1]))
        logits = self.slots.forward([s.slot for s in sequences], new_tokens, num_logits)
        return [rows[rows.shape[0] - len(d) - 1 :] for rows, d in zip(logits, drafts, strict=True)]

    def _decide(self, seq: Sequence, draft: Draft, logits: torch.Tensor) -> _Decision | None:
        if seq.prompt_uncached and seq.rebuilding:
            return None  # its next token is known: the prefill only rebuilt the prompt's cache
        verdict = verify_logits(draft.tokens, draft.probs, logits, seq.params, seq.generator)
        emitted = draft.tokens[: verdict.num_accepted].tolist() + [verdict.next_token]
        context_full = len(seq.tokens) + len(emitted) >= self.max_length
        return _Decision(verdict, emitted, seq.stopping.check(seq.generated + emitted, len(emitted), context_full))

    def _commit(self, seq: Sequence, draft: Draft, decision: _Decision | None) -> list[int]:
        if decision is None:  # a rebuilt prompt
            seq.stats.record_replay(len(seq.prompt_ids), forward=True)
            seq.cached = len(seq.prompt_ids)
            return []
        accepted, emitted = decision.verdict.num_accepted, decision.emitted
        if len(draft):
            self._policy(draft.source).record_verdict(len(draft), accepted)
            next(d for d in seq.drafters if d.name == draft.source).observe(len(draft), accepted)
        seq.stats.record_step(len(draft), accepted, draft.source if len(seq.drafters) > 1 else None)
        if seq.rebuilding:
            seq.stats.record_replay(len(seq.tokens) - seq.cached - 1)  # run again, but the last
        seq.cached = len(seq.tokens) + accepted  # the next token is not in the cache yet
        seq.tokens += emitted
        seq.generated += emitted
        seq.finish = decision.finish
        if seq.finish is not None:
            cut = len(seq.generated) - seq.finish.keep
            del seq.generated[seq.finish.keep :]
            emitted = emitted[: max(0, len(emitted) - cut)]  # a stop string may end in an earlier step's tokens
            seq.stats.generated_tokens = len(seq.generated)
        return emitted

    def _record_cost(self, tokens: int, seconds: float) -> None:
        # The first forward of a size pays one-time costs (oneDNN and MKL choose and pack kernels
        # for the new shape; measured here: 69 ms for 5 tokens, about 50 later): recorded, it
        # would make drafting look dear, and k = 0 chosen from it would never time that size again.
        if tokens in self._sizes_run:
            self.costs.record(tokens, seconds)
        self._sizes_run.add(tokens)

    def _policy(self, name: str) -> AdaptiveK:
        if name not in self.policies:
            self.policies[name] = AdaptiveK(self.costs)
        return self.policies[name]


def _lived_through_a_failure(seq: Sequence) -> None:
    """A sampled sequence's answer is cached only if no failure touched it (module docstring,
    "Rebuild"); a greedy one's does not depend on its drafts."""
    if not seq.params.greedy:
        seq.cache_key = None


def decode_all(decoder: Decoder, sequences: list[Sequence]) -> None:
    """Decode every sequence to its end, each joining as a slot frees up; a sequence's
    stats.wall_time_s is the time from its start to its end."""
    waiting = list(sequences)
    started: dict[int, float] = {}
    while waiting or decoder.active:
        while waiting and decoder.has_room:
            seq = waiting.pop(0)
            started[id(seq)] = time.perf_counter()
            decoder.add(seq)
        for seq, _ in decoder.step():
            if seq.finish is not None:
                decoder.remove(seq)
                seq.stats.wall_time_s = time.perf_counter() - started[id(seq)]
