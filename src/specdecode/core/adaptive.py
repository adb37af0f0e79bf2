"""Choosing k, the number of draft tokens per step, from what was measured (Leviathan et al. 2023).

With per-position acceptance a_i (the chance that draft token i is accepted when all before
it were), a step that drafts k tokens emits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens
(with one a for every position: (1 - a^(k+1)) / (1 - a)) and costs draft(k) + verify(k + 1)
seconds. The policy picks the k with the most tokens per second; k = 0 is target-only
decoding, left now and then for a probe of the most k so that a drafter can switch back on.
Costs and acceptance are exponential moving averages of past steps only: k never depends
on future tokens, so it never changes what is generated.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

# The most k any engine drafts per step (num_speculative_tokens, -k, a request's own k). Far
# past where drafting pays, and it bounds what k sizes: a step's draft and verification, each
# request's per-position stats, the server's per-position metric series, and this policy's work.
MAX_SPECULATIVE_TOKENS = 64
EMA_WEIGHT = 0.2  # weight of the newest measurement
PRIOR_ACCEPTANCE = 0.5  # a_1 before anything was drafted: optimistic enough to try it
PROBE_EVERY = (4, 64)  # target-only steps between probes: first, then doubling up to the last


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
        self.seconds[n] = ema(self.seconds.get(n), seconds)

    def estimate(self, n: int) -> float | None:
        """Measured for n, else interpolated between the measured sizes around it, else the
        nearest measured size's cost; None before any step.

        Beyond the sizes measured the guess is optimistic on purpose: forward costs rise in
        steps, not lines (on CPU: flat from 4 to 8 tokens, then from 9 to 16, measured in
        benchmarks/results/lookup-ceiling-float32.md), and an optimistic guess gets a larger
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


class AdaptiveK:
    """Per-position acceptance and draft cost of one drafter; the best k against shared step costs."""

    def __init__(self, step_costs: StepCosts):
        self.step_costs = step_costs
        self.acceptance: list[float] = []  # [positions reached so far] a_i
        self.draft_seconds_per_token: float | None = None
        self._off_steps = 0
        self._probe_every = PROBE_EVERY[0]

    def choose(self, k_max: int, batch_size: int = 1) -> int:
        """The k for the next step; batch_size sequences draft it and share one verification
        forward, whose cost step_costs knows by its total tokens."""
        if k_max <= 0:
            return 0
        k_max = min(k_max, MAX_SPECULATIVE_TOKENS)  # the engine checks k; this keeps the policy's work bounded anyway
        if self.draft_seconds_per_token is None or not self.step_costs.seconds:
            return k_max  # nothing measured yet: try the most

        def verify_seconds(n: int) -> float:  # a sequence's share of a forward verifying n tokens each
            return self.step_costs.estimate(batch_size * n) / batch_size

        k = best_k(self._acceptance(k_max), self.draft_seconds_per_token, verify_seconds)
        if k > 0:
            self._off_steps, self._probe_every = 0, PROBE_EVERY[0]
            return k
        self._off_steps += 1
        if self._off_steps < self._probe_every:
            return 0
        # A probe drafts the most k: it refreshes every position's acceptance and the draft cost.
        # One-token probes refreshed a_1 alone, so an early, low a_2 held a good drafter off for
        # good (measured: a bfloat16 self-draft accepted 92-97% gave 1.25-1.56x at k = 4 and
        # 0.92-1.02x adaptive). Probes get rarer while they fail.
        self._off_steps, self._probe_every = 0, min(2 * self._probe_every, PROBE_EVERY[1])
        return k_max

    def _acceptance(self, positions: int) -> list[float]:
        return (self.acceptance + [self._unreached()] * positions)[:positions]

    def _unreached(self) -> float:
        # a position never reached is assumed as good as the deepest one measured, as it is
        # now: once a run of drafts is accepted the next token usually is too (copying)
        return self.acceptance[-1] if self.acceptance else PRIOR_ACCEPTANCE

    def record_draft(self, num_drafted: int, seconds: float) -> None:
        self.draft_seconds_per_token = ema(self.draft_seconds_per_token, seconds / max(num_drafted, 1))

    def record_verdict(self, num_drafted: int, num_accepted: int) -> None:
        # position i was tried when every draft before it was accepted (so all before it were measured)
        for i in range(min(num_accepted + 1, num_drafted)):
            if i == len(self.acceptance):  # reached for the first time: start from its guess
                self.acceptance.append(self._unreached())
            self.acceptance[i] = ema(self.acceptance[i], float(i < num_accepted))
