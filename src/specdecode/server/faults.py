"""Faults injected on purpose, to test that the server survives them (tests, `specdecode loadtest`).

The worker calls `before_step(requests)` at every engine step, just before the batched
target forward, with the requests in the step. Raising there is what a failing kernel, an
out-of-memory error or a crashing worker look like to the worker.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Protocol


class TransientFault(RuntimeError):
    """A failure that a retry of the same step may not see again."""


class WorkerCrash(BaseException):
    """The engine thread dies (BaseException: nothing on the way up catches it)."""


class StepHook(Protocol):
    def before_step(self, requests: Sequence) -> None: ...  # the GenerationRequests in the step


class RandomFaults:
    """Each step fails transiently with probability `transient`, crashes the worker with
    probability `crash`; a step holding a request whose prompt contains `poison` always fails."""

    def __init__(self, transient: float = 0.0, crash: float = 0.0, poison: str | None = None, seed: int = 0):
        self.transient, self.crash, self.poison = transient, crash, poison
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # a restarted worker thread may overlap its predecessor's last moments

    def before_step(self, requests: Sequence) -> None:
        if self.poison is not None and any(self.poison in str(r.prompt) for r in requests):
            raise RuntimeError("injected fault: a poisoned request is in this step")
        with self._lock:
            draw = self._random.random()
        if draw < self.crash:
            raise WorkerCrash("injected fault: the engine worker crashed")
        if draw < self.crash + self.transient:
            raise TransientFault("injected fault: a transient engine failure")
