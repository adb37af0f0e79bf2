"""Choosing k, the number of draft tokens per step, from what was measured (Leviathan et al. 2023).

With per-position acceptance a_i (the chance that draft token i is accepted when all before
it were), a step that drafts k tokens emits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens
(with one a for every position: (1 - a^(k+1)) / (1 - a)) and costs draft(k) + verify(k + 1)
seconds. The policy picks the k with the most tokens per second; k = 0 is target-only
decoding, left now and then for a probe of the most k so that a drafter can switch back on.
Costs and acceptance are exponential moving averages of past steps only: k never depends
on future tokens, so it never changes what is generated.

Trees (`AdaptiveTree`). For a drafter of trees k is a node budget n, and what n buys is
measured directly: the accepted depth A(n) of the steps that asked for n nodes (a tree's
positions are not a chain's, so per-position rates do not add up to it). A step emits
1 + A(n) tokens and costs draft(nodes) + verify(nodes + 1), nodes being what the drafter
really proposed for n (it may propose fewer); n is chosen on a ladder of sizes (TREE_SIZES,
capped by k_max) for the most tokens per second, 0 again being target-only with probes. A
size not measured yet is guessed as good as the next larger one measured (a tree of fewer
nodes that does as well is cheaper), so that it gets tried, and measured. One step's depth
is a noisy integer, so a size's A(n) is a discounted mean with a bonus for sizes measured
little or long ago (discounted UCB): a size left after unlucky steps is tried again.

Ranking. A sequence with several drafters (`auto`) tries them best first: by the tokens per
second each one's settled choice is expected to give (`rate`), those not measured yet first, in
their given order, so that they get measured; every RANK_PROBE_EVERY-th step of the sequence that
explores tries them in their given order instead, so that a drafter ranked low is measured again.

Exploring. What a policy returns may explore (a size chosen on its bonus, a probe); `settled`
is what pays on what was measured alone. In a batch the decoder lets one sequence a step
explore and the others draft `settled`: a batch's forward is not flat in its tokens, and
every sequence exploring at once made a forward of all their trees.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

# The most k any engine drafts per step (num_speculative_tokens, -k, a request's own k). Far
# past where drafting pays, and it bounds what k sizes: a step's draft and verification, each
# request's per-position stats, the server's per-position metric series, and this policy's work.
MAX_SPECULATIVE_TOKENS = 64
EMA_WEIGHT = 0.2  # weight of the newest measurement
SPIKE_LIMIT = 2.0  # a step's time counts as at most this many times its size's estimate
PRIOR_ACCEPTANCE = 0.5  # a_1 before anything was drafted: optimistic enough to try it
PROBE_EVERY = (4, 64)  # target-only steps between probes: first, then doubling up to the last
# the node budgets a tree policy chooses from (and k_max itself, the largest): a ladder, so
# that each size is asked often enough to be measured
TREE_SIZES = (0, 2, 4, 8, 12, 16, 24, 32)
# the most nodes of a tree where no k is asked for (a tree drafter on a target that verifies trees):
# on the fast runner's tree kernel, verifying up to this many new tokens costs little more than
# one, and past it the cost grows about linearly (benchmarks/results/tree-attention.md); each
# step's size below it is AdaptiveTree's choice
DEFAULT_TREE_NODES = 16
RANK_PROBE_EVERY = 16  # steps between two in which the exploring sequence tries its drafters in their given order
TREE_MEMORY = 0.99  # weight a tree size's measurement keeps per step: about the last 100 steps count
TREE_BONUS = 0.5  # tokens of optimism for a size measured once (AdaptiveTree.bonus)


def ema(old: float | None, new: float, weight: float = EMA_WEIGHT) -> float:
    return new if old is None else old + weight * (new - old)


def expected_tokens(acceptance: list[float]) -> float:
    """Tokens one step emits when it drafts len(acceptance) tokens: accepted ones plus one."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= a  # the chance that this position is reached and accepted
        total += reach
    return total


def best_k(acceptance: list[float], draft_seconds_per_token: float, verify_seconds: Callable[[int], float]) -> int:
    """The k in [0, len(acceptance)] with the most expected tokens per second. E(k) is built
    from E(k - 1) as k grows: one pass over the positions (this runs every step)."""
    best, best_rate = 0, 1.0 / verify_seconds(1)
    tokens, reach = 1.0, 1.0
    for k, a in enumerate(acceptance, start=1):
        reach *= a
        tokens += reach  # expected_tokens(acceptance[:k])
        rate = tokens / (k * draft_seconds_per_token + verify_seconds(k + 1))
        if rate > best_rate:  # the smallest k on ties
            best, best_rate = k, rate
    return best


class StepCosts:
    """Seconds of one verification step (target forward and accept/reject) by tokens verified."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # n new tokens -> EMA seconds
        self._sorted: tuple[dict[int, float] | None, list[int]] = (None, [])  # a copy of seconds' sizes, in order

    def record(self, n: int, seconds: float) -> None:
        """One step's time, at most SPIKE_LIMIT times what this size was thought to cost: a
        stall of the host (another process, a page fault, the collector) takes a step ten
        times its usual time, and averaged in whole it priced a rarely verified size out of
        use for many steps; a real slowdown still comes through, SPIKE_LIMIT a step."""
        expected = self.estimate(n)
        if expected is not None:
            seconds = min(seconds, SPIKE_LIMIT * expected)
        self.seconds[n] = ema(self.seconds.get(n), seconds)

    def estimate(self, n: int) -> float | None:
        """Measured for n, else interpolated between the measured sizes around it, else the
        nearest measured size's cost; None before any step.

        Beyond the sizes measured the guess is optimistic on purpose: forward costs rise in
        steps, not lines (benchmarks/results/tree-attention.md), and an optimistic guess gets a larger
        k tried and so measured, where a pessimistic one would never be corrected."""
        if n in self.seconds:
            return self.seconds[n]
        if not self.seconds:
            return None
        sizes = self._sizes()
        i = bisect.bisect_left(sizes, n)  # sizes[i - 1] < n < sizes[i]
        if i == 0 or i == len(sizes):
            return self.seconds[sizes[i - 1] if i else sizes[0]]
        lo, hi = sizes[i - 1], sizes[i]
        return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (n - lo) / (hi - lo)

    def _sizes(self) -> list[int]:
        """The measured sizes in order, sorted again only when one was added (sizes are never
        removed): a policy estimates k + 1 sizes every step, each a bisection, not a scan."""
        of, sizes = self._sorted
        if of is not self.seconds or len(sizes) != len(self.seconds):  # (tests replace the dict)
            self._sorted = (self.seconds, sorted(self.seconds))
        return self._sorted[1]


class _Policy:
    """What both policies share: the draft cost, the step costs, and probes out of k = 0."""

    def __init__(self, step_costs: StepCosts):
        self.step_costs = step_costs
        self.draft_seconds_per_token: float | None = None  # a tree's: per node
        # the last choice without exploration: what pays on what was measured (0 while probing);
        # in a batch, the sequences that do not explore this step draft it (decoder._draft)
        self.settled = 0
        self._off_steps = 0
        self._probe_every = PROBE_EVERY[0]

    def rate(self, batch_size: int = 1) -> float | None:
        """Expected tokens per second of a step that drafts `settled` (target-only's where it is
        0); None before a draft, a verdict on one and a step were measured."""
        if self.draft_seconds_per_token is None or not self.step_costs.seconds or not self._judged():
            return None
        verify_seconds = self._verify_seconds(batch_size)
        if self.settled == 0:
            return 1.0 / verify_seconds(1)
        tokens, drafted = self._settled_yield()
        return tokens / (drafted * self.draft_seconds_per_token + verify_seconds(drafted + 1))

    def _judged(self) -> bool:
        """Whether a verdict on a draft was recorded."""
        raise NotImplementedError

    def _settled_yield(self) -> tuple[float, float]:
        """(tokens emitted, tokens drafted) of a step that drafts `settled`."""
        raise NotImplementedError

    def record_draft(self, num_drafted: int, seconds: float) -> None:
        self.draft_seconds_per_token = ema(self.draft_seconds_per_token, seconds / max(num_drafted, 1))

    def _verify_seconds(self, batch_size: int) -> Callable[[float], float]:
        def verify_seconds(n: float) -> float:  # a sequence's share of a forward verifying n tokens each
            return self.step_costs.estimate(batch_size * n) / batch_size

        return verify_seconds

    def _or_probe(self, k: int, k_max: int) -> int:
        """k, or where k is 0 now and then a probe of k_max (a tree policy's: the size it hopes most of)."""
        if k > 0:
            self._off_steps, self._probe_every = 0, PROBE_EVERY[0]
            return k
        self._off_steps += 1
        if self._off_steps < self._probe_every:
            return 0
        # A probe drafts the most k: it refreshes every position's acceptance and the draft cost.
        # One-token probes refreshed a_1 alone, so an early, low a_2 held a good drafter off for
        # good (benchmarks/results/earlier-measurements.md). Probes get rarer while they fail.
        self._off_steps, self._probe_every = 0, min(2 * self._probe_every, PROBE_EVERY[1])
        return k_max


class AdaptiveK(_Policy):
    """Per-position acceptance and draft cost of one drafter; the best k against shared step costs."""

    def __init__(self, step_costs: StepCosts):
        super().__init__(step_costs)
        self.acceptance: list[float] = []  # [positions reached so far] a_i

    def choose(self, k_max: int, batch_size: int = 1) -> int:
        """The k for the next step; batch_size sequences draft it and share one verification
        forward, whose cost step_costs knows by its total tokens."""
        if k_max <= 0:
            self.settled = 0
            return 0
        k_max = min(k_max, MAX_SPECULATIVE_TOKENS)  # the engine checks k; this keeps the policy's work bounded anyway
        if self.draft_seconds_per_token is None or not self.step_costs.seconds:
            self.settled = k_max
            return k_max  # nothing measured yet: try the most
        k = best_k(self._acceptance(k_max), self.draft_seconds_per_token, self._verify_seconds(batch_size))
        self.settled = k
        return self._or_probe(k, k_max)

    def _judged(self) -> bool:
        return bool(self.acceptance)

    def _settled_yield(self) -> tuple[float, float]:
        return expected_tokens(self._acceptance(self.settled)), float(self.settled)

    def _acceptance(self, positions: int) -> list[float]:
        return (self.acceptance + [self._unreached()] * positions)[:positions]

    def _unreached(self) -> float:
        # a position never reached is assumed as good as the deepest one measured, as it is
        # now: once a run of drafts is accepted the next token usually is too (copying)
        return self.acceptance[-1] if self.acceptance else PRIOR_ACCEPTANCE

    def record_verdict(self, num_drafted: int, num_accepted: int, asked: int | None = None) -> None:
        """num_accepted of num_drafted drafts kept (asked: the k asked for, unused by chains)."""
        # position i was tried when every draft before it was accepted (so all before it were measured)
        for i in range(min(num_accepted + 1, num_drafted)):
            if i == len(self.acceptance):  # reached for the first time: start from its guess
                self.acceptance.append(self._unreached())
            self.acceptance[i] = ema(self.acceptance[i], float(i < num_accepted))

    def record_no_draft(self, asked: int) -> None:
        """Asked for drafts, proposed none, in a forward that others' drafts made larger: as
        if the first position were rejected."""
        self.record_verdict(1, 0)


def tree_sizes(k_max: int) -> list[int]:
    """The node budgets a tree policy chooses from: 0 (target-only), the ladder below k_max, k_max."""
    return [0] + [n for n in TREE_SIZES if 0 < n < k_max] + [k_max]


def best_tree_size(
    sizes: list[int],
    accepted_depth: Callable[[int], float],
    nodes: Callable[[int], float],
    draft_seconds_per_node: float,
    verify_seconds: Callable[[float], float],
) -> int:
    """The size in sizes (0 among them) with the most expected tokens per second: a step that
    asks for n nodes emits 1 + accepted_depth(n) tokens and costs nodes(n) drafted and
    nodes(n) + 1 verified; the smallest size on ties."""
    best, best_rate = 0, 1.0 / verify_seconds(1)
    for n in sizes:
        if n <= 0:
            continue
        rate = (1.0 + accepted_depth(n)) / (nodes(n) * draft_seconds_per_node + verify_seconds(nodes(n) + 1))
        if rate > best_rate:
            best, best_rate = n, rate
    return best


class AdaptiveTree(_Policy):
    """Accepted depth and draft cost of one drafter of trees, by the node budget asked for;
    the best budget against shared step costs (module docstring).

    Each size's accepted depth is a discounted mean (every step leaves a past measurement
    TREE_MEMORY of its weight), and a size is chosen on its mean plus a bonus that grows as its
    measurements fade (discounted UCB, Garivier and Moulines 2011): a size left after a few
    unlucky steps, whose mean would otherwise stay low for good, comes back to be measured."""

    def __init__(self, step_costs: StepCosts):
        super().__init__(step_costs)
        self._depth: dict[int, float] = {}  # nodes asked for -> discounted sum of accepted depths
        self._nodes: dict[int, float] = {}  # nodes asked for -> discounted sum of nodes proposed
        self._weight: dict[int, float] = {}  # nodes asked for -> discounted count of steps measured

    @property
    def accepted(self) -> dict[int, float]:
        """Nodes asked for -> mean accepted depth, of the sizes measured."""
        return {n: self._depth[n] / w for n, w in self._weight.items()}

    def choose(self, k_max: int, batch_size: int = 1) -> int:
        """The node budget for the next step; batch_size sequences draft it and share one
        verification forward, whose cost step_costs knows by its total tokens: the larger the
        batch, the dearer each node, and the smaller the tree."""
        if k_max <= 0:
            self.settled = 0
            return 0
        k_max = min(k_max, MAX_SPECULATIVE_TOKENS)
        if self.draft_seconds_per_token is None or not self.step_costs.seconds or not self._weight:
            self.settled = k_max
            return k_max  # nothing measured yet: try the most
        sizes, verify_seconds = tree_sizes(k_max), self._verify_seconds(batch_size)
        costs = (self.nodes_proposed, self.draft_seconds_per_token, verify_seconds)
        likely = self.settled = best_tree_size(sizes, self.accepted_depth, *costs)
        hopeful = best_tree_size(sizes, lambda n: min(float(n), self.accepted_depth(n) + self.bonus(n)), *costs)
        for size in self._weight:  # a step has passed: what was measured weighs less
            self._depth[size] *= TREE_MEMORY
            self._nodes[size] *= TREE_MEMORY
            self._weight[size] *= TREE_MEMORY
        # the bonus picks among sizes that pay; where none does on what was measured, decoding
        # goes target-only and probes (the most hopeful size) ever more rarely, as AdaptiveK does
        return hopeful if likely > 0 else self._or_probe(0, hopeful or k_max)

    def _judged(self) -> bool:
        return bool(self._weight)

    def _settled_yield(self) -> tuple[float, float]:
        return 1.0 + self.accepted_depth(self.settled), self.nodes_proposed(self.settled)

    def accepted_depth(self, size: int) -> float:
        """Measured for size, else the next larger measured size's (else the largest's below),
        never more than size."""
        accepted = self.accepted
        if size in accepted:
            return accepted[size]
        larger = [n for n in accepted if n > size]
        guess = accepted[min(larger)] if larger else accepted[max(accepted)] if accepted else 0.0
        return min(guess, float(size))

    def nodes_proposed(self, size: int) -> float:
        """Nodes the drafter proposes when asked for size (it may give fewer): measured, else size."""
        return self._nodes[size] / self._weight[size] if size in self._weight else float(size)

    def bonus(self, size: int) -> float:
        """Tokens of optimism for size: TREE_BONUS * sqrt(log(steps measured) / its steps), all
        discounted; none for a size never measured (its guess is optimistic already)."""
        weight = self._weight.get(size)
        if not weight:
            return 0.0
        return TREE_BONUS * math.sqrt(max(1.0, math.log(sum(self._weight.values()))) / weight)

    def record_verdict(self, num_drafted: int, num_accepted: int, asked: int | None = None) -> None:
        """A step that asked for `asked` nodes (default: num_drafted) was given num_drafted and
        accepted a path num_accepted deep."""
        size = num_drafted if asked is None else asked
        self._depth[size] = self._depth.get(size, 0.0) + num_accepted
        self._nodes[size] = self._nodes.get(size, 0.0) + num_drafted
        self._weight[size] = self._weight.get(size, 0.0) + 1.0

    def record_no_draft(self, asked: int) -> None:
        """Asked for drafts, proposed none, in a forward that others' drafts made larger: as
        if asked-many nodes were all rejected."""
        self.record_verdict(asked, 0, asked)
