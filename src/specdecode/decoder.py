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
   on it); or, where its runner gives a prompt's suffix bitwise its whole prefill's rows
   (`reuses_prefixes`), after the prefix of it that its slot kept from an earlier sequence
   (runners/slots.py). A rebuilt sequence's prefill decides nothing: its next token is known;
2. draft: each other sequence's drafters propose up to its k tokens (ragged: some propose
   none), a chain or a tree of k nodes, its drafters tried best first (`_ranked`); k is
   chosen here, from what was measured
   (core/adaptive.py: by position for chains, by tree size for drafters of trees; a drafter's
   greedy and sampled sequences are measured apart, `policy_key`). A target that cannot
   verify trees (runner.verifies_trees False) runs a tree's first path, a chain. Under a
   grammar, what it forces leads the draft, and a drafter's chain is cut before the first
   token it forbids and extended by what it forces after the rest (core/constraints.py);
3. verify: the target runs every sequence's uncached tokens and drafts in ONE forward (a
   tree's nodes each attend to the cache, the root and their ancestors). A rebuilt
   sequence's generated tokens (uncached but its last) run here too, with every row's
   logits asked for: the fast paths then attend one query at a time, as when those tokens
   were first decoded or verified, so their cache and the next logits are bitwise those of
   the uninterrupted run ("rebuild" below);
4. accept: each sequence applies the accept/reject rule (a chain's, or a tree's: its
   accepted path) with its own sampling params and generator and keeps its own number of
   tokens (ragged acceptance); every verdict and every stop is decided before anything is
   changed. Then a tree's accepted path has its cache entries moved to consecutive positions
   (`SlotPool.keep`; a path that is the chain prefix needs none: phase 0's crop keeps it),
   and every drafter of each sequence learns what the target predicted (`learn`; a draft head,
   which declares `hidden_layers`, also gets the target's hidden states of the accepted
   tokens from the same forward, `learn_hidden`). A step that raises changes no sequence
   (the generators are restored; a slot whose entries were moved, or half moved, still holds
   the accepted prefix, which phase 0 crops back to or rebuilds) and can simply be run again;
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
import torch.nn.functional as F

from specdecode.core.adaptive import RANK_PROBE_EVERY, AdaptiveK, AdaptiveTree, StepCosts
from specdecode.core.adjustments import NO_ADJUSTMENTS, Adjustments
from specdecode.core.constraints import Matcher
from specdecode.core.logprobs import TokenLogprob, token_logprobs
from specdecode.core.sampling import SamplingParams
from specdecode.core.stats import GenerationStats
from specdecode.core.stopping import Stop, StoppingCriteria
from specdecode.core.verification import Verdict, verify_logits, verify_tree
from specdecode.drafters.base import Draft, Drafter
from specdecode.runners.base import ModelRunner
from specdecode.runners.slots import SlotPool


@dataclass
class SequenceState:
    prompt_ids: list[int]
    params: SamplingParams
    stopping: StoppingCriteria
    generator: torch.Generator
    # this sequence's candidates: the first that proposes drafts, in Decoder._ranked's order
    drafters: tuple[Drafter, ...] = ()
    k_max: int = 0  # most tokens drafted per step; 0: target-only
    fixed_k: bool = False  # draft k_max every step: seeded sampling, whose samples must repeat
    drafter_name: str = "none"  # what the stats call the drafters ("auto" for several)
    generated: list[int] = field(default_factory=list)
    stats: GenerationStats | None = None
    slot: int | None = None
    cached: int = 0  # leading tokens of `tokens` held in the slot's cache
    reused: int = 0  # leading prompt tokens its slot held when it started (runners/slots.py, "prefix reuse")
    finish: Stop | None = None  # set by the step that ends the sequence
    tag: object = None  # the caller's own record of this sequence (the server's request handle)
    cache_key: str | None = None  # its key in the engine's response cache, when it may be cached
    matcher: Matcher | None = None  # its place in a grammar its answer must follow (structured outputs)
    adjustments: Adjustments = NO_ADJUSTMENTS  # logit bias and penalties (core/adjustments.py)
    top_logprobs: int | None = None  # None: no log-probabilities; n: each token's and the n likeliest
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, when asked

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
    emitted: list[int]  # accepted drafts (a tree's accepted path) + the recovered or bonus token
    finish: Stop | None
    logprobs: list[TokenLogprob]  # the emitted tokens', when the sequence asks for them


# why a target whose cache cannot roll back decodes target-only (its stats say it)
NO_ROLLBACK_NOTE = (
    "target-only: this model's cache keeps a recurrent state that cannot be rolled back past "
    "rejected drafts, so nothing was drafted"
)


class Decoder:
    """One per engine, so that measured costs and acceptance carry across calls."""

    def __init__(
        self,
        runner: ModelRunner,
        adaptive: bool = True,
        max_length: int | None = None,
        reuse_prefixes: bool = True,
        costs: StepCosts | None = None,
    ):
        """max_length: the most tokens (prompt + generated) a sequence holds; a sequence that
        reaches it ends with finish reason "length" (default: the model's context).
        reuse_prefixes: a new sequence starts from the longest prefix of its prompt a free
        slot's cache holds, where the runner allows it (runners/slots.py).
        costs: another decoder's measured step costs, to share: they belong to the runner on
        this machine, not to what was asked, so a new decoder on the same runner need not
        measure them again from nothing (acceptance, which depends on the text, stays its own)."""
        self.max_length = runner.max_length if max_length is None else max_length
        self.slots = SlotPool(runner, self.max_length, reuse_prefixes)
        self.adaptive = adaptive
        self.capacity = 1  # most sequences active at once
        # seconds of a verification forward, by the tokens in it (all sequences)
        self.costs = StepCosts() if costs is None else costs
        self._sizes_run: set[int] = set()  # forward sizes run at least once (see _record_cost)
        self._steps = 0  # steps drafted so far: whose turn it is to explore (_draft)
        # policy_key (drafter name, greedy or sampled) -> its acceptance, pooled over sequences:
        # by position for chains, by tree size for trees
        self.policies: dict[str, AdaptiveK | AdaptiveTree] = {}
        self.verifies_trees = runner.verifies_trees  # else a tree's first path runs
        self.active: list[SequenceState] = []

    @property
    def has_room(self) -> bool:
        return len(self.active) < self.capacity

    def add(self, seq: SequenceState) -> None:
        """Start (or resume, after a restart) seq at the next step: from the prefix of its prompt
        its slot holds, if any, whose hidden states its drafters get as the prefill's."""
        note = None
        if seq.k_max and seq.drafters and not self.slots.runner.rolls_back:
            seq.k_max, seq.drafters, note = 0, (), NO_ROLLBACK_NOTE  # drafts would stay in its state
        layers = _hidden_layers_wanted([seq])
        # two tokens at least run: the first step is then a prefill, as without reuse (it drafts
        # nothing, so a seeded sequence draws what it would have drawn)
        seq.slot, seq.cached, hidden = self.slots.acquire_reusing(seq.prompt_ids[:-1], layers)
        seq.reused = seq.cached
        if seq.stats is None:
            k = seq.k_max if seq.drafters else 0
            policy = "adaptive" if self.adaptive and k and not seq.fixed_k else "fixed"
            seq.stats = GenerationStats(seq.drafter_name if k else "none", k, policy, note=note)
        seq.stats.prompt_tokens_reused = seq.reused
        for drafter in seq.drafters:
            drafter.begin(seq.prompt_ids)
            if hidden is not None and drafter.hidden_layers:
                drafter.learn_hidden(0, hidden[:, [layers.index(i) for i in drafter.hidden_layers]])
        self.active.append(seq)

    def remove(self, seq: SequenceState) -> None:
        """seq leaves, and its slot is free, even if a drafter's finish raises (a store's write)."""
        try:
            for drafter in seq.drafters:
                drafter.finish(seq.tokens)
        finally:
            self.active.remove(seq)
            self.slots.release(seq.slot, seq.tokens[: seq.cached])  # kept for a prompt that starts with them
            seq.slot = None

    def reset(self) -> None:
        """Forget every cache (after a crash): each active sequence is rebuilt from its tokens,
        as they were first computed (module docstring, "Rebuild")."""
        self.slots.forget_prefixes()
        for seq in self.active:
            seq.cached = seq.reused = 0
            self.slots.crop(seq.slot, 0)
            _lived_through_a_failure(seq)

    def step(
        self, sequences: list[SequenceState] | None = None, after_forward: Callable[[], None] | None = None
    ) -> list[tuple[SequenceState, list[int]]]:
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
            drafts, asked = self._draft(sequences)
            forward_tokens = sum(len(seq.tokens) - seq.cached + len(d) for seq, d in zip(sequences, drafts))
            start = time.perf_counter()
            layers = _hidden_layers_wanted(sequences)
            logits, hidden = self._verify(sequences, drafts, layers)
            if after_forward is not None:
                after_forward()
            decisions = [self._decide(*args) for args in zip(sequences, drafts, logits, strict=True)]
            for seq, draft, decision in zip(sequences, drafts, decisions, strict=True):
                self._keep_path(seq, draft, decision)
            seconds = time.perf_counter() - start
            for args in zip(sequences, drafts, logits, decisions, hidden, strict=True):
                self._learn(*args, layers)
        except BaseException:
            for seq, state in zip(sequences, states, strict=True):
                seq.generator.set_state(state)  # a retried step draws the same numbers
                _lived_through_a_failure(seq)
            raise
        if not any(seq.prefilling for seq in sequences):  # a decoding step's cost, for adaptive k
            self._record_cost(forward_tokens, seconds)
        return [(seq, self._commit(seq, *args)) for seq, *args in zip(sequences, drafts, decisions, asked, strict=True)]

    # --- phases ---

    def _roll_back(self, sequences: list[SequenceState]) -> None:
        """Phase 0: every slot back to its sequence's accepted prefix, or to what it still holds."""
        for seq in sequences:
            self.slots.crop(seq.slot, seq.cached)  # rolls back rejected drafts, and a failed attempt
            # the runner's length is the truth: after a failed forward it may hold less
            seq.cached = min(seq.cached, self.slots.cache_length(seq.slot))
            if seq.cached < len(seq.prompt_ids):  # a prompt is prefilled whole, as at first: from empty,
                seq.cached = min(seq.cached, seq.reused)  # or after the prefix it reused
                self.slots.crop(seq.slot, seq.cached)

    def _draft(self, sequences: list[SequenceState]) -> tuple[list[Draft], list[int]]:
        """Each sequence's draft, and the k it was asked for (0: nothing asked).

        A policy's choice may explore (a size chosen on its optimism, or a probe out of k = 0):
        one sequence a step explores, in turn, and the others draft the size that pays on what
        was measured (`policy.settled`). Exploring on every sequence of a batch at once made a
        forward of all their trees, paid by the whole batch (docs/serving.md)."""
        chosen: dict[str, tuple[int, int]] = {}  # this step's (explored, settled) k per policy, chosen on first use
        k_max = max(seq.k_max for seq in sequences)
        explorer = sequences[self._steps % len(sequences)]
        self._steps += 1
        proposals = [self._propose(seq, chosen, k_max, len(sequences), seq is explorer) for seq in sequences]
        return [draft for draft, _ in proposals], [k for _, k in proposals]

    def _propose(
        self, seq: SequenceState, chosen: dict[str, tuple[int, int]], k_max: int, batch_size: int, explores: bool
    ) -> tuple[Draft, int]:
        room = min(seq.stopping.max_new_tokens - len(seq.generated), self.max_length - len(seq.tokens))
        if seq.k_max == 0 or room <= 1 or seq.prompt_uncached:  # drafting past the budget is waste
            return Draft.empty(), 0
        # what a grammar forces next leads the draft: free, and verified like any draft
        forced = seq.matcher.forced(room - 1) if seq.matcher is not None else []
        for drafter in self._ranked(seq, batch_size, explores):
            if forced and drafter.hidden_layers:
                continue  # a head has no target features for the forced tokens, which are not verified yet
            k = min(self._k(seq, drafter, chosen, k_max, batch_size, explores), room - 1 - len(forced))
            if k == 0:
                continue
            start = time.perf_counter()
            draft = self._runnable(drafter.propose(seq.tokens + forced, k, seq.params, seq.generator))
            policy = self._policy(drafter, seq.params)
            policy.record_draft(len(draft), time.perf_counter() - start)
            after: list[int] = []
            if seq.matcher is not None and draft.is_chain and len(draft):
                draft, after = _grammar_checked(seq.matcher, forced, draft, room - 1 - len(forced))
            if len(draft):
                draft = _after_forced(forced, replace(draft, source=drafter.name), self.slots.vocab_size)
                return _with_forced_after(draft, after, self.slots.vocab_size), k
            if batch_size > 1:
                # the batch's forward grows with the others' drafts whether this sequence
                # drafts or not, so for the policy proposing nothing gained nothing
                policy.record_no_draft(k)
        return _after_forced(forced, Draft.empty(), self.slots.vocab_size), 0

    def _ranked(self, seq: SequenceState, batch_size: int, explores: bool) -> tuple[Drafter, ...]:
        """seq's drafters in the order it tries them this step: by their policies' expected
        tokens per second, best first, those not measured yet first in their given order
        (core/adaptive.py, "Ranking"); in the given order where k is not chosen from measurements
        (seeded sampling's drafts must not depend on timings), and on every RANK_PROBE_EVERY-th
        step that explores, so that a drafter ranked low is measured again."""
        drafters = seq.drafters
        if len(drafters) < 2 or seq.fixed_k or not self.adaptive or (explores and self._steps % RANK_PROBE_EVERY == 0):
            return drafters
        rates = [self._policy(drafter, seq.params).rate(batch_size) for drafter in drafters]
        order = sorted(range(len(drafters)), key=lambda i: (rates[i] is not None, -(rates[i] or 0.0), i))
        return tuple(drafters[i] for i in order)

    def _runnable(self, draft: Draft) -> Draft:
        """The draft as this target verifies it: a tree's first path where trees cannot be
        verified; a tree that is a chain as a chain (the chain rule, and its random numbers)."""
        if draft.is_chain:
            return draft
        if not self.verifies_trees or draft.parent_list() == list(range(-1, len(draft) - 1)):
            return draft.first_path()
        return draft

    def _k(
        self,
        seq: SequenceState,
        drafter: Drafter,
        chosen: dict[str, tuple[int, int]],
        k_max: int,
        batch_size: int,
        explores: bool,
    ) -> int:
        if seq.fixed_k or not self.adaptive:
            return seq.k_max
        key = policy_key(drafter.name, seq.params)
        if key not in chosen:  # one choice per policy and step: the policy counts steps
            policy = self._policy(drafter, seq.params)
            chosen[key] = (policy.choose(k_max, batch_size), policy.settled)
        explored, settled = chosen[key]
        return min(explored if explores else settled, seq.k_max)

    def _verify(
        self, sequences: list[SequenceState], drafts: list[Draft], layers: tuple[int, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One target forward: [len(draft) + 1, vocab] logits per sequence, after its last
        token and after each of its draft tokens (a prefill's: [1, vocab], after its prompt).
        A rebuilt sequence asks for every new row's logits, so that the fast paths run them
        one query at a time, as they first ran (module docstring); only the last are kept.
        And, where layers are asked for (a draft head's), the target's hidden states of those
        layers for every new row of each sequence [n_i, len(layers), hidden] (None where its
        runner keeps none), from the same forward. A prompt another sequence of the step
        prefills too is run once (`_shared_prefills`): its other sequences copy its rows."""
        shared = self._shared_prefills(sequences)
        ran = [i for i in range(len(sequences)) if i not in shared]
        new_tokens, num_logits, parents = [], [], []
        for seq, draft in ((sequences[i], drafts[i]) for i in ran):
            end = len(seq.prompt_ids) if seq.prompt_uncached else len(seq.tokens)
            uncached = seq.tokens[seq.cached : end]
            new_tokens.append(torch.tensor(uncached + draft.tokens.tolist()))
            num_logits.append(1 if seq.prompt_uncached else len(new_tokens[-1]))
            parents.append(None if draft.is_chain else _forward_parents(len(uncached), draft))
        slots = [sequences[i].slot for i in ran]
        runners = [self.slots.runner] + [self.slots.slots[s] for s in slots]
        for runner in runners:  # set only when it changes: a fast runner's setter clears what it kept
            if runner.hidden_layers != layers:
                runner.hidden_layers = layers
        if any(p is not None for p in parents):
            logits = self.slots.forward(slots, new_tokens, num_logits, parents)
        else:
            logits = self.slots.forward(slots, new_tokens, num_logits)
        hidden = self._hidden_states(slots, new_tokens) if layers else [None] * len(slots)
        results = dict(zip(ran, zip(logits, hidden, strict=True), strict=True))
        for follower, leader in shared.items():
            seq, lead = sequences[follower], sequences[leader]
            self.slots.copy_rows(lead.slot, seq.slot, len(seq.prompt_ids))
            rows, states = results[leader]
            results[follower] = rows.clone(), None if states is None else states[seq.cached - lead.cached :]
        logits = [results[i][0] for i in range(len(sequences))]
        hidden = [results[i][1] for i in range(len(sequences))]
        return [rows[rows.shape[0] - len(d) - 1 :] for rows, d in zip(logits, drafts, strict=True)], hidden

    def _shared_prefills(self, sequences: list[SequenceState]) -> dict[int, int]:
        """Sequences of this step whose prompt another one prefills in it (the n choices of a
        request, or one prompt sent twice): follower index -> its leader, the one with the
        fewest tokens of that prompt cached, whose new rows cover the others'. Only where the
        runner reuses prefixes: there the rows of a prompt are the same bits in any company,
        so a copy is what the follower's own prefill would have written."""
        if not self.slots.reuses_prefixes:
            return {}
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, seq in enumerate(sequences):
            if seq.prompt_uncached:
                groups.setdefault(tuple(seq.prompt_ids), []).append(i)
        shared = {}
        for members in groups.values():
            leader = min(members, key=lambda i: sequences[i].cached)
            shared.update({i: leader for i in members if i != leader})
        return shared

    def _hidden_states(self, slots: list[int], new_tokens: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """What the last forward kept of each slot's new rows: from the runner that ran the batch
        (a list per sequence) or from each slot's; None where it kept nothing for them."""
        if self.slots.runner.stacks_sequences and len(slots) > 1:
            found = self.slots.runner.hidden or [None] * len(slots)
        else:
            found = [self.slots.slots[s].hidden for s in slots]
            found = [h[0] if isinstance(h, list) else h for h in found]  # a forward run as a batch of one
        return [h if h is not None and h.shape[0] == len(t) else None for h, t in zip(found, new_tokens, strict=True)]

    def _decide(self, seq: SequenceState, draft: Draft, logits: torch.Tensor) -> _Decision | None:
        if seq.prompt_uncached and seq.rebuilding:
            return None  # its next token is known: the prefill only rebuilt the prompt's cache
        target = _requested_target(seq, draft, logits)
        if draft.is_chain:
            verdict = verify_logits(draft.tokens, draft.probs, target, seq.params, seq.generator)
        else:
            verdict = verify_tree(draft.tokens, draft.parents, target, seq.params, seq.generator)
        drafted = draft.tokens.tolist()
        emitted = [drafted[node] for node in verdict.path] + [verdict.next_token]
        logprobs = []
        if seq.top_logprobs is not None:  # from the rows each emitted token was drawn at
            rows = [0] + [1 + node for node in verdict.path]
            logprobs = token_logprobs(logits[rows], emitted, seq.top_logprobs)
        context_full = len(seq.tokens) + len(emitted) >= self.max_length
        finish = seq.stopping.check(seq.generated + emitted, len(emitted), context_full)
        return _Decision(verdict, emitted, finish, logprobs)

    def _keep_path(self, seq: SequenceState, draft: Draft, decision: _Decision | None) -> None:
        """A tree's accepted path to consecutive cache positions after the uncached tokens,
        unless it is the chain prefix (which phase 0's crop keeps as it is)."""
        if decision is None or draft.is_chain:
            return
        path = decision.verdict.path
        if path == tuple(range(len(path))):
            return
        uncached = len(seq.tokens) - seq.cached
        self.slots.keep(seq.slot, seq.cached, list(range(uncached)) + [uncached + i for i in path])

    def _learn(
        self,
        seq: SequenceState,
        draft: Draft,
        logits: torch.Tensor,
        decision: _Decision | None,
        hidden: torch.Tensor | None,  # [uncached + len(draft), len(layers), hidden]
        layers: tuple[int, ...],
    ) -> None:
        """Every drafter of the sequence sees what the target predicted: logits [len(draft) + 1,
        vocab] after its last token and after each draft node (a prefill's: one row). A drafter
        that declares hidden_layers (a draft head) gets the target's hidden states of the tokens
        now accepted, the uncached ones and the accepted path, at their positions from
        seq.cached on (written again at the same positions if the step is run again)."""
        if decision is None:
            return  # a rebuilt prompt: its drafters learnt it when it was first run
        if hidden is not None:  # the accepted tokens' rows
            uncached = hidden.shape[0] - len(draft)
            hidden = hidden[list(range(uncached)) + [uncached + i for i in decision.verdict.path]]
            self.slots.record_hidden(seq.slot, seq.cached, hidden, layers)
        for drafter in seq.drafters:
            drafter.learn(seq.tokens, draft, logits)
            wanted = drafter.hidden_layers
            if wanted and hidden is not None:
                drafter.learn_hidden(seq.cached, hidden[:, [layers.index(layer) for layer in wanted]])

    def _commit(self, seq: SequenceState, draft: Draft, decision: _Decision | None, asked: int) -> list[int]:
        if decision is None:  # a rebuilt prompt
            seq.stats.record_replay(len(seq.prompt_ids), forward=True)
            seq.cached = len(seq.prompt_ids)
            return []
        accepted, emitted = decision.verdict.num_accepted, decision.emitted
        # the drafter's part: between the grammar's forced tokens, which lead the draft as a
        # chain, and those it forces after a drafter's chain
        drafted = len(draft) - draft.forced - draft.forced_after
        kept = min(max(0, accepted - draft.forced), drafted)
        if drafted:  # a tree's size and accepted depth
            self.policies[policy_key(draft.source, seq.params)].record_verdict(drafted, kept, asked)
            next(d for d in seq.drafters if d.name == draft.source).observe(drafted, kept)
        depths = None if draft.is_chain else [d - draft.forced for d in draft.depths()[draft.forced :]]
        seq.stats.record_step(drafted, kept, draft.source if len(seq.drafters) > 1 and drafted else None, depths)
        if draft.forced or draft.forced_after:
            forced_kept = min(accepted, draft.forced) + max(0, accepted - draft.forced - drafted)
            seq.stats.record_forced(draft.forced + draft.forced_after, forced_kept)
        if seq.rebuilding:
            seq.stats.record_replay(len(seq.tokens) - seq.cached - 1)  # run again, but the last
        seq.cached = len(seq.tokens) + accepted  # the next token is not in the cache yet
        seq.tokens += emitted
        seq.generated += emitted
        seq.logprobs += decision.logprobs
        seq.finish = decision.finish
        if seq.finish is not None:
            cut = len(seq.generated) - seq.finish.keep
            del seq.generated[seq.finish.keep :]
            del seq.logprobs[seq.finish.keep :]
            emitted = emitted[: max(0, len(emitted) - cut)]  # what this step accepted past the stop
            seq.stats.generated_tokens = len(seq.generated)
        if seq.matcher is not None:
            seq.matcher.advance(emitted)
        return emitted

    def _record_cost(self, tokens: int, seconds: float) -> None:
        # The first forward of a size pays one-time costs (oneDNN and MKL choose and pack kernels
        # for the new shape): recorded, it would make drafting look dear, and k = 0 chosen from
        # it would never time that size again.
        if tokens in self._sizes_run:
            self.costs.record(tokens, seconds)
        self._sizes_run.add(tokens)

    def _policy(self, drafter: Drafter, params: SamplingParams) -> AdaptiveK | AdaptiveTree:
        """A drafter's policy for greedy sequences, or for sampled ones (policy_key): by tree
        size for a drafter of trees this target verifies, else by position (a chain, or a
        tree's first path)."""
        key = policy_key(drafter.name, params)
        if key not in self.policies:
            trees = self.verifies_trees and drafter.drafts_trees
            self.policies[key] = AdaptiveTree(self.costs) if trees else AdaptiveK(self.costs)
        return self.policies[key]


def policy_key(drafter_name: str, params: SamplingParams) -> str:
    """Which policy measures a drafter's drafts: one for greedy sequences, one for sampled ones.
    A sampled sequence accepts a draft less often than a greedy one (it must draw the token,
    not just rank it first), so the same drafter pays at another k; pooled, a server's greedy
    requests would draft too little and its sampled ones too much."""
    return drafter_name if params.greedy else f"{drafter_name}, sampled"


def _hidden_layers_wanted(sequences: list[SequenceState]) -> tuple[int, ...]:
    """The target layers whose hidden states this step's drafters read (draft heads), sorted."""
    return tuple(sorted({i for seq in sequences for d in seq.drafters for i in d.hidden_layers}))


def _requested_target(seq: SequenceState, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
    """The target a request asked for, at every verified row [len(draft) + 1, vocab]: its logits
    adjusted by the tokens before each row (bias, penalties), then masked by its grammar."""
    if not seq.adjustments.active and seq.matcher is None:
        return logits
    tokens, parents = draft.tokens.tolist(), draft.parent_list()
    if seq.adjustments.active:
        logits = seq.adjustments.apply(logits, seq.prompt_ids, seq.generated, tokens, parents)
    if seq.matcher is not None:  # the constrained target: what the grammar forbids has probability 0
        logits = seq.matcher.masked(logits, tokens, parents, greedy=seq.params.greedy)
    return logits


def _after_forced(forced: list[int], draft: Draft, vocab_size: int) -> Draft:
    """draft (proposed after the forced tokens) behind them: one chain, or a tree whose roots
    hang from the last forced token; a drafter's q behind one-hot rows for the forced tokens."""
    if not forced:
        return draft
    n = len(forced)
    tokens = torch.cat([torch.tensor(forced, dtype=torch.long), draft.tokens])
    probs = None
    if draft.probs is not None:
        probs = torch.cat([F.one_hot(tokens[:n], vocab_size).to(draft.probs.dtype), draft.probs])
    parents = None
    if draft.parents is not None:
        parents = torch.cat([torch.arange(-1, n - 1), torch.where(draft.parents >= 0, draft.parents + n, n - 1)])
    return replace(draft, tokens=tokens, probs=probs, parents=parents, forced=n)


def _grammar_checked(matcher: Matcher, forced: list[int], draft: Draft, most: int) -> tuple[Draft, list[int]]:
    """A drafter's chain cut before the first token the grammar forbids there (the constrained
    target rejects it for certain: verifying it costs, and can keep nothing), and the tokens
    the grammar forces after what is left (at most `most` tokens in all)."""
    keep, after = matcher.checked_chain(forced, draft.tokens.tolist(), most)
    if keep < len(draft):
        draft = replace(draft, tokens=draft.tokens[:keep], probs=None if draft.probs is None else draft.probs[:keep])
    return draft, after[: max(0, most - keep)]


def _with_forced_after(draft: Draft, after: list[int], vocab_size: int) -> Draft:
    """draft (a chain) with the tokens a grammar forces after it, one-hot: drawn from nothing."""
    if not after:
        return draft
    extra = torch.tensor(after, dtype=torch.long)
    probs = None
    if draft.probs is not None:
        probs = torch.cat([draft.probs, F.one_hot(extra, vocab_size).to(draft.probs.dtype)])
    return replace(draft, tokens=torch.cat([draft.tokens, extra]), probs=probs, forced_after=len(after))


def _forward_parents(uncached: int, draft: Draft) -> torch.Tensor:  # [uncached + len(draft)] int64
    """Parents within a forward's new tokens: the uncached tokens a chain after the cache (-1),
    the draft's root (-1) being the last of them."""
    parents = list(range(-1, uncached - 1)) + [uncached - 1 if p < 0 else uncached + p for p in draft.parent_list()]
    return torch.tensor(parents, dtype=torch.long)


def _lived_through_a_failure(seq: SequenceState) -> None:
    """A sampled sequence's answer is cached only if no failure touched it (module docstring,
    "Rebuild"); a greedy one's does not depend on its drafts."""
    if not seq.params.greedy:
        seq.cache_key = None


def decode_all(decoder: Decoder, sequences: list[SequenceState]) -> None:
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
