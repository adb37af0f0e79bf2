"""Faults injected on purpose, to test that the server survives them (tests, `specdecode loadtest`).

The worker calls `before_step(requests)` at every engine step, before the drafts and the
batched target forward, and `after_forward(requests)` once the forward has run, before any
verdict is taken, with the requests in the step. Raising there is what a failing kernel, an
out-of-memory error or a crashing worker look like to the worker, early or late in a step.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Protocol


class TransientFault(RuntimeError):
    """A failure that a retry of the same step may not see again."""


class WorkerCrash(BaseException):
    """The engine thread dies (BaseException: nothing on the way up catches it)."""


class StepHook(Protocol):
    def before_step(self, requests: Sequence) -> None: ...  # the GenerationRequests in the step

    def after_forward(self, requests: Sequence) -> None: ...


class RandomFaults:
    """Each step fails transiently with probability `transient`, crashes the worker with
    probability `crash`; a step holding a request whose prompt contains `poison` always fails;
    every step takes `delay` seconds longer (a slow engine, for shutdown tests)."""

    def __init__(
        self, transient: float = 0.0, crash: float = 0.0, poison: str | None = None, seed: int = 0, delay: float = 0.0
    ):
        self.transient, self.crash, self.poison, self.delay = transient, crash, poison, delay
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # a restarted worker thread may overlap its predecessor's last moments

    def before_step(self, requests: Sequence) -> None:
        time.sleep(self.delay)
        self._maybe_fail(requests, "before the forward")

    def after_forward(self, requests: Sequence) -> None:
        self._maybe_fail(requests, "after the forward")

    def _maybe_fail(self, requests: Sequence, when: str) -> None:
        # each point draws half the step's chances, so a step fails as often as with one point
        if self.poison is not None and any(self.poison in str(r.prompt) for r in requests):
            raise RuntimeError(f"injected fault {when}: a poisoned request is in this step")
        with self._lock:
            draw = 2 * self._random.random()
        if draw < self.crash:
            raise WorkerCrash(f"injected fault {when}: the engine worker crashed")
        if draw < self.crash + self.transient:
            raise TransientFault(f"injected fault {when}: a transient engine failure")
