"""One engine thread that serves queued requests one at a time (batch size 1).

The app only calls `submit`, which answers at once with a Future (or QueueFullError), and
`start`/`stop`; a later scheduler that batches the speculative steps of several requests
can replace this class behind the same three calls.

The engine is not thread-safe (its KV caches, drafters and step-cost measurements are
shared state), so everything that touches it, tokenizing included, runs on this one thread.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from specdecode.engine import GenerationResult, SpeculativeEngine
from specdecode.server.metrics import ServerMetrics


class QueueFullError(RuntimeError):
    """More requests are waiting than the server queues; the client should retry later."""


@dataclass
class GenerationRequest:
    prompt: str | list[int]  # text (encoded here) or token ids
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    templated: bool = False  # the prompt is a rendered chat template: its special tokens are in the text
    arrival: float = field(default_factory=time.perf_counter)


_STOP = object()  # put on the queue by stop(): the thread ends after the requests before it


class EngineWorker:
    def __init__(self, engine: SpeculativeEngine, metrics: ServerMetrics, max_waiting: int = 64):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        # unbounded, so stop() can always enqueue its marker; submit() enforces the bound
        self._queue: queue.Queue = queue.Queue()
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        metrics.requests_waiting.set_function(self._queue.qsize)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the queued requests, then end the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        with self._submit_lock:  # check and put together, so the bound holds under concurrent submits
            if self._queue.qsize() >= self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests are already waiting; retry later")
            self._queue.put((request, future))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            request, future = item
            if not future.set_running_or_notify_cancel():
                continue  # the client went away while it waited
            self.metrics.requests_running.inc()
            try:
                result = self._generate(request)
            except BaseException as error:  # noqa: BLE001 - handed to the request's caller, the thread goes on
                future.set_exception(error)
            else:
                self._record(request, result)
                future.set_result(result)
            finally:
                self.metrics.requests_running.dec()

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        prompt = request.prompt
        if request.templated:
            # the template wrote the special tokens (BOS included) already; encoding must not add more
            prompt = self.engine.tokenizer(prompt, add_special_tokens=False).input_ids
        prompts = [prompt] if isinstance(prompt, list) else prompt
        return self.engine.generate(
            prompts,
            max_new_tokens=request.max_tokens,
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            seed=request.seed,
            stop=request.stop or None,
        )[0]

    def _record(self, request: GenerationRequest, result: GenerationResult) -> None:
        m, stats = self.metrics, result.stats
        latency = time.perf_counter() - request.arrival
        m.e2e_latency.observe(latency)
        # results are delivered whole for now, so the first token reaches the client at the end
        m.time_to_first_token.observe(latency)
        if stats.generated_tokens:
            m.time_per_output_token.observe(stats.wall_time_s / stats.generated_tokens)
        m.prompt_tokens.inc(len(result.prompt_token_ids))
        m.generation_tokens.inc(len(result.token_ids))
        m.draft_tokens.inc(stats.drafted_tokens)
        m.accepted_tokens.inc(stats.accepted_tokens)
        m.target_forwards.inc(stats.target_forwards)
        m.requests_finished.labels(result.finish_reason).inc()
