"""Systems side by side: every system runs on an item before any system runs on the next, so a
noisy neighbour or a change of clock speed slows all of them alike instead of whichever ran
while it lasted; each system's median (or best) over its runs is what is compared.

Every comparison in `specdecode bench` and in benchmarks/ runs through `interleave`.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from specdecode.runners.profiling import timed

T = TypeVar("T")
ORDERS = ("fixed", "alternate", "shuffle")


@dataclass(frozen=True)
class Run(Generic[T]):
    system: Hashable  # its key in the systems given
    item: int  # index of the item it ran on
    repeat: int  # which pass over the items
    order: int  # its place among the systems on this item in this pass
    value: T  # what the system returned
    seconds: float  # wall time of the call


def interleave(
    systems: Mapping[Hashable, Callable[[Any], T]],
    items: Sequence[Any] = (None,),
    *,
    repeats: int = 1,
    order: str = "fixed",
    seed: int = 0,
    warm_up: int = 0,
) -> list[Run[T]]:
    """Call every system on every item, `repeats` passes over the items, the systems side by side
    on each item in an order that is "fixed" (as given), "alternate" (reversed every other pass)
    or "shuffle" (a new random order per item, from seed). warm_up: untimed calls of each system
    on the first item, before any timing (first-call allocations, kernel choices, caches)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    names = list(systems)
    for _ in range(warm_up):
        for name in names:
            systems[name](items[0])
    rng = random.Random(seed)
    runs = []
    for repeat in range(repeats):
        for index, item in enumerate(items):
            for place, name in enumerate(_ordered(names, order, repeat, rng)):
                value, seconds = timed(lambda: systems[name](item))  # noqa: B023 - called now
                runs.append(Run(name, index, repeat, place, value, seconds))
    return runs


def by_system(runs: Iterable[Run[T]], key: Callable[[Run[T]], Any] = lambda run: run.seconds) -> dict[Hashable, list]:
    """key(run) of each system's runs, in the order they ran."""
    found: dict[Hashable, list] = {}
    for run in runs:
        found.setdefault(run.system, []).append(key(run))
    return found


def medians(runs: Iterable[Run[T]], key: Callable[[Run[T]], Any] = lambda run: run.seconds) -> dict[Hashable, float]:
    """Each system's median of key(run), seconds by default."""
    return {name: statistics.median(values) for name, values in by_system(runs, key).items()}


def best_per_item(runs: Iterable[Run[T]], key: Callable[[Run[T]], float]) -> dict[tuple[Hashable, int], Run[T]]:
    """Each system's run with the highest key(run) on each item, over the passes."""
    best: dict[tuple[Hashable, int], Run[T]] = {}
    for run in runs:
        kept = best.get((run.system, run.item))
        if kept is None or key(run) > key(kept):
            best[run.system, run.item] = run
    return best


def _ordered(names: list, order: str, repeat: int, rng: random.Random) -> list:
    if order == "shuffle":
        return rng.sample(names, len(names))
    return names[::-1] if order == "alternate" and repeat % 2 else names
