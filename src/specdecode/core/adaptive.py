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

from collections.abc import Callable

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
    """The k in [0, len(acceptance)] with the most expected tokens per second."""
    rates = [
        expected_tokens(acceptance[:k]) / (k * draft_seconds_per_token + verify_seconds(k + 1))
        for k in range(len(acceptance) + 1)
    ]
    return max(range(len(rates)), key=rates.__getitem__)  # the smallest k on ties


class StepCosts:
    """Seconds of one verification step (target forward and accept/reject) by tokens verified."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # n new tokens -> EMA seconds

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
        below = [m for m in self.seconds if m < n]
        above = [m for m in self.seconds if m > n]
        if not below or not above:
            return self.seconds[max(below) if below else min(above)]
        lo, hi = max(below), min(above)
        return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (n - lo) / (hi - lo)


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
