"""The engine thread: continuous batching of every request the server holds.

The app calls `submit` (answers at once with a RequestHandle, or raises QueueFullError or
ShuttingDownError) and `stop`; `run` (or `start`, in a new thread) runs the engine loop. One
thread runs the engine, which is not thread-safe (KV caches, drafters, step costs, the tokenizer): it admits queued requests
into free batch slots, steps the engine's Decoder, streams each request's new text to its
handle, and completes the requests that finish.

Faults. A failed step is retried with exponential backoff; if it keeps failing, each of its
requests is tried alone and only those that still fail get the error. If the loop itself
crashes, it starts again and resumes every in-flight request from the tokens it had
accepted (their caches are rebuilt); a request caught in MAX_CRASHES crashes fails, so none loops forever.
A request still running max_request_seconds after it arrived fails with a timeout, and one
whose client went away is dropped between steps, freeing its slot; one that waits for a slot
leaves the queue at once (WaitingRoom), so clients that hang up hold no place in it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from specdecode.core.detokenize import Holdback, IncrementalText
from specdecode.core.logprobs import TokenLogprob
from specdecode.decoder import SequenceState
from specdecode.drafters import candidates_of
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import GenerationResult, RequestSettings, SpeculativeEngine, make_generator
from specdecode.errors import ContextLengthError, SpecDecodeError
from specdecode.server.config import ServerConfig
from specdecode.server.faults import StepHook
from specdecode.server.metrics import ServerMetrics

logger = logging.getLogger("specdecode.server")

MAX_CRASHES = 3  # worker crashes a request may live through before it fails
STEP_ATTEMPTS = 3  # tries of one engine step before its requests are tried one by one
ADMIT_POLL_S = 0.05  # how often an idle worker looks for new requests and for stop()
_UNTRACED = nullcontext()


class QueueFullError(RuntimeError):
    """More requests are waiting than the server queues; the client should retry later."""


class ShuttingDownError(RuntimeError):
    """The server is finishing its requests before it stops; it takes no new ones."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the server's per-request time limit."""


class WorkerCrashedError(RuntimeError):
    """The engine worker crashed too often while this request was in it."""


@dataclass
class GenerationRequest:
    """A request as the worker takes it: checked by the engine (its settings) before it queues."""

    prompt: str | list[int]  # text (encoded on the engine thread) or token ids
    max_tokens: int | None  # None: up to the end of the context (max_model_len)
    settings: RequestSettings  # engine.settings(): sampling, stops, k, constraint, adjustments, logprobs
    templated: bool = False  # the prompt is a rendered chat template: its special tokens are in the text
    stream: bool = False  # publish the text as it is generated
    operation: str = "text_completion"  # gen_ai.operation.name: "chat" or "text_completion"
    messages: list[dict] | None = None  # a chat's messages as sent (spans record them only if asked: tracing.py)
    arrival: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class TextDelta:
    """A piece of a stream: new text, and the log-probabilities of the tokens it adds (when asked)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


class RequestHandle:
    """One request as the app sees it: its result (a Future), its text as it is generated
    (text_deltas, for streams), and `cancel` for a client that went away."""

    def __init__(self, request: GenerationRequest, deadline: float, trace=None):
        self.request, self.deadline = request, deadline
        self.trace = trace  # its spans (tracing.RequestTrace), ended from this thread; None: not traced
        self.future: Future[GenerationResult] = Future()
        self.cancelled = False
        self.crashes = 0
        self.done = False  # its end recorded (metrics, spans): once, whichever way it ended
        self.first_token_at: float | None = None
        self.started_at: float | None = None
        self.streamed_chars = 0
        self.streamed_logprobs = 0  # tokens whose log-probabilities the stream has sent
        self.new_text: IncrementalText | None = None  # a stream's text, decoded as it grows
        self.holdback = Holdback(request.settings.stopping.stop_strings)  # ... less what may still begin a stop string
        self.on_cancel: Callable[[], None] | None = None  # the waiting room's: leave it at once
        self._loop = asyncio.get_running_loop() if request.stream else None
        self._deltas: asyncio.Queue[TextDelta | None] | None = asyncio.Queue() if request.stream else None

    def cancel(self) -> None:
        self.cancelled = True  # read by the worker between steps
        if self.on_cancel is not None:
            self.on_cancel()

    async def text_deltas(self) -> AsyncIterator[TextDelta]:
        """Text as the engine accepts it; ends when the request ends (see `future` for how)."""
        while (delta := await self._deltas.get()) is not None:
            yield delta

    def publish(self, delta: TextDelta | None) -> None:
        """From the worker thread: more text, or None at the end."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deltas.put_nowait, delta)


class WaitingRoom:
    """The requests waiting for a batch slot, oldest first, shared by the app's threads and the
    engine thread. A request cancelled while it waits leaves at once, so its place (and the
    waiting gauge) is free for the next client; the engine thread ends it (`take_left`)."""

    def __init__(self) -> None:
        self._waiting: deque[RequestHandle] = deque()
        self._left: list[RequestHandle] = []
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def empty(self) -> bool:
        return not self._waiting and not self._left

    def put(self, handle: RequestHandle, limit: int) -> bool:
        """Queue handle unless `limit` requests wait already."""
        with self._changed:
            if len(self._waiting) >= limit:
                return False
            self._waiting.append(handle)
            handle.on_cancel = functools.partial(self.leave, handle)
            self._changed.notify()
            return True

    def take(self, timeout: float = 0.0) -> RequestHandle | None:
        """The oldest waiting request, waiting up to timeout seconds for one; None if none."""
        with self._changed:
            if not self._waiting and timeout > 0:
                self._changed.wait(timeout)
            return self._waiting.popleft() if self._waiting else None

    def leave(self, handle: RequestHandle) -> None:
        """From any thread: handle out of the queue, if it still waits there (O(max_waiting))."""
        with self._changed:
            try:
                self._waiting.remove(handle)
            except ValueError:
                return  # taken already: the engine thread drops it between steps
            self._left.append(handle)

    def take_left(self) -> list[RequestHandle]:
        """The requests that left since the last call, for the engine thread to end."""
        with self._changed:
            left, self._left = self._left, []
            return left


class EngineWorker:
    def __init__(
        self,
        engine: SpeculativeEngine,
        metrics: ServerMetrics,
        config: ServerConfig | None = None,
        faults: StepHook | None = None,
    ):
        """config: its max_waiting, max_batch_size and max_request_seconds (default: ServerConfig's)."""
        self.engine, self.metrics, self.faults = engine, metrics, faults
        self.config = config = config or ServerConfig()
        self.decoder = engine.decoder
        self.decoder.capacity = engine.batch_capacity(config.max_batch_size)
        self._waiting = WaitingRoom()
        self._submit_lock = threading.Lock()
        self._stopping = False
        self._aborting = False  # a second signal: fail what is held, return after this step
        self._running = threading.Event()  # the engine loop is running (in some thread)
        self._retrying = Retrying(
            retry=retry_if_exception_type(Exception),  # not BaseException: a crash is the loop's to handle
            stop=stop_after_attempt(STEP_ATTEMPTS),
            wait=wait_exponential(multiplier=0.01, max=0.5),
            before_sleep=lambda _: metrics.step_retries.inc(),
            reraise=True,
        )
        metrics.requests_waiting.set_function(lambda: len(self._waiting))
        metrics.requests_running.set_function(lambda: len(self.decoder.active))
        backend = engine.cache_backend
        metrics.cache_backend_errors.set_function(lambda: backend.errors if backend is not None else 0)
        store = next((d.store for d in candidates_of(engine.drafter) if isinstance(d, SuffixDrafter)), None)
        metrics.expect(engine.num_speculative_tokens, [d.name for d in candidates_of(engine.drafter)])
        metrics.draft_store_tokens.set_function(lambda: len(store) if store is not None else 0)

    def start(self) -> None:
        """Run the engine loop in a thread of its own (`run` in the caller's thread is faster: see run)."""
        threading.Thread(target=self.run, name="specdecode-engine", daemon=True).start()
        self._running.wait()

    def run(self) -> None:
        """The engine loop, in the calling thread, until stop(). torch's CPU thread pool runs
        faster driven from the process's main thread than from another one, so `specdecode
        serve` runs this in its main thread and the HTTP server in another. A crash of the
        loop restarts it: in-flight requests resume."""
        self._running.set()
        try:
            while True:
                try:
                    self._serve()
                    return
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as crash:  # noqa: BLE001 - whatever killed the loop, it starts again
                    logger.error("engine worker crashed (%r); restarting it", crash)
                    self.metrics.worker_restarts.inc()
                    self._recover()
        finally:
            self._running.clear()

    def stop(self, timeout: float = 60.0) -> None:
        """Take no new requests; finish the running and queued ones, then end the loop."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self.alive and time.monotonic() < deadline:
            time.sleep(ADMIT_POLL_S)

    def abort(self) -> None:
        """Stop at once (a second SIGINT): every queued and running request fails with
        ShuttingDownError, and the loop returns after its current step."""
        self._stopping = self._aborting = True

    @property
    def alive(self) -> bool:
        return self._running.is_set()

    def submit(self, request: GenerationRequest, trace=None) -> RequestHandle:
        handle = RequestHandle(request, request.arrival + self.config.max_request_seconds, trace)
        with self._submit_lock:  # check and put together, so the bound holds under concurrent submits
            if self._stopping:
                raise ShuttingDownError("the server is shutting down; send the request to another instance")
            if not self._waiting.put(handle, self.config.max_waiting):
                raise QueueFullError(f"{self.config.max_waiting} requests are already waiting; retry later")
        return handle

    # --- the engine thread ---

    def _serve(self) -> None:
        while not (self._stopping and self._waiting.empty and not self.decoder.active):
            if self._aborting:
                self._fail_everything(ShuttingDownError("the server was stopped before this request finished"))
                return
            self._admit()
            self._drop_cancelled_and_late()
            if self.decoder.active:
                self._deliver(self._step(list(self.decoder.active)))

    def _fail_everything(self, error: Exception) -> None:
        for seq in list(self.decoder.active):
            self._end(seq.tag, seq, error=error)
        while (handle := self._waiting.take()) is not None:
            self._end(handle, error=error)
        for handle in self._waiting.take_left():
            self._end(handle, aborted=True)

    def _recover(self) -> None:
        """After a crash of the loop. A sequence that finished in the step the crash interrupted
        is answered now: its tokens are final, and stepped again it would generate past its end.
        The others have lived through one more crash (the MAX_CRASHES-th fails them) and are
        rebuilt at their next step, bit for bit as they were (decoder.reset: a crash may have
        left half-written caches)."""
        for seq in list(self.decoder.active):
            if seq.finish is not None:
                self._end(seq.tag, seq)
                continue
            seq.tag.crashes += 1
            if seq.tag.crashes >= MAX_CRASHES:
                crashed = WorkerCrashedError(f"the engine worker crashed {MAX_CRASHES} times during this request")
                self._end(seq.tag, seq, error=crashed)
        self.decoder.reset()

    def _admit(self) -> None:
        for handle in self._waiting.take_left():  # their clients went away while they waited
            self._end(handle, aborted=True)
        wait = not self.decoder.active  # idle: block briefly for new work
        while self.decoder.has_room:
            handle = self._waiting.take(ADMIT_POLL_S if wait else 0.0)
            if handle is None:
                return
            wait = False
            if handle.cancelled:
                self._end(handle, aborted=True)
                continue
            self._admit_one(handle)

    def _admit_one(self, handle: RequestHandle) -> None:
        """Start one request, all or nothing: its sequence, a response-cache answer or a batch
        slot. Whatever fails here is this request's error, answered to it, its sequence out of
        the batch and its slot given back (_end)."""
        seq = None
        try:
            seq = self._sequence(handle)  # the request's own faults (too long, bad ids) are raised here
            handle.started_at = time.perf_counter()
            with _traced(handle):  # a response-cache lookup and a draft-store sync: Redis calls
                if not self._answer_from_cache(seq):
                    self.decoder.add(seq)
        except Exception as error:  # noqa: BLE001 - answered to this request alone; the loop goes on
            self._end(handle, seq, error=error)

    def _answer_from_cache(self, seq: SequenceState) -> bool:
        """A deterministic request seen before: answered at once, without a slot or a forward."""
        if seq.cache_key is None:
            return False
        answered = self.engine.caches.answer(seq)
        self.metrics.response_cache.labels("hit" if answered else "miss").inc()
        if not answered:
            return False
        handle = seq.tag
        seq.stats.wall_time_s = time.perf_counter() - handle.started_at
        handle.first_token_at = time.perf_counter()
        self.metrics.observe_time_to_first_token(
            handle.request.operation, handle.first_token_at - handle.request.arrival
        )
        self._end(handle, result=self.engine.result(seq))
        return True

    def _sequence(self, handle: RequestHandle) -> SequenceState:
        request, engine = handle.request, self.engine
        prompt = request.prompt
        if request.templated:
            # the template wrote the special tokens (BOS included) already; encoding must not add more
            prompt = engine.tokenizer(prompt, add_special_tokens=False).input_ids
        prompt_ids = engine.prompt_token_ids(prompt, chat=False)  # refuses a prompt that leaves no room
        settings = request.settings.with_budget(_max_tokens(request.max_tokens, len(prompt_ids), engine.max_model_len))
        return engine.sequence(prompt_ids, settings, make_generator(settings.seed), tag=handle)

    def _drop_cancelled_and_late(self) -> None:
        now = time.perf_counter()
        for seq in list(self.decoder.active):
            if seq.tag.cancelled:
                self._end(seq.tag, seq, aborted=True)
            elif now > seq.tag.deadline:
                limit = self.config.max_request_seconds
                self._end(
                    seq.tag, seq, error=RequestTimeoutError(f"the request ran past the server's limit of {limit:g} s")
                )

    def _step(self, sequences: list[SequenceState]) -> list[tuple[SequenceState, list[int]]]:
        """One step of every sequence; if it keeps failing, each sequence alone, failing only
        the sequences that fail alone too."""
        self.metrics.batch_size.observe(len(sequences))
        try:
            return self._step_with_retries(sequences)
        except Exception as error:  # noqa: BLE001 - find out whose step it is
            if len(sequences) == 1:
                self._end(sequences[0].tag, sequences[0], error=error)
                return []
        emitted = []
        for seq in sequences:
            try:
                emitted += self._step_with_retries([seq])
            except Exception as error:  # noqa: BLE001 - this request's failure, answered to it alone
                self._end(seq.tag, seq, error=error)
        return emitted

    def _step_with_retries(self, sequences: list[SequenceState]) -> list[tuple[SequenceState, list[int]]]:
        requests = [seq.tag.request for seq in sequences]
        after_forward = None if self.faults is None else functools.partial(self.faults.after_forward, requests)
        decoding = not any(seq.prefilling for seq in sequences)  # asked before the step, which ends a prefill
        for attempt in self._retrying:
            with attempt:
                if self.faults is not None:
                    self.faults.before_step(requests)
                start = time.perf_counter()
                emitted = self.decoder.step(sequences, after_forward)
                seconds = time.perf_counter() - start
        if decoding:  # after the retries: a failure here must not run the step again
            self._record_step(emitted, len(sequences), seconds)
        return emitted

    def _record_step(self, emitted: list[tuple[SequenceState, list[int]]], batch: int, seconds: float) -> None:
        """For the estimated speedup: the step's cost, and target-only's for the same tokens,
        from the decoder's measured cost of a forward of one token per sequence (batch tokens)."""
        tokens = sum(len(new) for _, new in emitted)
        self.metrics.observe_decode_step(seconds, tokens, batch, self.decoder.costs.seconds.get(batch))

    def _deliver(self, emitted: list[tuple[SequenceState, list[int]]]) -> None:
        now = time.perf_counter()
        for seq, tokens in emitted:
            handle = seq.tag
            if tokens and handle.first_token_at is None:
                handle.first_token_at = now
                self.metrics.observe_time_to_first_token(handle.request.operation, now - handle.request.arrival)
            if seq.finish is not None:
                self._end(handle, seq)
            elif handle.request.stream and tokens:
                self._publish_new_text(handle, seq)

    def _end(
        self,
        handle: RequestHandle,
        seq: SequenceState | None = None,
        *,
        result: GenerationResult | None = None,
        error: BaseException | None = None,
        aborted: bool = False,
    ) -> None:
        """The one way a request ends: finished (seq.finish is set: its result is built here),
        answered from the response cache (result), failed (error) or aborted (its client went
        away). Its sequence leaves the batch first, whatever part of admission it got through;
        then, once, its metrics and spans, and its client's answer. Nothing escapes: the
        request has left the queue, so an error that reached the loop would leave its client
        waiting for good, and a client that hung up has cancelled the Future, which setting
        then must not crash the loop."""
        try:
            if seq is not None:
                self._leave_batch(seq)
                if result is None and error is None and not aborted:
                    result = self._result(seq)
            if result is not None and error is None and not aborted:
                self._record(handle, result)
                if handle.request.stream:  # the rest of the answer's text (the stream sent a prefix of it)
                    self._publish(handle, result.text[handle.streamed_chars :], result.logprobs or [], final=True)
        except Exception as failure:  # noqa: BLE001 - this request's failure, answered to it alone
            result, error = None, failure
        if handle.done:
            return
        handle.done = True
        if error is not None and not isinstance(error, SpecDecodeError):  # a user's mistake is no server failure
            logger.warning("request failed: %r", error)
        failure = "abort" if aborted else "" if error is None else type(error).__name__
        self.metrics.observe_request_end(
            handle.request.operation, time.perf_counter() - handle.request.arrival, failure
        )
        if aborted:
            self.metrics.requests_finished.labels("abort").inc()
        if handle.trace is not None:
            handle.trace.end(handle, result, error, aborted)
        try:
            if aborted:
                handle.future.cancel()
            elif error is None:
                handle.future.set_result(result)
            else:
                handle.future.set_exception(error)
        except InvalidStateError:
            pass  # cancelled by its client, or answered already
        handle.publish(None)

    def _leave_batch(self, seq: SequenceState) -> None:
        """seq out of the batch, its slot free: one that was admitted part way (a slot taken,
        then a failure) has a slot but is not in the batch."""
        if any(s is seq for s in self.decoder.active):
            with _traced(seq.tag):  # its drafters share the finished sequence: a Redis call with --cache-url
                self.decoder.remove(seq)
        elif seq.slot is not None:
            self.decoder.slots.release(seq.slot)
            seq.slot = None

    def _result(self, seq: SequenceState) -> GenerationResult:
        """A finished sequence's result, its answer remembered for the next identical request."""
        seq.stats.wall_time_s = time.perf_counter() - seq.tag.started_at
        result = self.engine.result(seq)
        with _traced(seq.tag):  # the response cache's write: a Redis call
            self.engine.caches.remember(seq)
        return result

    def _publish_new_text(self, handle: RequestHandle, seq: SequenceState) -> None:
        """The text the stream's new tokens add, decoded a window at a time (the cost of a step
        does not grow with the answer), less what may still begin a stop string."""
        if handle.new_text is None:
            handle.new_text = IncrementalText(self.engine.decode)
        self._publish(handle, handle.holdback.release(handle.new_text.extend(seq.generated)), seq.logprobs)

    @staticmethod
    def _publish(handle: RequestHandle, text: str, logprobs: list[TokenLogprob], final: bool = False) -> None:
        """Send text with the log-probabilities not sent yet; at the end (final), those of
        tokens that added no text too (an EOS)."""
        new = logprobs[handle.streamed_logprobs :]
        if text or (final and new):
            handle.publish(TextDelta(text, new))
            handle.streamed_chars += len(text)
            handle.streamed_logprobs = len(logprobs)

    def _record(self, handle: RequestHandle, result: GenerationResult) -> None:
        m, stats, now = self.metrics, result.stats, time.perf_counter()
        m.e2e_latency.observe(now - handle.request.arrival)
        operation = handle.request.operation
        if len(result.token_ids) > 1:  # the tokens after the first, as vLLM counts it
            m.observe_time_per_output_token(operation, (now - handle.first_token_at) / (len(result.token_ids) - 1))
        m.observe_finished(operation, stats, len(result.prompt_token_ids), len(result.token_ids))
        m.prompt_tokens.inc(len(result.prompt_token_ids))
        m.prefix_cache_hits.inc(stats.prompt_tokens_reused)
        m.generation_tokens.inc(len(result.token_ids))
        m.draft_tokens.inc(stats.drafted_tokens)
        m.accepted_tokens.inc(stats.accepted_tokens)
        m.target_forwards.inc(stats.target_forwards)
        sources = stats.drafted_by_source or {stats.drafter: [stats.drafted_tokens, stats.accepted_tokens]}
        for source, (drafted, accepted) in sources.items():
            if drafted:
                m.drafted_by_source.labels(source).inc(drafted)
                m.accepted_by_source.labels(source).inc(accepted)
        m.requests_finished.labels(result.finish_reason).inc()


def _traced(handle: RequestHandle) -> AbstractContextManager:
    """The request's trace context current in this thread (spans of its Redis calls join its
    trace), or nothing when it is not traced."""
    return handle.trace.current() if handle.trace is not None else _UNTRACED


def _max_tokens(asked: int | None, prompt_tokens: int, max_model_len: int) -> int:
    """The request's max_tokens, if prompt and completion fit in max_model_len (None: all the
    room left); refused otherwise, as vLLM does, rather than cut short."""
    room = max_model_len - prompt_tokens
    if asked is None:
        return room
    if asked > room:
        raise ContextLengthError(
            f"the prompt has {prompt_tokens} tokens and max_tokens is {asked}: {prompt_tokens + asked} in all, "
            f"more than max_model_len {max_model_len}; ask for at most {room} tokens or shorten the prompt",
            "max_tokens",
        )
    return asked
