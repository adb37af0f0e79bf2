"""`specdecode profile`'s timing (runners/profiling.py): the sizes are timed in interleaved
rounds, so that a burst of a neighbour's load lands on every size of a round, and each size's
cost is the median of its rounds."""

from __future__ import annotations

from helpers import tiny_llama
from specdecode.runners import HFModelRunner, profiling
from specdecode.runners.profiling import Hardware, profile_forward


def test_the_sizes_are_timed_in_interleaved_rounds():
    model = tiny_llama(seed=0, vocab_size=32, max_positions=128)
    runner = HFModelRunner(model)
    sizes, forward = [], runner.forward
    runner.forward = lambda tokens, n, *rest: sizes.append(n) or forward(tokens, n, *rest)
    costs = profile_forward(runner, model, Hardware(1e9, 1e9), new_tokens=(1, 4, 8), prefix=10, repeats=3)
    assert sizes == [1] + [1, 4, 8] * 5  # the prefill, then 2 untimed rounds and 3 timed ones
    assert [c.new_tokens for c in costs] == [1, 4, 8] and all(c.seconds > 0 for c in costs)


def test_a_size_s_cost_is_taken_against_the_first_size_round_by_round(monkeypatch):
    """A machine whose speed drifts from round to round (every forward of round r takes r times
    longer): the times spread, the ratios within each round do not."""
    model = tiny_llama(seed=0, vocab_size=32, max_positions=128)
    runner = HFModelRunner(model)
    calls = iter(range(10_000))
    cost = {1: 1.0, 4: 2.0, 8: 3.0}

    def timed(fn):
        result, call = fn(), next(calls)
        return result, cost[last[0]] * (1 + call // 3)

    last = [1]
    forward = runner.forward
    runner.forward = lambda tokens, n, *rest: last.__setitem__(0, n) or forward(tokens, n, *rest)
    monkeypatch.setattr(profiling, "timed", timed)
    costs = profile_forward(runner, model, Hardware(1e9, 1e9), new_tokens=(1, 4, 8), prefix=10, repeats=5)
    assert [c.ratio for c in costs] == [1.0, 2.0, 3.0] and all(c.ratio_spread == 0 for c in costs)
    assert all(c.spread > 0.1 for c in costs)  # the times themselves moved with the machine
